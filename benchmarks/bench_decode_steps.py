"""Decode ms/step of DynamicCache, StaticCache and KiviCache (fused) on SmolLM2-135M after one shared prefill.

One prefill with DynamicCache per context; its keys/values fill every cache through ``cache.update`` (the KIVI cache
quantizes them as a prefill would), then ``--steps`` single-token forward passes are timed per cache (median, first
2 untimed), the caches' steps interleaved (step s of each cache in turn, the order rotating) so that the machine's
slow phases (a shared VM's neighbours) hit every cache alike and the ratios of the full-precision caches' ms/step to
KIVI's printed (above 1: KIVI faster). Not a test: numbers depend on the machine; run it on a quiet one.
``KIVI_XPU_CPU_ISA=avx2`` measures the AVX2 path. ``--contend N`` times every cache twice, quiet and then with N
CPU-bound competitor processes running (those of ``kivi-xpu bench --contend``), and prints each cache's slowdown and
KIVI's slowdown over Dynamic's. ``kivi`` is the default KiviCache; ``kivi-paper`` the paper preset (no sinks, no
rotation), to measure what the default's options cost; ``kivi-fp32`` the default KiviCache with the native decode
attention on fp32 arithmetic (``KIVI_XPU_CPU_DOT=fp32``) instead of the default integer dot products, to measure
what the int8 path gains in the model (the arithmetic is switched before each of its steps); ``kivi-minmax`` the default
with the paper's min-max group fits instead of the least-squares ones, to measure what the refit costs a decode step;
``kivi-uniform`` the default without the model's shipped calibration (``layer_overrides=None``: every layer alike), to
measure what the calibration's per-layer settings cost a decode step.

    python benchmarks/bench_decode_steps.py --ctx 1024 4096 8192 --batch 1
    python benchmarks/bench_decode_steps.py --ctx 4096 --batch 4 --contend 2
    python benchmarks/bench_decode_steps.py --ctx 1024 8192 --caches dynamic kivi kivi-paper
    python benchmarks/bench_decode_steps.py --ctx 4096 8192 --batch 4 --caches dynamic static kivi kivi-fp32
    python benchmarks/bench_decode_steps.py --ctx 1024 8064 --threads 1 --json benchmarks/results/steps-b1.json

``--json PATH`` writes the rows (round, context, batch, cache, ms/step, the KV bytes each cache holds) with the
machine (``lscpu`` lines, CPU family and model), the kernels and the commit; ``benchmarks/make_figures.py`` draws the
docs' pictures from such files. On a machine shared with other jobs, ``--rounds N`` measures every context N times, one
pass over the contexts after another, so that each context has rounds at different moments (the figures take, per
context, the round whose steps were fastest: the least disturbed). ``--shared-prompt`` prefills one sequence and gives
its keys/values to every row of the batch (the decode work is the same; the prefill costs a batch-1 prefill).
"""

import argparse
import datetime
import os
import platform
import statistics
import subprocess
import time

import torch
from transformers import AutoModelForCausalLM, DynamicCache, StaticCache

import kivi_xpu
from kivi_xpu import KiviCache, assets, backend
from kivi_xpu.integration import cache_argument
from kivi_xpu.tools.io import write_json
from kivi_xpu.tools.machine import cpu_facts, lscpu_lines
from kivi_xpu.tools.memory import kv_bytes
from kivi_xpu.tools.timing import competitors

p = argparse.ArgumentParser()
p.add_argument("--ctx", type=int, nargs="+", default=[1024, 4096, 8192])
p.add_argument("--batch", type=int, default=1)
p.add_argument("--steps", type=int, default=16)
p.add_argument("--backend", default=None)
p.add_argument("--caches", nargs="+", default=["dynamic", "static", "kivi"])
p.add_argument("--profile", action="store_true")
p.add_argument("--contend", type=int, default=0, help="also time every cache with N competitor processes")
p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
p.add_argument("--json", default=None, metavar="PATH", help="write the rows and the machine as JSON")
p.add_argument("--rounds", type=int, default=1, help="passes over all the contexts (default 1)")
p.add_argument("--shared-prompt", action="store_true", help="every row of the batch holds one prefilled prompt")
p.add_argument("--note", default=None, help="a line stored in the JSON, e.g. which build ran")
args = p.parse_args()
if args.threads:
    torch.set_num_threads(args.threads)
try:
    from kivi_xpu import _cpu as native

    default_dot = native.dot()
except ImportError:
    native = default_dot = None
print(*lscpu_lines(), sep="\n")
print("KIVI kernels:", backend.select(args.backend).describe(), "| torch threads:", torch.get_num_threads())
torch.manual_seed(0)
path = assets.smollm2_checkpoint()
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
cfg = model.config


def fill(cache, kv, ctx):
    for i, (k, v) in enumerate(kv):
        cache.update(k, v, i, {"cache_position": torch.arange(ctx)})


def make_cache(kind, kv, ctx):
    if kind == "dynamic":
        cache = DynamicCache(config=cfg)
    elif kind == "static":
        cache = StaticCache(config=cfg, max_cache_len=ctx + args.steps + 4)
    else:
        preset = "paper" if kind == "kivi-paper" else "default"
        fit = {"kivi-minmax": "minmax"}.get(kind)  # None: the preset's
        overrides = None if kind == "kivi-uniform" else "auto"
        cache = KiviCache(config=cfg, backend=args.backend, preset=preset, fit=fit, layer_overrides=overrides)
    fill(cache, kv, ctx)
    return cache


def step(kind, cache, tok, pos):
    """One timed decode step of `cache`; returns (seconds, next token)."""
    model.set_attn_implementation("kivi" if kind.startswith("kivi") else "sdpa")
    if native is not None:
        native.set_dot("fp32" if kind == "kivi-fp32" else default_dot)
    t0 = time.perf_counter()
    out = model(input_ids=tok, **cache_argument(cache), cache_position=pos, position_ids=pos.expand(args.batch, 1))
    return time.perf_counter() - t0, out.logits[:, -1:].argmax(-1)


def run(kinds, kv, ctx):
    """Median ms/step of each cache, the caches' steps interleaved (step s of every cache, in an order that rotates
    with s) so that a slow phase of the machine hits them all alike."""
    caches = {kind: make_cache(kind, kv, ctx) for kind in kinds}
    tokens = {
        kind: torch.randint(0, 1000, (args.batch, 1), generator=torch.Generator().manual_seed(1)) for kind in kinds
    }
    held = {kind: kv_bytes(cache).held for kind, cache in caches.items()}
    times = {kind: [] for kind in kinds}
    with torch.inference_mode():
        for s in range(args.steps):
            pos = torch.tensor([ctx + s])
            for i in range(len(kinds)):
                kind = kinds[(s + i) % len(kinds)]
                seconds, tokens[kind] = step(kind, caches[kind], tokens[kind], pos)
                times[kind].append(seconds)
    return {kind: statistics.median(t[2:]) * 1e3 for kind, t in times.items()}, held


def machine() -> dict:
    """The CPU (``lscpu`` lines, family and model), torch threads, kernels and the commit of the kivi_xpu imported
    (``git describe`` in its directory), for ``--json``."""
    info = {line.split(":")[0].strip(): line.split(":", 1)[1].strip() for line in lscpu_lines()}
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    except OSError:
        lscpu = ""
    fields = dict(line.split(":", 1) for line in lscpu.splitlines() if ":" in line)
    try:
        package = os.path.dirname(os.path.abspath(kivi_xpu.__file__))
        describe = ["git", "-C", package, "describe", "--always", "--dirty"]
        commit = subprocess.run(describe, capture_output=True, text=True).stdout or f"not a git checkout: {package}"
    except OSError:
        commit = ""
    return {
        "cpu": cpu_facts() | {k: fields.get(k, "").strip() for k in ("CPU family", "Model", "CPU(s)")},
        "lscpu_model_name": info.get("Model name"),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "kivi_kernels": backend.select(args.backend).describe(),
        "python": platform.python_version(),
        "commit": commit.strip(),
    }


rows = []


for round_, ctx in ((r, c) for r in range(args.rounds) for c in args.ctx):
    with torch.inference_mode():
        ids = torch.randint(0, 30000, (1 if args.shared_prompt else args.batch, ctx))
        dc = DynamicCache(config=cfg)
        model.set_attn_implementation("sdpa")
        model(input_ids=ids, **cache_argument(dc), use_cache=True)
        rows_kv = (args.batch, -1, -1, -1)
        kv = [
            (lay.keys[:, :, :ctx].expand(rows_kv).clone(), lay.values[:, :, :ctx].expand(rows_kv).clone())
            for lay in dc.layers
        ]
        del dc
    res, held = run(args.caches, kv, ctx)
    rows += [
        {"round": round_, "context": ctx, "batch": args.batch, "cache": k, "ms_per_step": v, "kv_bytes": held[k]}
        for k, v in res.items()
    ]
    if args.contend:
        with competitors(args.contend):
            loaded, _ = run(args.caches, kv, ctx)
    if args.profile and "kivi" in args.caches:
        with torch.profiler.profile() as prof:
            run(["kivi"], kv, ctx)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=int(os.environ.get("ROWS", 25))))
    line = f"{f'round {round_} ' if args.rounds > 1 else ''}ctx {ctx} b{args.batch}: " + ", ".join(
        f"{k} {v:.1f} ms" for k, v in res.items()
    )
    if "kivi" in res:
        for base in ("dynamic", "static", "kivi-paper", "kivi-fp32", "kivi-minmax", "kivi-uniform"):
            if base in res:
                line += f"  | {base}/KIVI {res[base] / res['kivi']:.2f}x"
    print(line, flush=True)
    if args.contend:
        slowdown = {k: loaded[k] / res[k] for k in loaded}
        line = f"  with {args.contend} competitors: " + ", ".join(
            f"{k} {loaded[k]:.1f} ms ({slowdown[k]:.2f}x slower)" for k in loaded
        )
        if "kivi" in slowdown and "dynamic" in slowdown:
            line += f"  | KIVI slowdown / Dynamic slowdown {slowdown['kivi'] / slowdown['dynamic']:.2f}"
        print(line, flush=True)

if args.json:
    settings = {"ctx": args.ctx, "batch": args.batch, "steps": args.steps, "caches": args.caches}
    payload = {
        "tool": "benchmarks/bench_decode_steps.py",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "model": "SmolLM2-135M-Instruct (fp32)",
        "settings": settings
        | {"threads": args.threads, "contend": args.contend, "backend": args.backend, "rounds": args.rounds}
        | {"shared_prompt": args.shared_prompt, "note": args.note},
        "environment": machine(),
        "rows": rows,
    }
    write_json(args.json, payload)
    print("wrote", args.json)
