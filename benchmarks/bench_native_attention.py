"""Benchmark of the native CPU fused decode attention (``kivi_xpu._cpu.decode_attention``) against dense SDPA.

SmolLM2-135M's heads (Hq 9, Hkv 3, head_dim 64; ``--shape llama-3.2-3b``: Hq 24, Hkv 8, head_dim 128), one query row
per head, KIVI 2-bit, group 32, residual 128, fp16 metadata, fp32 model: for each batch and context ``n`` the op
attends over ``n`` tokens (``n - 128`` packed values, the packed keys in whole groups, the rest exact), and
``torch.nn.functional.scaled_dot_product_attention`` attends over the same ``n`` tokens of dense fp32 K/V
preallocated at the maximum length (what a StaticCache costs). Columns: best ms of each over ``--repeats`` calls in
each of 3 interleaved rounds (the least disturbed call: on a shared machine a descheduled pool thread adds whole
time slices to the others), for each arithmetic of ``--dot`` (``int8``: integer dot products, the default; ``fp32``:
codes converted to floats), ``dense/native`` (above 1: the fused op is faster), and GB/s of packed bytes read (codes
+ scales + zeros of the packed tokens) by the native op.

With ``--paged`` the native op also runs as ``paged_decode_attention`` (continuous batching) over the same tokens: each
of the ``batch`` requests' packed history in pages of one key group (group-major, keys and values of a group in one
page) at shuffled blocks of one pool, as transformers' allocator hands them out; its rows say ``<arithmetic> paged``.

With ``--cold`` each op reads the history of another of 30 layers in turn (SmolLM2-135M's count), with a 20 MB
buffer summed (untimed) before every call: a layer's weights passing through the caches, as in the model, where the
history comes from DRAM. Columns are then the median call of each op (cold calls wait on the memory, so the best
one says little): the median over 3 interleaved rounds, each ``--repeats / 5`` turns through the 30 layers. Warm (the
default), one layer's history is read again and again from the caches: the arithmetic alone.

    python benchmarks/bench_native_attention.py [--batch 1 4] [--context 1024 4096 8192] [--isa avx2]
        [--dot int8 fp32] [--cold] [--paged] [--shape llama-3.2-3b] [--json PATH]

The roofline (``--json``, then ``python benchmarks/make_figures.py roofline``): bytes each op reads per call divided
by its time, the fused op's packed history (codes + scales + zeros) against SDPA's fp32 K/V of the same tokens, beside
the machine's read bandwidth (``kivi_xpu.tools.machine.read_bandwidth``). Warm calls read a history that fits in the
caches faster than DRAM allows: the figure says which sizes exceed the last-level cache.

Prints the CPU model, its SIMD flags and the ISA used. Not a test: numbers depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch

from kivi_xpu import _cpu as native
from kivi_xpu.algorithm import KiviSettings
from kivi_xpu.ops.reference import quantize_keys, quantize_values
from kivi_xpu.paged.pages import LayerPages, PageLayout
from kivi_xpu.storage import padded_channel_row
from kivi_xpu.tools.machine import last_level_cache_bytes, lscpu_lines, read_bandwidth

BITS, GROUP, RESIDUAL = 2, 32, 128
# Attention shapes (query heads, KV heads, head_dim) of --shape: SmolLM2-135M's and a realistic layer's.
LAYER_SHAPES = {"smollm2-135m": (9, 3, 64), "llama-3.2-3b": (24, 8, 128)}
Q_HEADS, KV_HEADS, HEAD_DIM = LAYER_SHAPES["smollm2-135m"]
META = torch.float16
LAYERS, WEIGHT_BYTES = 30, 20 * 2**20  # --cold: histories read in turn, bytes summed between calls


def best_seconds(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def median_cold_seconds(calls, turns: int, weights: torch.Tensor) -> float:
    """Median seconds of ``calls`` (one per layer) called in turn ``turns`` times, ``weights`` summed before each."""
    times = []
    for _ in range(turns):
        for call in calls:
            weights.sum()
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def padded_capacity(tokens: int) -> int:
    """Token capacity of the storage for ``tokens``, padded as ``KiviCache`` pads its key code rows
    (``kivi_xpu.storage.padded_channel_row``: rows a multiple of 512 bytes apart evict each other from the L1; 8192
    tokens took 0.445 instead of 0.374 ms warm at batch 4 on Zen 4)."""
    return padded_channel_row(tokens * BITS // 8, 1) * 8 // BITS


def packed_layer(batch: int, n: int, capacity: int):
    """The native op's arguments for one layer holding ``n`` tokens, and the packed bytes it reads."""
    key_count = (n - RESIDUAL) // GROUP * GROUP
    value_count = n - RESIDUAL
    full = torch.randn(batch, KV_HEADS, capacity, HEAD_DIM)
    key_codes, key_scales, key_zeros = quantize_keys(full, GROUP, BITS, META)
    value_codes, value_scales, value_zeros = quantize_values(full, GROUP, BITS, META)
    key_tail = torch.randn(batch, KV_HEADS, RESIDUAL + GROUP, HEAD_DIM)[:, :, : n - key_count]
    value_tail = torch.randn(batch, KV_HEADS, RESIDUAL + GROUP, HEAD_DIM)[:, :, : n - value_count]
    query = torch.randn(batch, Q_HEADS, 1, HEAD_DIM)
    args = (query, None, key_codes, key_scales, key_zeros, key_count, GROUP, BITS, key_tail)
    args += (None, value_codes, value_scales, value_zeros, value_count, GROUP, BITS, value_tail)
    args += (None, HEAD_DIM**-0.5, None)
    meta_bytes = 2 * key_scales.element_size()
    per_head = key_count * HEAD_DIM * BITS // 8 + key_count // GROUP * HEAD_DIM * meta_bytes
    per_head += value_count * HEAD_DIM * BITS // 8 + value_count * (HEAD_DIM // GROUP) * meta_bytes
    return args, batch * KV_HEADS * per_head


def paged_layer(batch: int, n: int):
    """``paged_decode_attention``'s arguments for ``batch`` requests of ``n`` tokens each, split as ``packed_layer``
    splits them (no sinks), their pages at shuffled blocks of one pool (random codes and metadata)."""
    key_count, value_count = (n - RESIDUAL) // GROUP * GROUP, n - RESIDUAL
    settings = KiviSettings(key_bits=BITS, value_bits=BITS, key_group_size=GROUP, value_group_size=GROUP,
                            residual_length=RESIDUAL, meta_dtype=META, sink_tokens=0)  # fmt: skip
    layout = PageLayout.for_settings(settings, KV_HEADS, HEAD_DIM)
    per_request = -(-value_count // GROUP)
    pages = LayerPages(torch.zeros(batch * per_request, layout.page_bytes, dtype=torch.uint8), layout, 0)
    for name in ("key_codes", "value_codes"):
        getattr(pages, name).copy_(torch.randint(0, 256, getattr(pages, name).shape, dtype=torch.uint8))
    for name in ("key_scales", "value_scales"):
        getattr(pages, name).copy_(torch.rand(getattr(pages, name).shape) / 2)
    for name in ("key_zeros", "value_zeros"):
        getattr(pages, name).copy_(torch.randn(getattr(pages, name).shape))
    blocks = list(range(batch * per_request))
    random.shuffle(blocks)
    requests = [(i, 0, key_count, 0, value_count, 0, n) for i in range(batch)]
    return dict(
        query=torch.randn(batch, Q_HEADS, 1, HEAD_DIM),
        key_windows=torch.randn(batch, KV_HEADS, n - key_count, HEAD_DIM),
        value_windows=torch.randn(batch, KV_HEADS, n - key_count, HEAD_DIM),
        **{name: getattr(pages, name) for name in ("key_codes", "key_scales", "key_zeros")},
        **{name: getattr(pages, name) for name in ("value_codes", "value_scales", "value_zeros")},
        block_table=torch.tensor(blocks, dtype=torch.int64).view(batch, per_request),
        requests=torch.tensor(requests, dtype=torch.int64),
        key_bits=BITS, value_group=GROUP, value_bits=BITS, scaling=HEAD_DIM**-0.5, key_rotation=None,
        value_rotation=None,
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--context", type=int, nargs="+", default=[1024, 4096, 8192])
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument(
        "--isa", choices=["avx512_vnni", "avx512", "avx2", "baseline"], help="force an ISA (default: the best)"
    )
    parser.add_argument("--dot", choices=["int8", "fp32"], nargs="+", default=["int8", "fp32"], help="arithmetics")
    parser.add_argument("--cold", action="store_true", help="read 30 layers' histories in turn, from DRAM (see above)")
    parser.add_argument("--paged", action="store_true", help="also time paged_decode_attention (see above)")
    parser.add_argument("--shape", choices=list(LAYER_SHAPES), default="smollm2-135m", help="the layer's heads")
    parser.add_argument("--json", metavar="PATH", help="also write the rows, lscpu and the read bandwidth as JSON")
    args = parser.parse_args()
    global Q_HEADS, KV_HEADS, HEAD_DIM
    Q_HEADS, KV_HEADS, HEAD_DIM = LAYER_SHAPES[args.shape]
    if min(args.context) <= RESIDUAL:  # the history must hold a packed token beyond the exact window
        parser.error(f"--context: every context must exceed the residual window ({RESIDUAL}), got {min(args.context)}")
    random.seed(0)
    if args.isa:
        native.set_isa(args.isa)
    torch.manual_seed(0)
    print(*lscpu_lines(), sep="\n")
    print(f"ISA: {native.isa()}  threads: {torch.get_num_threads()}  torch {torch.__version__}")
    print(f"{'cold: median call, 30 layers in turn' if args.cold else 'warm: best call, one layer'}")
    columns = ("batch", "context", "arithmetic", "native ms", "dense SDPA ms", "dense/native", "native GB/s (packed)",
               "dense GB/s")  # fmt: skip
    print("| " + " | ".join(columns) + " |")
    print("|---|---|---|---|---|---|---|---|")
    rows = []
    capacity = padded_capacity(max(args.context))
    layers = LAYERS if args.cold else 1
    weights = torch.ones(WEIGHT_BYTES // 4) if args.cold else None
    for batch in args.batch:
        for n in args.context:
            fused_calls, dense_calls, paged_calls = [], [], []
            for _ in range(layers):
                if args.paged:
                    paged_args = paged_layer(batch, n)
                    paged_calls.append(lambda paged_args=paged_args: native.paged_decode_attention(**paged_args))
                op_args, packed_bytes = packed_layer(batch, n, capacity)
                query = op_args[0]
                k = torch.randn(batch, KV_HEADS, capacity, HEAD_DIM)[:, :, :n]
                v = torch.randn(batch, KV_HEADS, capacity, HEAD_DIM)[:, :, :n]
                fused_calls.append(lambda op_args=op_args: native.decode_attention(*op_args))
                dense_calls.append(
                    lambda q=query, k=k, v=v: torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
                )

            def seconds(calls):
                if args.cold:
                    return median_cold_seconds(calls, max(1, args.repeats // 5), weights)
                return best_seconds(calls[0], args.repeats)

            variants = [(dot, fused_calls) for dot in args.dot]
            variants += [(f"{dot} paged", paged_calls) for dot in args.dot if args.paged]
            fused_s, dense_s = {name: [] for name, _ in variants}, []
            for _ in range(3):  # interleaved rounds, so a burst of load from elsewhere hits every column
                for name, calls in variants:
                    native.set_dot(name.split()[0])
                    fused_s[name].append(seconds(calls))
                dense_s.append(seconds(dense_calls))
            pick = statistics.median if args.cold else min
            d = pick(dense_s)
            dense_bytes = 2 * batch * KV_HEADS * n * HEAD_DIM * 4  # fp32 keys and values of the n tokens
            for name, _ in variants:
                f = pick(fused_s[name])
                print(
                    f"| {batch} | {n} | {name} | {f * 1e3:.3f} | {d * 1e3:.3f} | {d / f:.2f}x "
                    f"| {packed_bytes / f / 1e9:.1f} | {dense_bytes / d / 1e9:.1f} |"
                )
                rows.append(dict(batch=batch, context=n, arithmetic=name, native_seconds=f, dense_seconds=d,
                                 packed_bytes=packed_bytes, dense_bytes=dense_bytes))  # fmt: skip
    if args.json:
        bandwidth = read_bandwidth()
        print(f"read bandwidth: {bandwidth['gb_per_s']:.1f} GB/s ({bandwidth['method']})")
        record = {"settings": vars(args), "machine": lscpu_lines(), "isa": native.isa(),
                  "threads": torch.get_num_threads(), "read_bandwidth": bandwidth,
                  "last_level_cache_bytes": last_level_cache_bytes(), "rows": rows}  # fmt: skip
        Path(args.json).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
