"""A long prompt answered with a full-precision cache and with a 2-bit KIVI cache, side by side: the cache sizes,
the decode speed and where the answers agree, all measured in this run.

python examples/generate.py                        # SmolLM2-135M-Instruct (through pip) reads ~5k tokens of Wikipedia
python examples/generate.py --device xpu --dtype bfloat16   # on an Intel GPU (an XPU build of torch)
python examples/generate.py --prompt "Why is the sky blue?" # a short chat instead of the long document
python examples/generate.py --preset paper         # the KIVI authors' algorithm (no sinks, no rotation)
python examples/generate.py --tiny                 # a tiny random Llama (smoke test; the document comes from pip)

The KIVI cache is passed as ``generate(cache=KiviCache(config=model.config))`` and the model is loaded plainly, so
this is the path a user gets by default: the fused attention reads the packed history in place.
"""

from __future__ import annotations

import argparse

import torch
from common import add_model_arguments, cache_options, chat_inputs, load, new_token_options
from transformers import DynamicCache

from kivi_xpu import KiviCache, assets
from kivi_xpu.algorithm import PRESETS
from kivi_xpu.tools.timing import GenerateClock

QUESTION = "Summarize the text above in three sentences."


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(p)
    p.add_argument(
        "--context", type=int, help="tokens of the document read before the question (5000; 1000 with --tiny)"
    )
    p.add_argument("--prompt", help="a question to chat about instead of the long document")
    p.add_argument("--max-new-tokens", type=int, default=64)
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


def document(tokenizer, tokens: int) -> str:
    """About ``tokens`` tokens of the Wikipedia articles that kivi_xpu.assets obtains through pip (CC BY-SA)."""
    text = assets.wikipedia_text().read_text(encoding="utf-8")
    ids = tokenizer(text[: tokens * 8], add_special_tokens=False)["input_ids"][:tokens]
    return tokenizer.decode(ids)


def dense_bytes(cache: DynamicCache) -> int:
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)


def main(argv=None):
    args = parse_args(argv)
    model, tokenizer = load(args)
    context = args.context or (1000 if args.tiny else 5000)  # (the tiny model's positions end at 2048)
    content = args.prompt if args.prompt else f"{document(tokenizer, context)}\n\n{QUESTION}"
    inputs = chat_inputs(tokenizer, [{"role": "user", "content": content}], model.device)
    prompt_len = inputs["input_ids"].shape[1]
    kivi_name = f"KIVI {args.bits}-bit ({args.preset})"
    settings = dict(bits=args.bits, group_size=args.group_size, residual_length=args.residual_length)
    caches = {
        "full precision (DynamicCache)": DynamicCache(config=model.config),
        kivi_name: KiviCache(config=model.config, preset=args.preset, **settings, **cache_options(args)),
    }
    print(f"{prompt_len}-token prompt, {args.dtype} model on {model.device}\n")
    outputs, sizes, speeds = {}, {}, {}
    for name, cache in caches.items():
        clock = GenerateClock()
        with torch.inference_mode():
            out = model.generate(**inputs, cache=cache, streamer=clock, **new_token_options(args), do_sample=False)
        outputs[name] = out[0, prompt_len:]
        new = len(outputs[name])
        sizes[name] = cache.memory_report().total_bytes if isinstance(cache, KiviCache) else dense_bytes(cache)
        speeds[name] = 1e3 / clock.decode_ms_per_token(new)
        text = tokenizer.decode(outputs[name], skip_special_tokens=True).strip()
        print(f"=== {name}: prefill {clock.first - clock.start:.1f} s, {new} tokens at {speeds[name]:.1f} tokens/s")
        print(f"{text}\n")
    full, kivi = caches
    print(f"KV cache: {sizes[full] / 2**20:.1f} MiB full precision, {sizes[kivi] / 2**20:.1f} MiB KIVI: "
          f"{sizes[full] / sizes[kivi]:.1f}x smaller")  # fmt: skip
    print(f"decode: {speeds[kivi] / speeds[full]:.2f}x the tokens/s of full precision")
    print(caches[kivi].memory_report())
    print(f"kernels: {caches[kivi].layers[0].backend.describe()}")
    dense, quant = outputs.values()
    n = min(len(dense), len(quant))
    same = (dense[:n] == quant[:n]).int()
    first_diff = n if bool(same.all()) else int((same == 0).nonzero()[0])
    print(f"greedy tokens identical to full precision: first {first_diff} of {n}")


if __name__ == "__main__":
    main()
