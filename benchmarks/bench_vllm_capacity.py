"""How many requests vLLM's CPU engine runs at once with KIVI pages, observed rather than computed: ``--requests``
requests of ``--prompt-tokens`` + ``--new-tokens`` (random token ids, greedy, every request's answer its full
length) sent at once to an offline engine of SmolLM2-135M-Instruct with ``--kv-memory`` MiB of KV, and after every
step the requests running, the tokens they hold and vLLM's free blocks; then the most of each. ``--plain`` runs
vLLM's own pages instead. Compare with what ``kivi-xpu plan`` computes (its vLLM rows).

    python benchmarks/bench_vllm_capacity.py --kv-memory 768 --requests 28 --prompt-tokens 3796 --new-tokens 256

Runs the engine in .venv-vllm (``make vllm-env``) through :func:`kivi_xpu.vllm.offline.run`, this file as its
script. Prints ``lscpu``'s model and flags. Not a test: it takes minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def engine_main(spec_path: str) -> None:
    """In .venv-vllm: the engine in this process (its scheduler visible), stepped until every request is done."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    spec = json.loads(Path(spec_path).read_text())
    extra = {} if spec["kivi"] is None else {"additional_config": {"kivi": spec["kivi"]}}
    llm = LLM(model=spec["model"], skip_tokenizer_init=True, dtype=spec["dtype"], enforce_eager=True,
              kv_cache_memory_bytes=spec["kv_memory"], **extra)  # fmt: skip
    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    pool = scheduler.kv_cache_manager.block_pool
    rng = random.Random(0)
    params = SamplingParams(max_tokens=spec["new_tokens"], min_tokens=spec["new_tokens"], temperature=0,
                            detokenize=False)  # fmt: skip
    for i in range(spec["requests"]):
        prompt = [rng.randrange(1, 40000) for _ in range(spec["prompt_tokens"])]
        engine.add_request(f"r{i}", TokensPrompt(prompt_token_ids=prompt), params)
    most = {"running": 0, "tokens_held": 0, "min_free_blocks": pool.get_num_free_blocks()}
    preemptions = 0
    while engine.has_unfinished_requests():
        engine.step()
        running = scheduler.running
        most["running"] = max(most["running"], len(running))
        most["tokens_held"] = max(most["tokens_held"], sum(r.num_computed_tokens for r in running))
        most["min_free_blocks"] = min(most["min_free_blocks"], pool.get_num_free_blocks())
        preemptions = max(preemptions, sum(r.num_preemptions for r in scheduler.requests.values()))
    most.update(num_blocks=pool.num_gpu_blocks, block_size=scheduler.cache_config.block_size, preemptions=preemptions)
    print("RESULT " + json.dumps(most), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kv-memory", type=int, default=768, help="MiB of KV (default: 768)")
    parser.add_argument("--requests", type=int, default=28)
    parser.add_argument("--prompt-tokens", type=int, default=3796)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--plain", action="store_true", help="vLLM's own pages, not KIVI's")
    parser.add_argument("--json", type=Path, help="write the settings and the result here")
    args = parser.parse_args()
    from kivi_xpu.assets import smollm2_checkpoint
    from kivi_xpu.vllm import offline

    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
    machine = [line for line in lscpu if line.split(":")[0] in ("Model name", "CPU family", "Model", "Flags")]
    print("\n".join(machine))
    spec = {"model": str(smollm2_checkpoint()), "dtype": args.dtype, "kv_memory": args.kv_memory * 2**20,
            "requests": args.requests, "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
            "kivi": None if args.plain else {}, "engine": {}}  # fmt: skip
    result = offline.run(spec, Path(__file__).resolve())
    engine = "vLLM's own pages" if args.plain else "vLLM + KIVI pages"
    print(f"{engine}, {args.kv_memory} MiB, {args.requests} x ({args.prompt_tokens} + {args.new_tokens}): at most "
          f"{result['running']} running at once, {result['tokens_held']:,} tokens held; {result['num_blocks']} blocks "
          f"of {result['block_size']} tokens, at least {result['min_free_blocks']} free; "
          f"{result['preemptions']} preemptions")  # fmt: skip
    if args.json:
        build = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
        payload = {"settings": vars(args) | {"json": str(args.json)}, "build": build.stdout.strip(),
                   "machine": machine, "result": result}  # fmt: skip
        args.json.write_text(json.dumps(payload, indent=2) + "\n")


if __name__ == "__main__":
    if len(sys.argv) == 2 and sys.argv[1].endswith(".json") and Path(sys.argv[1]).name == "spec.json":
        engine_main(sys.argv[1])
    else:
        main()
