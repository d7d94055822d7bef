"""In-model A/B of two revisions of the Python package around the same native kernels (a cache layer's Python path:
streams, codecs, the steady run, the hand-over), in alternating processes: SmolLM2-135M fp32 under the fused
attention, the default ``KiviCache`` over a random history of ``--context`` tokens. Each process times ``--steps``
decode steps of two kinds, alternating: steady steps, and steps whose layers all plan a new steady run (each layer's
run dropped before the step, as after a key block or a window move). The driver runs ``--pairs`` pairs of processes,
A and B in alternating order, and prints each arm's medians and the median of the per-pair ratios A/B with their
quartiles (above 1: B faster).

Each revision runs from a git worktree (``-``: the working tree) with this checkout's built extensions copied in, so
both arms run the same kernels: the revisions must share ``csrc/`` (checked). Runs of one build after another are
mostly noise on a shared VM; alternating processes keep the drift out of the ratio.

    python benchmarks/bench_ab_python.py --a bc2f283 --b - --batch 1 --context 1024 --pairs 5
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUILT = ("*.so", "_build_info.py", "_kernel_source.h")  # what the build writes into kivi_xpu/


def tree_of(revision: str) -> Path:
    """The directory whose ``kivi_xpu`` runs ``revision``: the working tree for ``-``, else a worktree (made once)."""
    if revision == "-":
        return ROOT
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", revision], capture_output=True, text=True,
                            check=True).stdout.strip()  # fmt: skip
    changed = subprocess.run(["git", "-C", str(ROOT), "diff", "--quiet", commit, "--", "csrc"], check=False)
    if changed.returncode:
        raise SystemExit(f"{revision} has other csrc/ than the working tree: compare kernels with bench_ab_builds.py")
    tree = Path(tempfile.gettempdir()) / "kivi_xpu_ab_python" / commit[:12]
    if not tree.exists():
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), commit], check=True,
                       capture_output=True)  # fmt: skip
    for pattern in BUILT:
        for built in (ROOT / "kivi_xpu").glob(pattern):
            shutil.copy2(built, tree / "kivi_xpu" / built.name)
    return tree


def worker(args) -> None:
    """One process: times the decode steps and prints their medians (ms) as JSON on its last line."""
    import torch
    from transformers import AutoModelForCausalLM

    import kivi_xpu
    from kivi_xpu import KiviCache, assets
    from kivi_xpu.cache import config_head_dim
    from kivi_xpu.integration import cache_argument

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(assets.smollm2_checkpoint(), dtype=torch.float32).eval()
    model.set_attn_implementation("kivi")
    cfg, b, n = model.config, args.batch, args.context
    cache = KiviCache(config=cfg)
    for layer in range(cfg.num_hidden_layers):
        k = torch.randn(b, cfg.num_key_value_heads, n, config_head_dim(cfg))
        cache.update(k, torch.randn_like(k), layer, {"cache_position": torch.arange(n)})
    token = torch.randint(0, cfg.vocab_size, (b, 1))
    times = {"steady": [], "run_start": []}
    with torch.no_grad():
        for step in range(args.steps + 4):
            starts_runs = step % 2 == 1
            if starts_runs:
                for layer in cache.layers:
                    layer._steady_run = None  # (both revisions keep the layer's run there)
            position = torch.tensor([n + step])
            start = time.perf_counter()
            model(input_ids=token, **cache_argument(cache), cache_position=position, position_ids=position.expand(b, 1))
            if step >= 4:
                times["run_start" if starts_runs else "steady"].append(time.perf_counter() - start)
    medians = {what: statistics.median(seconds) * 1e3 for what, seconds in times.items()}
    print(json.dumps({"package": str(Path(kivi_xpu.__file__).parent), **medians}))


def add_ab_arguments(parser, pairs: int) -> None:
    """The driver's ``--a``, ``--b``, ``--pairs`` and the hidden ``--worker``."""
    parser.add_argument("--a", default="HEAD", help="git revision of A, or - for the working tree (default HEAD)")
    parser.add_argument("--b", default="-", help="git revision of B, or - for the working tree (default -)")
    parser.add_argument("--pairs", type=int, default=pairs, help=f"process pairs (default {pairs})")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)


def alternate(args, run_arm, describe) -> dict[str, list[dict]]:
    """``args.pairs`` pairs of processes of revisions ``args.a`` and ``args.b`` (``run_arm(tree, args)`` runs one),
    in alternating order; prints the CPU, each pair (``describe(result)``) and returns each arm's results."""
    from kivi_xpu.tools.machine import lscpu_lines

    print(*lscpu_lines(), sep="\n", flush=True)
    trees = {"A": tree_of(args.a), "B": tree_of(args.b)}
    results = {"A": [], "B": []}
    for pair in range(args.pairs):
        for arm in ("A", "B") if pair % 2 == 0 else ("B", "A"):
            results[arm].append(run_arm(trees[arm], args))
        print(f"pair {pair + 1}: " + ", ".join(f"{arm} {describe(r[-1])}" for arm, r in results.items()), flush=True)
    return results


def run_arm(tree: Path, args) -> dict:
    return run_worker(__file__, tree, ["--batch", str(args.batch), "--context", str(args.context), "--steps",
                                       str(args.steps)])  # fmt: skip


def run_worker(script: str, tree: Path, flags: list[str]) -> dict:
    """Runs ``script --worker flags`` with ``tree``'s package first on the path; the JSON of its last line (whose
    ``package`` must be ``tree``'s)."""
    command = [sys.executable, script, "--worker", *flags]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run(command, env=env, capture_output=True, text=True, check=True).stdout
    result = json.loads(out.strip().splitlines()[-1])
    if Path(result["package"]) != tree / "kivi_xpu":
        raise SystemExit(f"the worker imported {result['package']}, not {tree / 'kivi_xpu'}")
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_ab_arguments(p, pairs=5)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--steps", type=int, default=60, help="decode steps timed per process (default 60)")
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    results = alternate(args, run_arm, lambda r: f"{r['steady']:.2f} / {r['run_start']:.2f} ms")
    print(f"SmolLM2-135M fp32, batch {args.batch}, context {args.context}, {args.steps} steps per process, "
          f"{args.pairs} pairs; A = {args.a}, B = {args.b}")  # fmt: skip
    for what, label in (("steady", "steady step"), ("run_start", "step planning new runs")):
        a, b = ([r[what] for r in results[arm]] for arm in ("A", "B"))
        ratios = [x / y for x, y in zip(a, b, strict=True)]
        q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (ratios[0],) * 3
        print(f"  {label} ms: A {statistics.median(a):.2f}, B {statistics.median(b):.2f}; A/B per pair: median "
              f"{statistics.median(ratios):.3f} (quartiles {q[0]:.3f}-{q[2]:.3f})")  # fmt: skip


if __name__ == "__main__":
    main()
