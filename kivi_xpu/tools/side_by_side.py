"""``kivi-xpu bench``'s default mode, the caches side by side (see :mod:`kivi_xpu.tools.bench`): for every
(context, batch), each cache prefills the same prompt and decodes greedily, the caches taking turns run by run; a
row per cache and configuration with the medians over the runs and the ratios to ``DynamicCache``."""

from __future__ import annotations

import gc
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch

from ..integration import cache_argument
from .cli import progress
from .machine import report_header
from .memory import KvBytes, PeakMemory, kv_bytes, release_freed_memory
from .specs import CacheSpec, make_cache, third_party_failure
from .timing import (
    OpStats,
    add_step_ratios,
    competitors,
    fused_op_fields,
    phase_medians,
    synchronize,
    timed_fused_decode,
)
from .workload import BenchOptions, prepare, prompts


@dataclass
class Run:
    """One prefill + greedy decode of one cache configuration."""

    prefill_seconds: float
    decode_seconds: float  # the timed decode steps
    timed_steps: int
    tokens: torch.Tensor  # [B, new_tokens] greedy tokens
    kv: KvBytes
    peak_prefill_bytes: int | None  # peak resident set during the prefill, above the resident set before the run
    peak_decode_bytes: int | None  # same, during the decode steps
    peak_process_bytes: int | None  # the process's absolute peak resident set during the run
    op: OpStats | None  # the fused attention op's calls during the timed steps (None: no fused attention)
    phase_ms: dict[str, float] | None = None  # --phases: thread ms per call and phase (None: not timed)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens.shape[0] * self.timed_steps / self.decode_seconds


@dataclass
class Row:
    cache: str
    name: str
    bits: int | None
    context: int
    batch: int
    prefill_seconds: float
    decode_tokens_per_s: float
    ms_per_step: float
    kv_bytes: int
    kv_allocated_bytes: int
    kv_measured_bytes: int
    kv_check: str
    peak_prefill_bytes: int | None
    peak_decode_bytes: int | None
    peak_process_bytes: int | None
    generated_tokens: int
    token_match: float | None = None
    first_divergence: int | None = None
    speed_vs_dynamic: float | None = None
    prefill_vs_dynamic: float | None = None
    memory_vs_dynamic: float | None = None
    step_speedup_vs_dynamic: float | None = None  # DynamicCache's decode ms/step over this row's (above 1: faster)
    step_speedup_vs_static: float | None = None  # StaticCache's decode ms/step over this row's
    # The fused attention op (attn_implementation "kivi") in the timed decode steps; None for the other caches.
    # Each is the median over the runs of one run's median over its calls (one call per fused layer and step).
    fused_op_ms: float | None = None  # one call's time
    fused_op_calls_per_step: float | None = None
    fused_op_packed_bytes: int | None = None  # read per call: packed codes + scales + zeros of keys and values
    fused_op_exact_bytes: int | None = None  # read per call besides: the exact sinks and tail of keys and values
    fused_op_gb_per_s: float | None = None  # packed bytes / seconds of a call (1e9 bytes per GB)
    fused_op_bandwidth_fraction: float | None = None  # fused_op_gb_per_s / the machine's measured read bandwidth
    # --phases: thread ms per call in each phase of the native kernel (csrc/cpu/decode_attention.h: Phase; median
    # over the runs), summed over the threads that ran the call
    fused_op_phase_ms: dict[str, float] | None = None
    runs: list[dict] = field(default_factory=list)


@torch.no_grad()
def run_once(
    model, spec: CacheSpec, ids: torch.Tensor, new_tokens: int, warmup: int, options: BenchOptions, meter, bar
) -> Run:
    model.set_attn_implementation(spec.attn_implementation)
    release_freed_memory()
    baseline = meter.current()
    meter.reset()
    cache = make_cache(spec, model.config, options, ids.shape[1] + new_tokens)
    synchronize(ids.device)
    start = time.perf_counter()
    logits = model(ids, **cache_argument(cache), use_cache=True, logits_to_keep=1).logits[:, -1]
    synchronize(ids.device)
    prefill_seconds = time.perf_counter() - start
    peak_prefill = meter.peak()
    token = logits.argmax(-1, keepdim=True)
    tokens = [token]
    del logits
    release_freed_memory()
    meter.reset()
    timed_phases = options.phases and spec.attn_implementation == "kivi"
    decoded, decode_seconds, op, phase_ms = timed_fused_decode(
        model, cache, token, new_tokens - 1, warmup, bar, timed_phases
    )
    tokens += decoded
    peak_decode = meter.peak()
    run = Run(
        prefill_seconds,
        decode_seconds,
        new_tokens - 1 - warmup,
        torch.cat(tokens, dim=1),
        kv_bytes(cache),
        None if baseline is None else peak_prefill - baseline,
        None if baseline is None else peak_decode - baseline,
        None if baseline is None else max(peak_prefill, peak_decode),
        op,
        phase_ms,
    )
    del cache
    model.set_attn_implementation("sdpa")
    return run


def agreement(tokens: torch.Tensor, reference: torch.Tensor) -> tuple[float, int | None]:
    """(fraction of equal tokens, first position where any sequence differs or ``None``) of ``[B, N]`` tokens."""
    equal = tokens == reference
    differing = (~equal).any(dim=0).nonzero()
    return equal.float().mean().item(), (int(differing[0]) if len(differing) else None)


def summarize(spec: CacheSpec, context: int, runs: list[Run]) -> Row:
    first = runs[0]
    peaks = [[getattr(r, f) for r in runs] for f in ("peak_prefill_bytes", "peak_decode_bytes", "peak_process_bytes")]
    rate = statistics.median(r.tokens_per_s for r in runs)
    return Row(
        **spec.row_fields(),
        context=context,
        batch=first.tokens.shape[0],
        prefill_seconds=statistics.median(r.prefill_seconds for r in runs),
        decode_tokens_per_s=rate,
        ms_per_step=1000 * statistics.median(r.decode_seconds / r.timed_steps for r in runs),
        kv_bytes=first.kv.held,
        kv_allocated_bytes=first.kv.allocated,
        kv_measured_bytes=first.kv.measured,
        kv_check=first.kv.check,
        peak_prefill_bytes=None if None in peaks[0] else max(peaks[0]),
        peak_decode_bytes=None if None in peaks[1] else max(peaks[1]),
        peak_process_bytes=None if None in peaks[2] else max(peaks[2]),
        generated_tokens=first.tokens.shape[1],
        **fused_op_fields([r.op for r in runs]),
        fused_op_phase_ms=phase_medians([r.phase_ms for r in runs]),
        runs=[
            {
                "prefill_seconds": r.prefill_seconds,
                "decode_tokens_per_s": r.tokens_per_s,
                "fused_op_ms": None if r.op is None else 1000 * r.op.seconds,
            }
            for r in runs
        ],
    )


def measure(
    model, runnable: list[CacheSpec], make_prompt, options: BenchOptions, meter: PeakMemory
) -> tuple[list[Row], list[dict]]:
    """The warm-up runs, then every (context, batch) configuration ``--repeats`` times per cache; returns the rows
    and the configurations that failed (``skipped`` entries)."""
    show, failed = not options.no_progress, []
    # One untimed run per cache: kernel compilation and first-touch allocations stay out of the measurements.
    warm_context = min(min(options.contexts), 2 * options.residual_length)
    warm_ids = make_prompt(1, warm_context)
    with progress(show, total=len(runnable) * (options.warmup + 1), desc="warm-up", leave=False) as bar:
        for spec in runnable:
            start = bar.n
            warm = (model, spec, warm_ids, options.warmup + 2, options.warmup, options, meter, bar)
            _, reason = third_party_failure(spec, run_once, *warm)
            if reason:
                failed.append({"cache": spec.label, "context": warm_context, "batch": 1, "reason": f"warm-up {reason}"})
                bar.update(start + options.warmup + 1 - bar.n)  # the steps it will not run

    rows = []
    configurations = [(c, b) for c in options.contexts for b in options.batch_sizes]
    total_steps = len(configurations) * options.repeats * len(runnable) * (options.new_tokens - 1)
    with progress(show, total=total_steps, desc="bench", unit="step") as bar:
        for context, batch in configurations:
            ids = make_prompt(batch, context)
            runs: dict[CacheSpec, list[Run]] = {spec: [] for spec in runnable}
            for repeat in range(options.repeats):
                for spec in list(runs):  # caches take turns, so that load changes hit all of them alike
                    bar.set_description_str(f"ctx {context} batch {batch} {spec.label} run {repeat + 1}")
                    start = bar.n
                    measured = (model, spec, ids, options.new_tokens, options.warmup, options, meter, bar)
                    with competitors(options.contend):
                        run, reason = third_party_failure(spec, run_once, *measured)
                    if reason:
                        failed.append({"cache": spec.label, "context": context, "batch": batch, "reason": reason})
                        del runs[spec]  # not run again in this configuration
                        bar.update(start + (options.repeats - repeat) * (options.new_tokens - 1) - bar.n)
                    else:
                        runs[spec].append(run)
            results = [summarize(spec, context, spec_runs) for spec, spec_runs in runs.items()]
            add_ratios(results, runs)
            rows += results
    return rows, failed


def add_ratios(results: list[Row], runs: dict[CacheSpec, list[Run]]) -> None:
    add_step_ratios(results)
    base = next((r for r in results if r.name == "dynamic"), None)
    if base is None:
        return
    reference_tokens = runs[CacheSpec("dynamic")][0].tokens
    for row, spec_runs in zip(results, runs.values(), strict=True):
        row.speed_vs_dynamic = row.decode_tokens_per_s / base.decode_tokens_per_s
        row.prefill_vs_dynamic = base.prefill_seconds / row.prefill_seconds
        row.memory_vs_dynamic = base.kv_bytes / row.kv_bytes
        row.token_match, row.first_divergence = agreement(spec_runs[0].tokens, reference_tokens)


def side_by_side(options: BenchOptions) -> dict:
    """Runs the caches side by side (options already checked by ``bench.benchmark``); returns the JSON payload."""
    model, model_path, runnable, skipped = prepare(options)
    make_prompt = prompts(options, model, model_path, max(c * b for c in options.contexts for b in options.batch_sizes))
    meter = PeakMemory()
    # The model and the libraries live until the end: frozen, they are not rescanned by the collection before
    # every run (which otherwise takes most of a second).
    gc.collect()
    gc.freeze()
    try:
        rows, failed = measure(model, runnable, make_prompt, options, meter)
    finally:
        gc.unfreeze()
    payload = report_header("kivi-xpu bench", options, model_path=model_path)
    payload["environment"]["peak_memory_method"] = meter.method
    return payload | {"rows": [asdict(r) for r in rows], "skipped": skipped + failed}
