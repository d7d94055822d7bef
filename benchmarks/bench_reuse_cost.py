"""What prefix reuse costs when nothing is shared: continuous batching on KIVI pages of distinct long prompts, two
revisions of the Python package in alternating processes (as ``bench_ab_python.py`` runs them: a git worktree per
revision, this checkout's built extensions copied in).

    python benchmarks/bench_reuse_cost.py --a 558ecc7 --b - --prompts 4 --prompt-tokens 4000 --pairs 3

Each process loads SmolLM2-135M fp32 and runs ``kivi_xpu.paged.generate_batch`` on ``--prompts`` prompts of
``--prompt-tokens`` tokens from distinct places of the Wikipedia text (no two share a token run of a unit), greedy,
``--new-tokens`` each, default settings, ``--kv-memory`` MiB; it prints the wall time and completion tokens/s. The
driver prints each pair and the median of the per-pair ratios B/A of tokens/s (above 1: B faster).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_ab_python import add_ab_arguments, alternate, run_worker  # noqa: E402


def worker(args) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    import kivi_xpu
    from kivi_xpu import assets
    from kivi_xpu.paged import generate_batch

    path = assets.smollm2_checkpoint()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = AutoTokenizer.from_pretrained(path)(assets.wikipedia_text().read_text()[:2_000_000]).input_ids
    step = (len(ids) - args.prompt_tokens) // args.prompts
    prompts = [ids[i * step : i * step + args.prompt_tokens] for i in range(args.prompts)]
    config = GenerationConfig(max_new_tokens=args.new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    start = time.perf_counter()
    results = generate_batch(model, prompts, config, kv_memory=args.kv_memory * 2**20, max_new_tokens=args.new_tokens)
    seconds = time.perf_counter() - start
    tokens = sum(len(r.generated_tokens) for r in results.values())
    print(
        json.dumps({"package": str(Path(kivi_xpu.__file__).parent), "seconds": seconds, "tokens_s": tokens / seconds})
    )


def run_arm(tree: Path, args) -> dict:
    return run_worker(
        __file__,
        tree,
        [
            "--prompts",
            str(args.prompts),
            "--prompt-tokens",
            str(args.prompt_tokens),
            "--new-tokens",
            str(args.new_tokens),
            "--kv-memory",
            str(args.kv_memory),
        ],
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_ab_arguments(p, pairs=3)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--prompt-tokens", type=int, default=4000)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--kv-memory", type=int, default=768, help="MiB (768)")
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    results = alternate(args, run_arm, lambda r: f"{r['tokens_s']:.2f} tokens/s ({r['seconds']:.1f} s)")
    ratios = [b["tokens_s"] / a["tokens_s"] for a, b in zip(results["A"], results["B"], strict=True)]
    print(f"{args.prompts} prompts of {args.prompt_tokens} tokens, {args.new_tokens} new each; A = {args.a}, "
          f"B = {args.b}; tokens/s B/A per pair: median {statistics.median(ratios):.3f} "
          f"(all: {', '.join(f'{r:.3f}' for r in ratios)})")  # fmt: skip


if __name__ == "__main__":
    main()
