"""Decode benchmark: tokens/s and persistent KV memory of several caches, side by side in one process.

    python -m kivi_xpu.bench --contexts 1024 4096 8192 --batch-sizes 1 4 --new-tokens 64

For each (context, batch) the prompt is prefilled once with a full-precision cache; every cache under test is then
filled with those exact prefill states (what a prefill through the model would store: KIVI's prefill attends to
the exact states) and decodes the same greedy continuation, timed per step after a warm-up step. Ratios are to
``DynamicCache`` measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from .attention import register as register_attention
from .cache import KiviCache

CACHES = ("dynamic", "kivi-fused", "kivi-dense", "quanto")


@dataclass
class Row:
    cache: str
    context: int
    batch: int
    decode_tokens_per_s: float
    ms_per_step: float
    kv_bytes: int
    speed_vs_dynamic: float = float("nan")
    memory_vs_dynamic: float = float("nan")


def dense_bytes(cache: DynamicCache) -> int:
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers if layer.keys is not None)


def quanto_bytes(cache) -> int:
    """Bytes held by HF's QuantizedCache (quanto): quantized tensors' storages plus the residual."""
    total = 0
    for layer in cache.layers:
        for qt in (layer._quantized_keys, layer._quantized_values):
            if qt is not None:
                total += sum(
                    t.nbytes
                    for t in (getattr(qt, "_data", None), getattr(qt, "_scale", None), getattr(qt, "_shift", None))
                    if isinstance(t, torch.Tensor)
                )
        for t in (layer.keys, layer.values):
            if isinstance(t, torch.Tensor):
                total += t.nbytes
    return total


def make_cache(name: str, model, args):
    if name == "dynamic":
        return DynamicCache(config=model.config)
    if name.startswith("kivi"):
        return KiviCache(
            config=model.config,
            bits=args.bits,
            group_size=args.group_size,
            residual_length=args.residual_length,
            backend=args.backend,
            device=args.device,
        )
    if name == "quanto":
        from transformers import QuantizedCache

        return QuantizedCache(
            backend="quanto", config=model.config, nbits=args.bits, residual_length=args.residual_length
        )
    raise ValueError(f"unknown cache {name!r}; choose from {CACHES}")


def fill(cache, prefill: DynamicCache) -> None:
    """Stores the prefill's exact key/value states into ``cache``, layer by layer."""
    for layer_idx, layer in enumerate(prefill.layers):
        cache.update(layer.keys, layer.values, layer_idx)


@torch.no_grad()
def decode(model, cache, first_token: torch.Tensor, steps: int) -> tuple[float, torch.Tensor]:
    """Greedy decode of ``steps`` tokens after one untimed warm-up step; returns (seconds, tokens)."""
    token, out = first_token, []
    for step in range(steps + 1):
        if step == 1:
            start = time.perf_counter()
        logits = model(token, past_key_values=cache, use_cache=True).logits[:, -1]
        token = logits.argmax(-1, keepdim=True)
        out.append(token)
    return time.perf_counter() - start, torch.cat(out, dim=1)


def available(name: str) -> bool:
    if name != "quanto":
        return True
    try:
        import optimum.quanto  # noqa: F401
    except ImportError:
        return False
    return True


@torch.no_grad()
def run(model, args) -> list[Row]:
    rows = []
    generator = torch.Generator().manual_seed(0)
    caches = [c for c in args.caches if available(c)]
    for context in args.contexts:
        for batch in args.batch_sizes:
            ids = torch.randint(0, model.config.vocab_size, (batch, context), generator=generator)
            prefill = DynamicCache(config=model.config)
            model.set_attn_implementation("sdpa")
            first = model(ids, past_key_values=prefill, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
            results = {}
            for name in caches:
                model.set_attn_implementation("kivi" if name == "kivi-fused" else "sdpa")
                cache = make_cache(name, model, args)
                fill(cache, prefill)
                seconds, _ = decode(model, cache, first, args.new_tokens)
                kv = (
                    cache.memory_report().total_bytes
                    if isinstance(cache, KiviCache)
                    else dense_bytes(cache)
                    if name == "dynamic"
                    else quanto_bytes(cache)
                )
                results[name] = Row(
                    name, context, batch, batch * args.new_tokens / seconds, 1000 * seconds / args.new_tokens, kv
                )
                del cache
            base = results.get("dynamic")
            for row in results.values():
                if base is not None:
                    row.speed_vs_dynamic = row.decode_tokens_per_s / base.decode_tokens_per_s
                    row.memory_vs_dynamic = base.kv_bytes / row.kv_bytes
                rows.append(row)
                print(format_row(row), flush=True)
    model.set_attn_implementation("sdpa")
    return rows


def format_row(r: Row) -> str:
    return (
        f"| {r.cache} | {r.context} | {r.batch} | {r.decode_tokens_per_s:.1f} | {r.ms_per_step:.1f} | "
        f"{r.speed_vs_dynamic:.2f}x | {r.kv_bytes / 2**20:.1f} | {r.memory_vs_dynamic:.2f}x |"
    )


HEADER = (
    "| cache | context | batch | decode tok/s | ms/step | speed vs Dynamic | KV MiB | KV smaller by |\n"
    "|---|---|---|---|---|---|---|---|"
)


def load_model(name: str | None):
    if name is None:
        from .assets import smollm2_checkpoint

        name = str(smollm2_checkpoint())
    return AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32).eval()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="HF model id or directory (default: SmolLM2-135M-Instruct via pip)")
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 8192])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4])
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--caches", nargs="+", default=list(CACHES), choices=CACHES)
    p.add_argument("--bits", type=int, default=2)
    p.add_argument("--group-size", type=int, default=32)
    p.add_argument("--residual-length", type=int, default=128)
    p.add_argument("--backend", choices=("auto", "sycl", "reference"))
    p.add_argument("--device")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    p.add_argument("--json", help="write the rows to this JSON file")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    register_attention()
    model = load_model(args.model)
    print(HEADER, flush=True)
    rows = run(model, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=2)


if __name__ == "__main__":
    main()
