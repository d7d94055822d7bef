"""Instructions per layer update of two revisions of the Python package, counted by valgrind (callgrind), which counts
the same for the same program whatever else the machine does: where timings of the Python path differ by less than
the VM's drift, the instruction counts still tell. One layer of SmolLM2-135M's attention shape (3 kv heads, head_dim
64), batch 1, the default ``KiviCache`` under the fused attention, a 256-token prompt, then ``--steps`` decode steps,
each ``update`` followed by the attention's ``take_over``, in one of two modes: ``steady`` (the one-call steps of a
steady run, with its plans and key blocks as they come) or ``run-start`` (the layer's run dropped before every
step, so that each step plans a new one). ``paged``: continuous batching on KIVI pages instead
(``kivi_xpu.paged.generate_batch``), 4 requests of 300 prompt tokens on a 2-layer Llama of SmolLM2's head shapes,
``--steps`` new tokens each: what one decode forward of the 4 costs (the paged store and attention around the same
kernels, and the model's own work). The count of a run with ``--steps`` minus one with ``--base-steps``, divided
by the difference, is what one update costs; the start-up (``import torch``, ~16 G instructions) cancels.

Each revision runs from a git worktree (``-``: the working tree) with this checkout's built extensions copied in, as
``bench_ab_python.py`` makes them. Each count takes a few minutes (valgrind runs Python ~50x slower).

    python benchmarks/bench_update_instructions.py --a bc2f283 --b - --mode steady
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_ab_python import tree_of  # noqa: E402


def paged_worker(steps: int) -> None:
    """The counted program of ``--mode paged``: ``steps`` new tokens of 4 requests through continuous batching."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    from kivi_xpu.paged import generate_batch

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=192, intermediate_size=384, num_hidden_layers=2,
                         num_attention_heads=3, num_key_value_heads=1, head_dim=64)  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    prompts = torch.randint(0, 256, (4, 300)).tolist()
    greedy = GenerationConfig(max_new_tokens=steps, do_sample=False, eos_token_id=-1, pad_token_id=0)
    generate_batch(model, prompts, greedy, kv_memory=64 * 2**20, max_new_tokens=steps, backend="native")


def worker(steps: int, mode: str) -> None:
    """The counted program: a prompt, then ``steps`` updates of one layer, each with its hand-over taken."""
    if mode == "paged":
        paged_worker(steps)
        return
    import torch

    from kivi_xpu import KiviCache
    from kivi_xpu.attention import take_over

    class Module:  # what take_over reads of an attention module
        config = type("Config", (), {"_attn_implementation": "kivi"})()

    torch.manual_seed(0)
    cache = KiviCache(backend="native")
    prompt = torch.randn(1, 3, 256, 64)
    cache.update(prompt, prompt.clone(), 0, {})
    layer = cache.layers[0]
    layer.model_config = Module.config
    states = [(torch.randn(1, 3, 1, 64), torch.randn(1, 3, 1, 64)) for _ in range(steps)]
    with torch.inference_mode():
        for key, value in states:
            if mode == "run-start":
                layer._steady_run = None  # (both revisions keep the layer's run there)
            out = layer.update(key, value)
            take_over(Module, *out)


def count(tree: Path, steps: int, mode: str) -> int:
    """Instructions callgrind collected for the worker run from ``tree``."""
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}
    with tempfile.TemporaryDirectory() as tmp:
        command = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={tmp}/out", sys.executable, __file__,
                   "--worker", "--steps", str(steps), "--mode", mode]  # fmt: skip
        done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    return int(re.search(r"Collected : (\d+)", done.stderr).group(1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--a", default="HEAD", help="git revision of A, or - for the working tree (default HEAD)")
    p.add_argument("--b", default="-", help="git revision of B, or - for the working tree (default -)")
    p.add_argument("--mode", choices=("steady", "run-start", "paged"), default="steady")
    p.add_argument("--steps", type=int, default=1200, help="updates counted (default 1200)")
    p.add_argument("--base-steps", type=int, default=200, help="updates of the run subtracted (default 200)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.steps, args.mode)
        return
    from kivi_xpu.tools.machine import lscpu_lines

    print(*lscpu_lines(), sep="\n", flush=True)
    per_update = {}
    for arm, revision in (("A", args.a), ("B", args.b)):
        tree = tree_of(revision)
        high, low = count(tree, args.steps, args.mode), count(tree, args.base_steps, args.mode)
        per_update[arm] = (high - low) / (args.steps - args.base_steps)
        what = "decode forward of 4 requests" if args.mode == "paged" else "update"
        print(f"{arm} = {revision}: {per_update[arm]:,.0f} instructions per {what} ({args.mode})", flush=True)
    print(f"B / A: {per_update['B'] / per_update['A']:.3f}")


if __name__ == "__main__":
    main()
