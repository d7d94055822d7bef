"""Assisted (speculative) decoding with the KIVI cache: rejected draft tokens are rolled back exactly.

python examples/assisted_decoding.py                      # SmolLM2 with prompt-lookup drafts
python examples/assisted_decoding.py --assistant DIR      # drafts from a smaller model sharing the tokenizer
python examples/assisted_decoding.py --tiny               # tiny random models, fully offline

The result is compared with plain greedy decoding under the same cache settings: they agree except where a
draft verified in one forward pass saw a few keys in full precision that step-by-step decoding would already
have quantized (a flush inside a verified draft).
"""

from __future__ import annotations

import argparse

import torch
from common import add_model_arguments, cache_options, chat_inputs, load, new_token_options, tiny_llama
from transformers import AutoModelForCausalLM

import kivi_xpu  # noqa: F401  (enables cache_implementation="kivi")

PROMPT = "Repeat this sentence three times: the quick brown fox jumps over the lazy dog."


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(p)
    p.add_argument("--assistant", help="draft model (HF id or directory); default: prompt lookup (no model)")
    p.add_argument("--max-new-tokens", type=int, default=100)
    args = p.parse_args(argv)

    model, tokenizer = load(args)
    drafts = {"prompt_lookup_num_tokens": 8}
    if args.tiny:
        drafts = {"assistant_model": tiny_llama(num_hidden_layers=1, seed=5).to(model.device, model.dtype)}
    elif args.assistant:
        drafts = {
            "assistant_model": AutoModelForCausalLM.from_pretrained(
                args.assistant, dtype=model.dtype, device_map=model.device
            )
        }
    inputs = chat_inputs(tokenizer, [{"role": "user", "content": PROMPT}], model.device)
    kwargs = dict(
        **new_token_options(args),
        do_sample=False,
        cache_implementation="kivi",
        cache_config={"residual_length": 32, **cache_options(args)},
    )
    with torch.no_grad():
        assisted = model.generate(**inputs, **drafts, **kwargs)
        plain = model.generate(**inputs, **kwargs)
    start = inputs["input_ids"].shape[1]
    print(tokenizer.decode(assisted[0, start:], skip_special_tokens=True))
    n = min(assisted.shape[1], plain.shape[1]) - start
    agree = int((assisted[0, start : start + n] == plain[0, start : start + n]).sum())
    print(f"assisted decoding: {assisted.shape[1] - start} tokens; {agree} of {n} equal to plain greedy decoding")


if __name__ == "__main__":
    main()
