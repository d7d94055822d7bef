"""Generate text with a 2-bit KIVI cache and compare it with the full-precision cache.

python examples/generate.py                      # SmolLM2-135M-Instruct, fetched once through pip
python examples/generate.py --model DIR_OR_HF_ID --bits 4 --max-new-tokens 200
python examples/generate.py --tiny               # a tiny random Llama, fully offline (smoke test)
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, LlamaConfig, LlamaForCausalLM

from kivi_xpu import KiviCache

PROMPT = "Explain in a few paragraphs why the sky is blue, and why sunsets are red."


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="HF model id or local directory (default: SmolLM2-135M-Instruct via pip)")
    p.add_argument("--tiny", action="store_true", help="use a tiny random Llama instead of a real model")
    p.add_argument("--prompt", default=PROMPT)
    p.add_argument("--max-new-tokens", type=int, default=160)
    p.add_argument("--bits", type=int, default=2)
    p.add_argument("--group-size", type=int, default=32)
    p.add_argument("--residual-length", type=int, default=128)
    p.add_argument("--backend", choices=("auto", "sycl", "reference"), default=None)
    p.add_argument("--device", help="SYCL device filter, e.g. opencl:cpu or level_zero:gpu")
    return p.parse_args(argv)


def load(args):
    if args.tiny:
        torch.manual_seed(0)
        config = LlamaConfig(
            vocab_size=512,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            bos_token_id=0,
            eos_token_id=1,
            pad_token_id=1,
        )
        return LlamaForCausalLM(config).eval(), None
    if args.model is None:
        from kivi_xpu.assets import smollm2_checkpoint

        args.model = str(smollm2_checkpoint())
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(args.model)


def encode(tokenizer, prompt):
    if tokenizer is None:
        return {"input_ids": torch.randint(2, 512, (1, 48)), "attention_mask": torch.ones(1, 48, dtype=torch.long)}
    if tokenizer.chat_template:
        messages = [{"role": "user", "content": prompt}]
        return tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
    return tokenizer(prompt, return_tensors="pt")


def main(argv=None):
    args = parse_args(argv)
    model, tokenizer = load(args)
    inputs = encode(tokenizer, args.prompt)
    prompt_len = inputs["input_ids"].shape[1]
    caches = {
        "full precision (DynamicCache)": DynamicCache(config=model.config),
        f"KIVI {args.bits}-bit": KiviCache(
            config=model.config,
            bits=args.bits,
            group_size=args.group_size,
            residual_length=args.residual_length,
            backend=args.backend,
            device=args.device,
        ),
    }
    outputs = {}
    for name, cache in caches.items():
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(**inputs, past_key_values=cache, max_new_tokens=args.max_new_tokens, do_sample=False)
        seconds = time.perf_counter() - start
        outputs[name] = out[0, prompt_len:]
        text = tokenizer.decode(outputs[name], skip_special_tokens=True) if tokenizer else outputs[name].tolist()
        print(f"=== {name}: {len(outputs[name])} tokens in {seconds:.1f} s\n{text}\n")
    kivi_cache = caches[f"KIVI {args.bits}-bit"]
    print(kivi_cache.memory_report())
    print(f"backend: {kivi_cache.backend.describe()}")
    dense, quant = outputs.values()
    n = min(len(dense), len(quant))
    same = (dense[:n] == quant[:n]).int()
    first_diff = n if bool(same.all()) else int((same == 0).nonzero()[0])
    print(f"greedy tokens identical to full precision: first {first_diff} of {n}")


if __name__ == "__main__":
    main()
