"""The fixed cost of a decode step's cache work per layer: ``KiviCache`` (fused mode: window append, the departing
value token quantized in place, the hand-over to the attention call) against ``StaticCache`` (``index_copy_``) and
``DynamicCache`` (``torch.cat``), interleaved in one process, medians in microseconds. The context is short, so what
is measured is the Python and dispatch around the kernels, not the kernels' reading of the history.

    python benchmarks/bench_update_overhead.py [--batch 1] [--steps 2000]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import DynamicCache, LlamaConfig, StaticCache

from kivi_xpu import KiviCache
from kivi_xpu.attention import take_over
from kivi_xpu.tools.machine import lscpu_lines

p = argparse.ArgumentParser()
p.add_argument("--batch", type=int, default=1)
p.add_argument("--steps", type=int, default=2000)
p.add_argument("--context", type=int, default=256)
args = p.parse_args()
print(*lscpu_lines(), sep="\n")

# SmolLM2-135M's attention shapes: 9 query heads, 3 kv heads, head_dim 64, one layer.
config = LlamaConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, num_hidden_layers=1)
config._attn_implementation = "kivi"
b, h, d = args.batch, 3, 64


def states(n: int):
    return torch.randn(b, h, n, d), torch.randn(b, h, n, d)


class Module:  # what take_over needs of an attention module
    config = config


caches = {
    "dynamic": DynamicCache(config=config),
    "static": StaticCache(config=config, max_cache_len=args.context + args.steps + 8),
    "kivi": KiviCache(config=config),
}
for name, cache in caches.items():
    k, v = states(args.context)
    kwargs = {"cache_position": torch.arange(args.context)} if name == "static" else {}
    cache.update(k, v, 0, kwargs)
times = {name: [] for name in caches}
for step in range(args.steps):
    k, v = states(1)
    position = torch.tensor([args.context + step])
    for name, cache in caches.items():
        start = time.perf_counter()
        kwargs = {"cache_position": position} if name == "static" else {}
        key, value = cache.update(k, v, 0, kwargs)
        if name == "kivi":
            assert take_over(Module, key, value) is not None  # the fused path's hand-over
        times[name].append(time.perf_counter() - start)
medians = {name: statistics.median(t[len(t) // 10 :]) * 1e6 for name, t in times.items()}
print(
    f"batch {b}, context {args.context}, {args.steps} steps: "
    + ", ".join(f"{n} {m:.1f} us" for n, m in medians.items())
)
print(f"KIVI's fixed cost over StaticCache's: {medians['kivi'] - medians['static']:+.1f} us per layer step")
