"""Are continuous batching's answers on KIVI pages each request's own `generate` with `KiviCache`? On a real model and
real texts, with prompts from 1 to ~8k tokens in one batch, under several `max_batch_tokens` (the scheduler splits
every prompt longer than that, and shorter ones when they join a busy forward).

    python benchmarks/bench_serve_exactness.py --model smollm2 --dtype float32 --max-batch-tokens 64 256 0
    python benchmarks/bench_serve_exactness.py --model smollm2 --dtype bfloat16 --max-batch-tokens 512 --compare

For each prompt (the first N tokens of Wikipedia articles from kivi_xpu.assets, joined) the request's own greedy
`generate` with a fresh default `KiviCache` and the fused attention gives the reference tokens and, at every step,
its logits; then `kivi_xpu.paged.generate_batch` serves all prompts at once (0 = the default max_batch_tokens).
Printed per run: which requests answer exactly as their own generate and, for the others, the first differing step
and the reference's logit margin there between its token and the batch's. `--compare` also runs transformers' own
continuous batching (its full-precision pool, SDPA) against its own `generate` with `DynamicCache` on the same
prompts: the agreement that batching itself allows in that dtype. `--vllm` serves the prompts with vLLM's CPU engine
and the plugin instead (.venv-vllm, `make vllm-env`; vLLM's default chunking of --max-num-batched-tokens 2048, the
KV budget --kv-memory), against the own generate with the native kernels, which that environment runs; with
`--compare`, vLLM's own pages against generate with DynamicCache too (the agreement that vLLM's engine allows):

    python benchmarks/bench_serve_exactness.py --model smollm2 --vllm --lengths 322 774 1503 2144 2969 3810
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig

from kivi_xpu import KiviCache, use_fused_attention
from kivi_xpu.assets import wikipedia_text
from kivi_xpu.paged import generate_batch
from kivi_xpu.tools.loading import resolve_model
from kivi_xpu.tools.machine import lscpu_lines
from kivi_xpu.vllm import offline

LENGTHS = (1, 40, 322, 774, 1503, 2144, 2969, 3810, 8200)


def greedy(new_tokens: int) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)


def text_prompts(tokenizer, lengths) -> list[list[int]]:
    """Prompts of ``lengths`` tokens, each from its own place in the Wikipedia text."""
    ids = tokenizer(wikipedia_text().read_text()[:3_000_000]).input_ids
    starts = torch.linspace(0, len(ids) - max(lengths) - 1, len(lengths)).long().tolist()
    return [ids[s : s + n] for s, n in zip(starts, lengths, strict=True)]


def own_generate(model, prompt, new_tokens, cache) -> tuple[list[int], list[torch.Tensor]]:
    out = model.generate(torch.tensor([prompt]), cache=cache, generation_config=greedy(new_tokens),
                         output_scores=True, return_dict_in_generate=True)  # fmt: skip
    return out.sequences[0, len(prompt) :].tolist(), [s[0].float() for s in out.scores]


def compare(reference, scores, answers) -> list[dict]:
    """Per request: equal, or the first differing step and the reference's margin there."""
    rows = []
    for own, logits, answer in zip(reference, scores, answers, strict=True):
        if own == answer:
            rows.append({"equal": True})
            continue
        step = next(i for i, (a, b) in enumerate(zip(own, answer, strict=False)) if a != b)
        margin = float(logits[step][own[step]] - logits[step][answer[step]])
        rows.append({"equal": False, "first_difference": step, "margin": margin})
    return rows


def answers(results: dict) -> list[list[int]]:
    """Generated tokens in request order (request ids ``req_0``, ``req_1``, ...)."""
    return [results[k].generated_tokens for k in sorted(results, key=lambda k: int(k.rsplit("_", 1)[-1]))]


def describe(name: str, prompts, rows, seconds: float) -> str:
    equal = sum(r["equal"] for r in rows)
    parts = [
        f"{len(p)}: equal"
        if r["equal"]
        else f"{len(p)}: differs at step {r['first_difference']} (margin {r['margin']:.3f})"
        for p, r in zip(prompts, rows, strict=True)
    ]
    return f"{name}: {equal}/{len(rows)} equal ({seconds:.0f} s) -- " + "; ".join(parts)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="local model directory, or smollm2 (default)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS), help="prompt tokens")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--max-batch-tokens", type=int, nargs="+", default=[64, 256, 0], help="0: the default")
    parser.add_argument("--kv-memory", type=int, default=1024, help="MiB (1024)")
    parser.add_argument("--compare", action="store_true", help="also transformers' own batching vs DynamicCache")
    parser.add_argument("--vllm", action="store_true", help="vLLM's CPU engine with KIVI pages (.venv-vllm)")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    print("\n".join(lscpu_lines()), flush=True)
    path = resolve_model(args.model)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype)).eval()
    prompts = text_prompts(AutoTokenizer.from_pretrained(path), args.lengths)
    record = {"settings": vars(args), "runs": {}}

    use_fused_attention(model)
    started = time.perf_counter()
    backend = {"backend": "native"} if args.vllm else {}  # the kernels the vLLM environment runs
    own = [own_generate(model, p, args.new_tokens, KiviCache(config=model.config, **backend)) for p in prompts]
    print(f"own generate with KiviCache: {time.perf_counter() - started:.0f} s", flush=True)
    reference, scores = [o[0] for o in own], [o[1] for o in own]
    if args.vllm:
        spec = {"model": path, "dtype": args.dtype, "max_tokens": args.new_tokens, "prompts": prompts, "kivi": {},
                "engine": {"kv_cache_memory_bytes": args.kv_memory * 2**20}}  # fmt: skip
        started = time.perf_counter()
        result = offline.run(spec)
        rows = compare(reference, scores, [a["tokens"] for a in result["answers"]])
        name = "vLLM + KIVI pages, max_num_batched_tokens=2048 (its default)"
        print(describe(name, prompts, rows, time.perf_counter() - started), flush=True)
        record["runs"][name] = rows
    for max_batch_tokens in [] if args.vllm else args.max_batch_tokens:
        config = ContinuousBatchingConfig(max_batch_tokens=max_batch_tokens or None)
        started = time.perf_counter()
        results = generate_batch(model, prompts, greedy(args.new_tokens), config,
                                 kv_memory=args.kv_memory * 2**20, max_new_tokens=args.new_tokens)  # fmt: skip
        seconds = time.perf_counter() - started
        rows = compare(reference, scores, answers(results))
        name = f"KIVI pages, max_batch_tokens={max_batch_tokens or 'default'}"
        print(describe(name, prompts, rows, seconds), flush=True)
        record["runs"][name] = rows

    if args.compare:
        model.set_attn_implementation("sdpa")
        dense = [own_generate(model, p, args.new_tokens, DynamicCache(config=model.config)) for p in prompts]
    if args.compare and args.vllm:  # vLLM's own pages against generate with DynamicCache
        started = time.perf_counter()
        result = offline.run(dict(spec, kivi=None))
        rows = compare([d[0] for d in dense], [d[1] for d in dense], [a["tokens"] for a in result["answers"]])
        name = "vLLM's own pages vs DynamicCache, max_num_batched_tokens=2048 (its default)"
        print(describe(name, prompts, rows, time.perf_counter() - started), flush=True)
        record["runs"][name] = rows
        for max_batch_tokens in [] if args.vllm else args.max_batch_tokens:
            config = ContinuousBatchingConfig(max_batch_tokens=max_batch_tokens or None)
            started = time.perf_counter()
            results = model.generate_batch(prompts, generation_config=greedy(args.new_tokens),
                                           continuous_batching_config=config, max_new_tokens=args.new_tokens,
                                           warmup=False)  # fmt: skip
            seconds = time.perf_counter() - started
            rows = compare([d[0] for d in dense], [d[1] for d in dense], answers(results))
            name = f"transformers' batching vs DynamicCache, max_batch_tokens={max_batch_tokens or 'default'}"
            print(describe(name, prompts, rows, seconds), flush=True)
            record["runs"][name] = rows
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
