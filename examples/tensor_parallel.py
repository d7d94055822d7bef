"""Tensor-parallel generation with a KIVI cache: each rank keeps only the KV heads of its shard of the model.

python -m torch.distributed.run --nproc-per-node 2 examples/tensor_parallel.py --tiny    # 2 ranks, gloo on CPU
python -m torch.distributed.run --nproc-per-node 2 examples/tensor_parallel.py --tiny qwen2
python -m torch.distributed.run --nproc-per-node 2 examples/tensor_parallel.py --model DIR
python examples/tensor_parallel.py --tiny                                                # 1 process, for comparison

transformers shards the model (``DistributedConfig(tp_plan="auto")``: q/k/v projections by heads, so each rank's
attention layers see ``num_key_value_heads / world_size`` KV heads); the ``KiviCache`` needs nothing for it, since
each layer takes its shapes from the first keys it stores. Each rank generates greedily twice with a fresh cache,
with dense attention (the cache returns dequantized keys/values to SDPA) and with the fused KIVI attention
(``attn_implementation="kivi"``), and prints its tokens, KV heads per layer and cache bytes; ``--output-dir`` also
writes them (and the logits of every step) to ``rank<r>.json``. The model's ``num_key_value_heads`` must be divisible
by the number of ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

from common import DTYPES, add_sharded_model_arguments, tiny_model
from transformers import AutoModelForCausalLM, AutoTokenizer, DistributedConfig

from kivi_xpu import KiviCache, KiviLayer
from kivi_xpu.assets import byte_tokenizer
from kivi_xpu.tools.loading import resolve_model

PROMPT = "Each rank keeps its heads:"  # short, so that the first generated tokens see only exact keys and values
ATTENTIONS = ("sdpa", "kivi")  # dense keys/values to SDPA, and the fused KIVI attention


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_sharded_model_arguments(p)
    p.add_argument("--backend", choices=("auto", "native", "sycl", "reference"), default=None)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--residual-length", type=int, default=32)
    p.add_argument("--output-dir", type=Path, help="write rank<r>.json (tokens, logits, KV heads, bytes) here")
    args = p.parse_args(argv)
    if (args.model is None) == (args.tiny is None):
        p.error("give exactly one of --model DIR and --tiny")
    return args


def load(path: str, world_size: int, dtype: str):
    """The model in ``dtype``, sharded over the ranks by transformers' own plan when there are several."""
    sharding = {"distributed_config": DistributedConfig(tp_plan="auto")} if world_size > 1 else {}
    return AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype], **sharding).eval()


def generate(model, inputs: dict, attention: str, args) -> dict:
    """One greedy run with a fresh cache: its tokens, per-step logits ``[steps][vocab]``, and what the cache holds."""
    model.set_attn_implementation(attention)
    cache = KiviCache(config=model.config, residual_length=args.residual_length, backend=args.backend)
    n = args.max_new_tokens
    out = model.generate(
        **inputs, cache=cache, max_new_tokens=n, min_new_tokens=n, do_sample=False,
        output_logits=True, return_dict_in_generate=True,
    )  # fmt: skip
    report = cache.memory_report()
    return {
        "tokens": out.sequences[0, inputs["input_ids"].shape[1] :].tolist(),
        "logits": [step[0].tolist() for step in out.logits],
        "kv_heads": [layer.keys_stream.heads for layer in cache.layers if isinstance(layer, KiviLayer)],
        "tokens_held": report.tokens,
        "quantized_tokens": cache.layers[0].keys_stream.packed.num_tokens,
        "total_bytes": report.total_bytes,
        "code_bytes": report.code_bytes,
        "backend": cache.layers[0].backend.name,  # the kernels of the layers' device
    }


def run(path: str, tokenizer, args) -> dict:
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    model = load(path, world_size, args.dtype)
    inputs = tokenizer(PROMPT, return_tensors="pt")
    result = {"rank": rank, "world_size": world_size, "prompt_tokens": inputs["input_ids"].shape[1]}
    result |= {attention: generate(model, inputs, attention, args) for attention in ATTENTIONS}
    return result


def main(argv=None):
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        # Every rank saves the same seeded model for from_pretrained (a directory per rank: no race).
        if args.tiny is not None:
            tiny_model(args.tiny).save_pretrained(scratch)
            result = run(scratch, byte_tokenizer(), args)
        else:
            path = str(resolve_model(args.model))
            result = run(path, AutoTokenizer.from_pretrained(path), args)
    rank, world_size = result["rank"], result["world_size"]
    for attention in ATTENTIONS:
        r = result[attention]
        print(
            f"rank {rank}/{world_size} {attention}: {len(r['tokens'])} tokens ({r['quantized_tokens']} of "
            f"{r['tokens_held']} held quantized), KV heads per layer {r['kv_heads']}, KIVI cache {r['total_bytes']} "
            f"bytes ({r['backend']})"
        )
    same = result["sdpa"]["tokens"] == result["kivi"]["tokens"]
    print(f"rank {rank}/{world_size}: fused KIVI attention tokens identical to dense: {same}")
    if args.output_dir is not None:
        args.output_dir.mkdir(parents=True, exist_ok=True)
        (args.output_dir / f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
