"""Continuous batching on KIVI pages under tensor parallelism: each rank's pool holds the KV heads of its shard.

python -m torch.distributed.run --nproc-per-node 2 examples/tensor_parallel_serving.py --tiny        # gloo on CPU
python -m torch.distributed.run --nproc-per-node 2 examples/tensor_parallel_serving.py --tiny qwen2
python -m torch.distributed.run --nproc-per-node 3 examples/tensor_parallel_serving.py --model DIR  # 3 KV heads
python examples/tensor_parallel_serving.py --tiny                                                 # 1 process

transformers shards the model (``DistributedConfig(tp_plan="auto")``) and runs its continuous batching on every rank:
the first rank takes the requests and broadcasts them, every rank schedules the same requests the same way. Here each
rank's manager is ``kivi_xpu.paged.init_continuous_batching`` with ``--kv-memory / world size`` MiB: its pool of 2-bit
pages and exact units is planned for ``num_key_value_heads / world size`` heads. Every rank submits the same prompts
(only the first rank's submission counts), times until the last answer (``--cancel I``: the first rank cancels
request I, whose answer is not awaited), waits until its pool holds no request, and prints the answers, its pool's
bytes and the bytes its cached prompts hold; ``--output-dir`` also writes them to ``rank<r>.json``. One thread per
rank.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch
from common import DTYPES, add_sharded_model_arguments, tiny_model
from transformers import AutoModelForCausalLM, AutoTokenizer, DistributedConfig, GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig

from kivi_xpu.paged import init_continuous_batching
from kivi_xpu.tools.loading import resolve_model


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_sharded_model_arguments(p)
    p.add_argument("--lengths", type=int, nargs="+", default=[40, 7, 90, 23], help="prompt tokens per request")
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--kv-memory", type=int, default=8, help="MiB of KV storage in all, split over the ranks (8)")
    p.add_argument("--kv-memory-of", metavar="RANK=MIB", help="give one rank another budget (to see the ranks' check)")
    p.add_argument("--cancel", type=int, metavar="I", help="the first rank cancels request I once submitted")
    p.add_argument("--max-batch-tokens", type=int, default=16, help="query tokens of a forward (16)")
    p.add_argument("--residual-length", type=int, default=8)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--output-dir", type=Path, help="write rank<r>.json here")
    args = p.parse_args(argv)
    if (args.model is None) == (args.tiny is None):
        p.error("give exactly one of --model DIR and --tiny")
    return args


def prompts(path: str, lengths: list[int], tiny: bool) -> list[list[int]]:
    """Token ids: seeded random bytes for a tiny model, else windows of the Wikipedia text of kivi_xpu.assets."""
    if tiny:
        generator = torch.Generator().manual_seed(7)
        return [torch.randint(3, 250, (n,), generator=generator).tolist() for n in lengths]
    from kivi_xpu.assets import wikipedia_text

    ids = AutoTokenizer.from_pretrained(path)(wikipedia_text().read_text()[:1_000_000]).input_ids
    step = (len(ids) - max(lengths)) // len(lengths)
    return [ids[i * step : i * step + n] for i, n in enumerate(lengths)]


def serve(path: str, args) -> dict:
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    torch.set_num_threads(1)  # one core per rank
    sharding = {"distributed_config": DistributedConfig(tp_plan="auto")} if world_size > 1 else {}
    model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[args.dtype], **sharding).eval()
    requests = prompts(path, args.lengths, args.tiny is not None)
    greedy = GenerationConfig(max_new_tokens=args.max_new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    mib = args.kv_memory / world_size
    if args.kv_memory_of is not None and int(args.kv_memory_of.split("=")[0]) == rank:
        mib = float(args.kv_memory_of.split("=")[1])
    manager = init_continuous_batching(
        model, greedy, ContinuousBatchingConfig(max_batch_tokens=args.max_batch_tokens),
        kv_memory=int(mib * 2**20), residual_length=args.residual_length,
        group_size=args.group_size,
    )  # fmt: skip
    manager.start()
    try:
        while manager.cache is None:
            time.sleep(0.01)
        cache = manager.cache
        ids, started = [f"r{i}" for i in range(len(requests))], time.perf_counter()
        for request_id, prompt in zip(ids, requests, strict=True):
            manager.add_request(prompt, request_id, max_new_tokens=args.max_new_tokens)  # (a no-op but on rank 0)
        if args.cancel is not None:
            manager.cancel_request(ids[args.cancel])  # (a no-op but on rank 0: transformers broadcasts it)
        wanted = [request_id for i, request_id in enumerate(ids) if i != args.cancel]
        answers, deadline = {}, time.monotonic() + 600
        while not all(request_id in answers for request_id in wanted):
            if time.monotonic() > deadline or not manager.is_running():
                raise RuntimeError(f"rank {rank}: {len(answers)} of {len(wanted)} answers")
            result = manager.get_result(timeout=0.1)
            if result is not None and result.is_finished():
                if result.error is not None:
                    raise RuntimeError(f"rank {rank}: {result.request_id} failed: {result.error}")
                answers[result.request_id] = result.generated_tokens
        seconds = time.perf_counter() - started
        while cache.requests_in_flight:  # (a cancelled request is freed on every rank)
            if time.monotonic() > deadline:
                raise RuntimeError(f"rank {rank}: {cache.requests_in_flight} requests still hold pages")
            time.sleep(0.01)
        return {
            "rank": rank, "world_size": world_size, "answers": [answers.get(i) for i in ids],
            "kv_heads": cache.budget.block.heads, "pool_bytes": cache.kv_bytes, "cached_bytes": cache.cached_bytes,
            "cached_tokens": cache.holdings.prefixes.cached_tokens, "seconds": seconds,
        }  # fmt: skip
    finally:
        manager.stop(block=True, timeout=60)


def main(argv=None):
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        if args.tiny is not None:  # every rank saves the same seeded model (a directory per rank: no race)
            tiny_model(args.tiny).save_pretrained(scratch)
            result = serve(scratch, args)
        else:
            result = serve(str(resolve_model(args.model)), args)
    rank, world_size = result["rank"], result["world_size"]
    print(
        f"rank {rank}/{world_size}: {sum(a is not None for a in result['answers'])} answers in {result['seconds']:.1f} "
        f"s, KV heads {result['kv_heads']}, pool {result['pool_bytes']} bytes, cached prompts {result['cached_bytes']} "
        f"bytes; answers {result['answers']}"
    )
    if args.output_dir is not None:
        args.output_dir.mkdir(parents=True, exist_ok=True)
        (args.output_dir / f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
