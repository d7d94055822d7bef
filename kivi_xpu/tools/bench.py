"""Benchmark of KV caches side by side in one process: prefill time, decode speed, KV memory, peak process memory
and greedy agreement with the full-precision ``DynamicCache``.

    kivi-xpu bench --model smollm2 --contexts 512 1024 2048 4096 --batch-sizes 1 4 --json bench.json --plot bench.png
    python -m kivi_xpu.tools.bench ...  (the same options)

For every (context, batch) each cache prefills the same prompt (random token ids, or consecutive slices of a text
with ``--text``) and greedily generates ``--new-tokens`` tokens; the first ``--warmup`` decode steps are not
timed. Every configuration runs ``--repeats`` times, the caches taking turns so that a change in machine load
hits all of them alike; the table gives medians and ratios to ``DynamicCache`` from the same run. One untimed
warm-up run per cache precedes all measurements (kernel compilation, first-touch allocations).

Caches: ``dynamic`` (transformers' ``DynamicCache``, full precision), ``kivi-fused`` (``KiviCache`` read by the
fused ``attn_implementation="kivi"``), ``kivi-dense`` (``KiviCache`` returning dense dequantized keys/values to
SDPA), ``quanto`` and ``hqq`` (transformers' ``QuantizedCache`` with that backend, when its package is installed).
Quantized caches run at every ``--bits`` value; the HF caches use the same group size and residual length as KIVI.

Memory: the KV bytes come from the cache's own accounting (``KiviCache.memory_report()``; the tensors the layers
hold for the others) and are cross-checked against the distinct tensor storages reachable from the cache object
(deduplicated by storage address); a disagreement is stated in the notes column. The peak memory columns are the
process's peak resident set (Linux ``VmHWM``, reset through ``/proc/self/clear_refs`` before each phase; elsewhere
a psutil sampler, :class:`kivi_xpu.tools.memory.PeakMemory`) above its resident set at the start of the run, after
returning freed memory to the OS: what this configuration needed on top of the model, during the prefill and during
the decode steps. The measurement itself: :mod:`kivi_xpu.tools.side_by_side`.

The limit: for the caches read by the fused attention, each call of the fused op in the timed decode steps is
timed (:func:`kivi_xpu.tools.timing.fused_op_timer`) with the packed bytes it reads; the row gives one call's time,
its GB/s of packed bytes and that rate's share of the machine's read bandwidth, measured after the runs with the same
threads (:func:`kivi_xpu.tools.machine.read_bandwidth`). With ``--phases`` the native kernel's own timers also
split each call into its phases (the task-start read of the packed keys, their metadata, factors and integer
products, the softmax, the values' metadata, factors and products, the exact sinks and tail, the merge): a second
table gives each phase's share of the call's thread time (:func:`kivi_xpu.tools.timing.fused_op_phases`). The
op's time and GB/s, and with ``--phases`` its phases, come with the caches side by side, with ``--curve`` and with
the named shapes below (not with ``--kv-budget``), e.g. on Llama-3.2-3B's layer shape (head_dim 128)::

    kivi-xpu bench --model llama-3.2-3b --layers 4 --contexts 8192 --batch-sizes 4 --caches static kivi-fused --phases

Model shapes people run, without their weights: ``--model`` with a name of :data:`kivi_xpu.tools.shapes.SHAPES`
(``llama-3.2-1b``, ``llama-3.2-3b``, ``llama-3.1-8b``, ``qwen2.5-7b``) builds that architecture with random weights
in seconds and runs the ``--curve`` measurement on it (caches filled with random K/V, no prefill): decode ms/step
against ``DynamicCache`` and ``StaticCache``, and where a step goes (the weights' products, the attention function,
the rest); ``--layers N`` builds only the first N decoder layers of the shape (a long context in every layer of a
large shape would not fit in memory)::

    kivi-xpu bench --model llama-3.1-8b --dtype bfloat16 --contexts 2048 8192 --batch-sizes 1 4 --new-tokens 8
"""

from __future__ import annotations

import argparse
import sys

from ..runtime import load_native_extension
from .budget import budget
from .cli import (
    add_cache_arguments,
    add_model_arguments,
    add_output_arguments,
    add_positive_ints,
    nonnegative_int,
    positive_float,
    positive_int,
    tool_main,
)
from .curve import curve
from .io import check_output_path, write_json
from .machine import read_bandwidth
from .options import ToolError
from .plots import bench_plot, budget_plot, check_matplotlib, curve_plot
from .report import bench_table, budget_table, curve_table, machine_line, phases_table
from .shapes import SHAPES
from .side_by_side import side_by_side
from .workload import BenchOptions

DEFAULTS = BenchOptions()


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``kivi-xpu bench`` / ``python -m kivi_xpu.tools.bench``."""
    add_model_arguments(p)
    add_positive_ints(p, "--contexts", DEFAULTS.contexts, "prompt lengths (space- or comma-separated)")
    add_positive_ints(p, "--batch-sizes", DEFAULTS.batch_sizes, "batch sizes")
    p.add_argument(
        "--new-tokens",
        type=positive_int,
        default=DEFAULTS.new_tokens,
        help="greedy tokens generated per run (the prefill yields the first; token match is over all of them)",
    )
    p.add_argument(
        "--warmup", type=nonnegative_int, default=DEFAULTS.warmup, help="untimed decode steps at the start of a run"
    )
    p.add_argument(
        "--repeats", type=positive_int, default=DEFAULTS.repeats, help="runs per configuration; medians reported"
    )
    p.add_argument(
        "--text",
        help="prompts from this text file, or 'wikipedia' / 'news' (kivi_xpu.assets.wikipedia_text / news_text), "
        "instead of random token ids; needs the model's tokenizer",
    )
    add_cache_arguments(p)
    add_output_arguments(p)
    p.add_argument("--plot", metavar="PATH", help="write a PNG: KV memory and decode tokens/s against context")
    p.add_argument(
        "--contend",
        type=nonnegative_int,
        default=DEFAULTS.contend,
        metavar="N",
        help="N CPU-bound competitor processes run during every measured run of every cache (default 0)",
    )
    p.add_argument(
        "--phases",
        action="store_true",
        help="split each call of the native fused attention into its phases with the kernel's own timers (a second "
        "table: where a call's time goes), side by side, with --curve and with a named shape (not with --kv-budget); "
        "the timers make the calls ~5-10%% slower",
    )
    p.add_argument(
        "--curve",
        action="store_true",
        help="long-context curve: decode ms/token and KV bytes against --contexts for dynamic, static and KIVI "
        "on a tiny random Llama whose caches are filled with random K/V (no --model, no --text)",
    )
    p.add_argument(
        "--layers",
        type=positive_int,
        metavar="N",
        help="with --model naming a shape: build only N decoder layers of it (the attention of one layer is the "
        "same; a long context of every layer of a large shape would not fit in memory)",
    )
    p.add_argument(
        "--kv-budget",
        type=positive_float,
        metavar="MIB",
        help="throughput at equal KV memory: for each cache and context, the largest batch whose KV fits MIB "
        "mebibytes, and its total decode tokens/s (--batch-sizes is not used)",
    )
    p.add_argument(
        "--max-batch",
        type=positive_int,
        default=DEFAULTS.max_batch,
        help=f"with --kv-budget: the largest batch tried (default {DEFAULTS.max_batch})",
    )


def benchmark(options: BenchOptions) -> dict:
    """Runs the benchmark the options describe (:func:`run_mode`), then measures the machine's read bandwidth with
    the same threads (:func:`kivi_xpu.tools.machine.read_bandwidth`, under ``environment.read_bandwidth``), and
    returns the JSON payload (``rows``, ``skipped``, ...) with each fused op's share of that bandwidth."""
    if options.new_tokens < options.warmup + 2:
        raise ToolError(
            f"--new-tokens ({options.new_tokens}) must exceed --warmup ({options.warmup}) + 1: the prefill yields the "
            "first token, the warm-up steps are not timed, and at least one decode step must be"
        )
    if options.layers is not None and options.model not in SHAPES:
        raise ToolError(f"--layers builds part of a named shape: --model must be one of {', '.join(SHAPES)}")
    if options.phases and options.kv_budget is not None:
        raise ToolError(
            "--phases times the fused attention of the caches side by side, of --curve and of the named shapes, "
            "not with --kv-budget"
        )
    if options.phases:
        try:
            load_native_extension()
        except RuntimeError as error:
            raise ToolError(f"--phases needs the native CPU kernels (their timers): {error}") from error
    check_output_path(options.json, "--json")
    check_output_path(options.plot, "--plot")
    if options.plot:
        check_matplotlib("--plot")
    payload = run_mode(options)  # --threads applied by then
    bandwidth = payload["environment"]["read_bandwidth"] = read_bandwidth()
    for row in payload["rows"]:
        if row.get("fused_op_gb_per_s") is not None:
            row["fused_op_bandwidth_fraction"] = row["fused_op_gb_per_s"] / bandwidth["gb_per_s"]
    return payload


def run_mode(options: BenchOptions) -> dict:
    """The JSON payload of the mode the options choose: ``--kv-budget``, ``--curve``, else the caches side by
    side."""
    if options.kv_budget is not None:
        return budget(options)
    if options.curve or options.model in SHAPES:
        return curve(options)
    return side_by_side(options)


def command(args) -> None:
    """``kivi-xpu bench``: run, print the table, write --plot and --json."""
    options = BenchOptions.from_namespace(args)
    payload = benchmark(options)
    table, plot = {
        "kivi-xpu bench --kv-budget": (budget_table, budget_plot),
        "kivi-xpu bench --curve": (curve_table, curve_plot),
    }.get(payload["tool"], (bench_table, bench_plot))
    print(table(payload), flush=True)
    if any(row.get("fused_op_phase_ms") for row in payload["rows"]):
        print("\n" + phases_table(payload), flush=True)
    elif options.phases:
        print(
            "--phases: no call of the native fused attention was timed (no kivi-fused row ran on the native CPU "
            "kernels: see --backend)",
            flush=True,
        )
    print(machine_line(payload), flush=True)
    if options.plot:
        plot(payload, options.plot)
    if options.json:
        write_json(options.json, payload)


def main(argv=None) -> int:
    return tool_main("kivi_xpu.tools.bench", __doc__, add_arguments, command, argv)


if __name__ == "__main__":
    sys.exit(main())
