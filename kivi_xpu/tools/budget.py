"""``kivi-xpu bench --kv-budget MiB``: decode throughput at equal KV memory, the KIVI paper's headline (bigger
batches in the same memory), measured.

For every context of ``--contexts`` and every cache:

1. one prompt of ``context`` tokens (random ids, or the start of ``--text``) is prefilled at batch 1;
2. a copy of that cache decodes ``--new-tokens - 1`` greedy steps at batch 1, and the largest KV the cache
   reserves at any point (after the prefill or after any step: its own accounting, spare capacity included) is
   one sequence's cost; the batch is ``floor(budget / cost)``, capped by ``--max-batch``;
3. timed runs (``--repeats``, the caches taking turns): a copy of the prefilled cache is repeated to that batch
   (``cache.batch_repeat_interleave``: every row holds the same prompt, which costs a decode step exactly what
   distinct prompts would and spares a prefill of batch x context tokens), then ``--new-tokens - 1`` greedy steps
   run, the first ``--warmup`` untimed. Total decode tokens/s = batch x timed steps / their seconds (median run).

Every cache's KV cost is linear in the batch (the same buffers per row), so batch x one sequence's peak is the
peak at that batch; the KV the cache holds at the end of each timed run is measured again (its accounting, and
the tensor storages reachable from it) and reported next to the budget.
"""

from __future__ import annotations

import copy
import gc
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from ..integration import cache_argument
from .cli import progress
from .machine import report_header
from .memory import MIB, KvBytes, accounted_bytes, kv_bytes, release_freed_memory
from .options import ToolError
from .specs import CacheSpec, make_cache
from .timing import competitors, timed_decode
from .workload import BenchOptions, prepare, prompts


@dataclass
class BudgetRow:
    cache: str
    name: str
    bits: int | None
    context: int
    budget_bytes: int
    sequence_kv_bytes: int  # the most one sequence's KV reserves during prefill + decode
    batch: int  # floor(budget / sequence_kv_bytes), at most --max-batch
    batch_capped: bool  # --max-batch, not the budget, set the batch
    kv_bytes: int  # the KV the cache reserves at the end of the first timed run (its accounting)
    kv_measured_bytes: int  # the tensor storages reachable from the cache at that point
    kv_check: str
    rows_match_one_sequence: bool  # every row of every timed run decoded the batch-1 tokens
    ms_per_step: float  # median over the repeats
    decode_tokens_per_s: float  # batch x timed steps / seconds, median over the repeats
    tokens_per_s_vs_dynamic: float | None = None
    batch_vs_dynamic: float | None = None
    runs_tokens_per_s: list[float] = field(default_factory=list)


@dataclass
class Prefilled:
    """One cache configuration prefilled at batch 1, kept to be copied for every run."""

    cache: object
    token: torch.Tensor  # [1, 1] the first greedy token
    tokens: torch.Tensor | None = None  # [1, new_tokens - 1] the greedy tokens of the batch-1 decode


@torch.no_grad()
def prefill(model, spec: CacheSpec, ids: torch.Tensor, options: BenchOptions) -> Prefilled:
    """Prefills ``ids [1, context]`` into a fresh cache of ``spec`` (sized for context + new tokens)."""
    model.set_attn_implementation(spec.attn_implementation)
    cache = make_cache(spec, model.config, options, ids.shape[1] + options.new_tokens)
    logits = model(ids, **cache_argument(cache), use_cache=True, logits_to_keep=1).logits[:, -1]
    return Prefilled(cache, logits.argmax(-1, keepdim=True))


@torch.no_grad()
def sequence_peak(model, spec: CacheSpec, start: Prefilled, options: BenchOptions, bar) -> int:
    """The most KV bytes one sequence's cache reserves from the end of the prefill through ``--new-tokens - 1``
    greedy steps (a copy of ``start`` is decoded; its tokens are kept in ``start.tokens``)."""
    model.set_attn_implementation(spec.attn_implementation)
    cache, token, tokens = copy.deepcopy(start.cache), start.token, []
    peak = accounted_bytes(cache)[1]
    for _ in range(options.new_tokens - 1):
        token = model(token, **cache_argument(cache), use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
        tokens.append(token)
        peak = max(peak, accounted_bytes(cache)[1])
        bar.update(1)
    start.tokens = torch.cat(tokens, dim=1)
    return peak


@torch.no_grad()
def timed_run(model, spec: CacheSpec, start: Prefilled, batch: int, options: BenchOptions, bar):
    """(seconds per timed step, KvBytes at the end, whether every row decoded the batch-1 tokens) of
    ``--new-tokens - 1`` greedy steps at ``batch`` rows from a copy of ``start`` repeated ``batch`` times."""
    model.set_attn_implementation(spec.attn_implementation)
    release_freed_memory()
    cache = copy.deepcopy(start.cache)
    repeat_rows(cache, batch)
    steps = options.new_tokens - 1
    with competitors(options.contend):
        tokens, seconds = timed_decode(model, cache, start.token.repeat(batch, 1), steps, options.warmup, bar)
    kv = kv_bytes(cache)
    del cache
    rows_match = bool((torch.cat(tokens, dim=1) == start.tokens).all())
    return seconds / (steps - options.warmup), kv, rows_match


def repeat_rows(cache, batch: int) -> None:
    """``cache.batch_repeat_interleave(batch)`` of a batch-1 cache; transformers 5.23's ``StaticLayer`` has no such
    method, so its preallocated ``[1, H, max_cache_len, D]`` keys and values are repeated here."""
    for layer in cache.layers:
        if hasattr(layer, "batch_repeat_interleave"):
            layer.batch_repeat_interleave(batch)
        else:
            layer.keys = layer.keys.repeat_interleave(batch, dim=0)
            layer.values = layer.values.repeat_interleave(batch, dim=0)
            layer.batch_size = batch


def fitting_batch(budget: int, sequence_bytes: int, max_batch: int) -> tuple[int, bool]:
    """(the largest batch whose KV fits ``budget`` bytes at ``sequence_bytes`` per sequence, at most
    ``max_batch``; whether the cap decided)."""
    fits = budget // sequence_bytes
    return min(fits, max_batch), fits > max_batch


def summarize(spec: CacheSpec, context: int, budget: int, peak: int, batch: int, capped: bool, runs) -> BudgetRow:
    seconds = [s for s, _, _ in runs]
    kv: KvBytes = runs[0][1]
    return BudgetRow(
        **spec.row_fields(),
        context=context,
        budget_bytes=budget,
        sequence_kv_bytes=peak,
        batch=batch,
        batch_capped=capped,
        kv_bytes=kv.allocated,
        kv_measured_bytes=kv.measured,
        kv_check=kv.check,
        rows_match_one_sequence=all(match for _, _, match in runs),
        ms_per_step=1000 * statistics.median(seconds),
        decode_tokens_per_s=batch / statistics.median(seconds),
        runs_tokens_per_s=[batch / s for s in seconds],
    )


def add_budget_ratios(rows: list[BudgetRow]) -> None:
    base = next((r for r in rows if r.name == "dynamic"), None)
    if base is None:
        return
    for row in rows:
        row.tokens_per_s_vs_dynamic = row.decode_tokens_per_s / base.decode_tokens_per_s
        row.batch_vs_dynamic = row.batch / base.batch


def measure_context(
    model, specs: list[CacheSpec], ids: torch.Tensor, options: BenchOptions, bar
) -> tuple[list[BudgetRow], list[dict]]:
    """The rows of one context (``ids [1, context]``) and the caches whose single sequence exceeds the budget."""
    context, budget = ids.shape[1], int(options.kv_budget * MIB)
    starts, batches, skipped = {}, {}, []
    for spec in specs:
        bar.set_description_str(f"ctx {context} {spec.label}: one sequence's KV")
        starts[spec] = prefill(model, spec, ids, options)
        peak = sequence_peak(model, spec, starts[spec], options, bar)
        batch, capped = fitting_batch(budget, peak, options.max_batch)
        if batch == 0:
            reason = f"one sequence needs {peak / MIB:.1f} MiB of KV, more than the budget"
            skipped.append({"cache": spec.label, "context": context, "batch": None, "reason": reason})
            del starts[spec]
            bar.update(options.repeats * (options.new_tokens - 1))  # the timed steps it will not run
        else:
            batches[spec] = (peak, batch, capped)
    runs = {spec: [] for spec in starts}
    for repeat in range(options.repeats):
        for spec in runs:  # caches take turns, so that load changes hit all of them alike
            bar.set_description_str(f"ctx {context} batch {batches[spec][1]} {spec.label} run {repeat + 1}")
            runs[spec].append(timed_run(model, spec, starts[spec], batches[spec][1], options, bar))
    rows = [summarize(spec, context, budget, *batches[spec], spec_runs) for spec, spec_runs in runs.items()]
    add_budget_ratios(rows)
    return rows, skipped


def budget(options: BenchOptions, make_prompt: Callable[[int, int], torch.Tensor] | None = None) -> dict:
    """Runs the equal-memory throughput benchmark (options already checked by ``bench.benchmark``); returns the
    JSON payload. ``make_prompt(batch, context) -> ids`` defaults to ``workload.prompts``."""
    if options.kv_budget <= 0:
        raise ToolError(f"--kv-budget must be a positive number of MiB; got {options.kv_budget}")
    if options.curve:
        raise ToolError("--kv-budget and --curve are different benchmarks: pass one of them")
    model, model_path, specs, skipped = prepare(options)
    make_prompt = make_prompt or prompts(options, model, model_path, max(options.contexts))
    steps = options.new_tokens - 1
    rows = []
    gc.collect()
    gc.freeze()  # the model and the libraries are not rescanned by every collection
    try:
        total = len(options.contexts) * len(specs) * (options.repeats + 1) * steps
        with progress(not options.no_progress, total=total, desc="kv budget", unit="step") as bar:
            for context in options.contexts:
                context_rows, context_skipped = measure_context(model, specs, make_prompt(1, context), options, bar)
                rows += context_rows
                skipped += context_skipped
    finally:
        gc.unfreeze()
        model.set_attn_implementation("sdpa")
    header = report_header("kivi-xpu bench --kv-budget", options, model_path=model_path)
    return header | {"rows": [asdict(r) for r in rows], "skipped": skipped}
