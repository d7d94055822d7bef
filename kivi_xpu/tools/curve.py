"""``kivi-xpu bench --curve``: decode ms/step and KV bytes against long contexts (up to 128k tokens and beyond)
for ``DynamicCache``, ``StaticCache`` and KIVI, on a tiny random Llama.

A long context is built without a prefill (a 128k-token prefill through SDPA would need a 128k x 128k mask): every
layer of a fresh cache receives ``context`` tokens of random keys and values (standard normal, seeded) through one
``cache.update`` call, exactly as a prefill would hand them over. Then ``--new-tokens - 1`` greedy decode steps
run through the model, the first ``--warmup`` untimed; only those steps are timed. The model has the per-layer
attention shape of a mid-size model (4 KV heads of 128 channels) but tiny projections, so that attention over the
cache dominates a step; no grouped-query attention, so that SDPA never repeats the history per query head. fp32
KV: 8 KiB per token (1 GiB at 131072 tokens) for the dense caches, which with the copy ``DynamicCache`` makes per
step fits in a few GiB for every cache.

For the caches read by the fused attention, each call of the op in the timed steps is timed as in the side-by-side
mode (:func:`kivi_xpu.tools.timing.timed_fused_decode`: one call's ms and GB/s of packed bytes) and, with
``--phases``, split into its phases by the native kernel's timers; ``bench.benchmark`` adds the rate's share of the
machine's read bandwidth.
"""

from __future__ import annotations

import gc
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import NamedTuple

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from ..cache import config_head_dim
from .cli import apply_process_options, progress
from .loading import model_device
from .machine import report_header
from .memory import KvBytes, kv_bytes, release_freed_memory
from .options import DTYPES, ToolError, ToolOptions
from .shapes import SHAPES, parameter_bytes, shape_model
from .specs import CacheSpec, cache_specs, check_cache_options, make_cache
from .timing import (
    OpStats,
    add_step_ratios,
    competitors,
    fused_op_fields,
    phase_medians,
    step_parts,
    synchronize,
    timed_decode,
    timed_fused_decode,
)
from .workload import BenchOptions

CURVE_LLAMA = dict(
    vocab_size=256,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    head_dim=128,
)
CURVE_CACHES = ("dynamic", "static", "kivi-fused", "kivi-dense")
FILL = "random K/V (standard normal, seeded) written into every layer by one cache.update call; no prefill"
PART_STEPS = 3  # decode steps after the timed ones, run with step_parts' timers (not part of ms/step)


def curve_model(max_positions: int, dtype: str, device: str = "cpu") -> LlamaForCausalLM:
    """The tiny random Llama (seeded: initialised on the CPU, so every ``device`` gets the same weights) in ``dtype``
    on ``device`` (a torch device string, checked by :func:`~kivi_xpu.tools.loading.model_device`)."""
    target = model_device(device)
    torch.manual_seed(0)
    config = LlamaConfig(**CURVE_LLAMA, max_position_embeddings=max_positions)
    return LlamaForCausalLM(config).to(device=target, dtype=DTYPES[dtype]).eval()


@torch.no_grad()
def fill(
    cache, config, batch: int, context: int, dtype: torch.dtype, generator: torch.Generator, device: torch.device
) -> float:
    """Writes ``context`` tokens of random ``[batch, H_kv, context, D]`` keys and values on ``device`` (drawn from
    the CPU ``generator``, so that every device gets the same values) into every layer of ``cache``; returns the
    seconds."""
    shape = (batch, config.num_key_value_heads, context, config_head_dim(config))  # (Qwen2's config has no head_dim)
    start = time.perf_counter()
    for layer in range(config.num_hidden_layers):
        keys, values = (torch.randn(shape, generator=generator).to(device=device, dtype=dtype) for _ in range(2))
        cache.update(keys, values, layer)
        del keys, values
    synchronize(device)
    return time.perf_counter() - start


@dataclass
class CurveRow:
    cache: str
    name: str
    bits: int | None
    context: int
    batch: int
    ms_per_step: float  # median over the repeats of the timed decode steps' mean
    decode_tokens_per_s: float
    kv_bytes: int
    kv_allocated_bytes: int
    kv_measured_bytes: int
    kv_check: str
    fill_seconds: float  # median time to write the context's random K/V (not a prefill time)
    # Where a step goes (timing.step_parts, PART_STEPS steps after the timed ones, CPU only), ms per step:
    weights_ms: float | None = None  # nn.Linear calls (the products with the weights)
    attention_ms: float | None = None  # the attention function (the fused op, or SDPA over dense states)
    rest_ms: float | None = None  # everything else: norms, rope, the cache's own work, argmax
    step_speedup_vs_dynamic: float | None = None
    step_speedup_vs_static: float | None = None
    # The fused attention op in the timed decode steps, as in kivi_xpu.tools.side_by_side.Row (None for the caches
    # without it): one call's ms, calls per step, packed and exact bytes read per call, GB/s of packed bytes, that
    # rate's share of the machine's read bandwidth (set by bench.benchmark) and, with --phases, thread ms per call
    # in each phase of the native kernel; medians over the runs of each run's median over its calls.
    fused_op_ms: float | None = None
    fused_op_calls_per_step: float | None = None
    fused_op_packed_bytes: int | None = None
    fused_op_exact_bytes: int | None = None
    fused_op_gb_per_s: float | None = None
    fused_op_bandwidth_fraction: float | None = None
    fused_op_phase_ms: dict[str, float] | None = None
    runs_ms_per_step: list[float] = field(default_factory=list)


class CurveRun(NamedTuple):
    """One fill + decode of one cache configuration."""

    seconds: float  # per timed decode step
    kv: KvBytes
    fill_seconds: float
    parts: dict[str, float] | None  # seconds per step in timing.step_parts' parts and "step" (None: not timed)
    op: OpStats | None  # the fused attention op's calls during the timed steps (None: no fused attention)
    phase_ms: dict[str, float] | None  # --phases: thread ms per call and phase (None: not timed)


@torch.no_grad()
def curve_once(model, spec: CacheSpec, options: BenchOptions, context: int, batch: int, contend: int, bar) -> CurveRun:
    """One fresh cache filled to ``context`` tokens, its decode steps run next to ``contend`` competitor processes:
    the fused op's calls in the timed steps timed (with ``--phases``, their phases too), then ``PART_STEPS`` steps
    split into their parts."""
    original = model.config._attn_implementation_internal  # (restored as it was: the default stays the default)
    model.set_attn_implementation(spec.attn_implementation)
    release_freed_memory()
    cache = make_cache(spec, model.config, options, context + options.new_tokens + PART_STEPS)
    generator = torch.Generator().manual_seed(context)
    fill_seconds = fill(cache, model.config, batch, context, model.dtype, generator, model.device)
    token = torch.randint(0, model.config.vocab_size, (batch, 1), generator=generator).to(model.device)
    steps = options.new_tokens - 1
    with competitors(contend):
        timed_phases = options.phases and spec.attn_implementation == "kivi"
        decoded, seconds, op, phase_ms = timed_fused_decode(
            model, cache, token, steps, options.warmup, bar, timed_phases
        )
        parts = None
        if model.device.type == "cpu":  # (the part timers read the clock around each call)
            with step_parts(model) as parts:
                _, parts_seconds = timed_decode(model, cache, decoded[-1], PART_STEPS, 0, bar)
            parts = {k: v / PART_STEPS for k, v in parts.items()} | {"step": parts_seconds / PART_STEPS}
    kv = kv_bytes(cache)
    del cache
    model.config._attn_implementation_internal = original
    return CurveRun(seconds / (steps - options.warmup), kv, fill_seconds, parts, op, phase_ms)


def curve_specs(options: ToolOptions) -> tuple[list[CacheSpec], list[dict]]:
    """The requested caches that the curve runs, and the others as ``skipped`` entries."""
    specs = cache_specs(options)
    skipped = [
        {"cache": s.label, "context": None, "batch": None, "reason": f"--curve runs {', '.join(CURVE_CACHES)}"}
        for s in specs
        if s.name not in CURVE_CACHES
    ]
    return [s for s in specs if s.name in CURVE_CACHES], skipped


def curve(options: BenchOptions) -> dict:
    """Runs the long-context curve (options already checked by ``bench.benchmark``); returns the JSON payload."""
    shape = options.model if options.model in SHAPES else None
    if options.text is not None or (shape is None and options.model != ToolOptions.model):
        raise ToolError(
            "--curve runs a tiny random Llama, or a named shape (--model with one of "
            f"{', '.join(SHAPES)}), on random K/V: drop --text, and --model unless it names a shape"
        )
    apply_process_options(options)
    positions = max(options.contexts) + options.new_tokens + PART_STEPS
    if shape is None:
        model = curve_model(positions, options.dtype, options.device)
    else:
        model = shape_model(shape, DTYPES[options.dtype], model_device(options.device), positions, options.layers)
    specs, skipped = curve_specs(options)
    check_cache_options(specs, model.config, options)
    configurations = [(c, b) for c in options.contexts for b in options.batch_sizes]
    steps = options.new_tokens - 1
    rows = []
    total = (len(configurations) * options.repeats + 1) * len(specs) * steps
    with progress(not options.no_progress, total=total, desc="curve", unit="step") as bar:
        for spec in specs:  # one untimed run per cache: kernel compilation, first-touch allocations
            curve_once(model, spec, options, min(options.contexts), 1, 0, bar)
        for context, batch in configurations:
            runs = {spec: [] for spec in specs}
            for repeat in range(options.repeats):
                for spec in specs:  # caches take turns, so that load changes hit all of them alike
                    bar.set_description_str(f"ctx {context} batch {batch} {spec.label} run {repeat + 1}")
                    runs[spec].append(curve_once(model, spec, options, context, batch, options.contend, bar))
            results = [summarize(spec, context, batch, spec_runs) for spec, spec_runs in runs.items()]
            add_step_ratios(results)
            rows += results
            gc.collect()
    text = model.config
    described = "tiny random Llama (kivi_xpu.tools.curve.CURVE_LLAMA)"
    fields = CURVE_LLAMA
    if shape is not None:
        gib = parameter_bytes(model) / 2**30
        described = f"{shape} shape with random weights (kivi_xpu.tools.shapes), {gib:.2f} GiB"
        fields = SHAPES[shape][2] | {"num_hidden_layers": text.num_hidden_layers}
    return report_header("kivi-xpu bench --curve", options, model=described) | {
        "curve_model": fields | {"max_position_embeddings": text.max_position_embeddings, "dtype": options.dtype},
        "context_fill": FILL,
        "rows": [asdict(r) for r in rows],
        "skipped": skipped,
    }


def summarize(spec: CacheSpec, context: int, batch: int, runs: list[CurveRun]) -> CurveRow:
    seconds = [r.seconds for r in runs]
    parts = [r.parts for r in runs if r.parts is not None]
    split = {}
    if parts:
        split = {k: 1000 * statistics.median(p[k] for p in parts) for k in ("weights", "attention", "step")}
    kv = runs[0].kv
    step = statistics.median(seconds)
    return CurveRow(
        **spec.row_fields(),
        context=context,
        batch=batch,
        ms_per_step=1000 * step,
        decode_tokens_per_s=batch / step,
        kv_bytes=kv.held,
        kv_allocated_bytes=kv.allocated,
        kv_measured_bytes=kv.measured,
        kv_check=kv.check,
        fill_seconds=statistics.median(r.fill_seconds for r in runs),
        weights_ms=split.get("weights"),
        attention_ms=split.get("attention"),
        rest_ms=split["step"] - split["weights"] - split["attention"] if split else None,
        **fused_op_fields([r.op for r in runs]),
        fused_op_phase_ms=phase_medians([r.phase_ms for r in runs]),
        runs_ms_per_step=[1000 * s for s in seconds],
    )
