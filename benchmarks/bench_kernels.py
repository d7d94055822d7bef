"""Micro-benchmark of the SYCL kernels: effective bandwidth, compared with ``torch.Tensor.copy_`` and the reference.

For each op and size, the bytes a kernel must move (input read + outputs written) divided by its median time gives
GB/s; ``vs copy_`` is that bandwidth relative to ``copy_`` moving the same number of bytes (half read, half
written) in the same run; ``speedup`` is the reference (pure PyTorch) time over the kernel time.

    python benchmarks/bench_kernels.py [--batch 1 4] [--tokens 4096] [--repeats 7] [--sycl-device opencl:cpu:0]

A second table covers the fused attention ops at decode shapes (L=1 query row per head, GQA Hq=9 / Hkv=3, D=64,
2-bit, G=32, fp16 metadata by default): ms, GB/s of packed bytes read (codes + scales + zeros of the tokens used),
and ``vs dense`` = the time torch takes for the same math on dense fp32 K/V already in memory (``q @ K^T`` with the
query heads of a kv head batched together, ``p @ V``) divided by the kernel time, measured in the same run: above 1,
fused decoding on the 2-bit cache beats a full-precision cache for that step. ``--attention-only`` skips the first
table.

Prints a markdown table. Not a test: numbers depend on the machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from functools import partial

import torch

from kivi_xpu import backend
from kivi_xpu.ops import BackendOps, for_backend
from kivi_xpu.ops import reference as ref


def median_seconds(fn, repeats: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def copy_seconds(num_bytes: int, repeats: int, warmup: int) -> float:
    """``copy_`` reading and writing ``num_bytes`` in total."""
    src = torch.empty(num_bytes // 2, dtype=torch.uint8).random_()
    dst = torch.empty_like(src)
    return median_seconds(lambda: dst.copy_(src), repeats, warmup)


def cases(kernels: BackendOps, x: torch.Tensor, group_size: int, bits: int):
    """Yields (op name, kernel call, reference call, bytes moved) for the four ops on ``x [B, H, T, D]``."""
    tokens = x.shape[2]
    for layout in ("keys", "values"):
        quantize, dequantize = f"quantize_{layout}", f"dequantize_{layout}"
        codes, scales, zeros = getattr(ref, quantize)(x, group_size, bits)
        packed = nbytes(codes, scales, zeros)
        yield (
            quantize,
            lambda q=quantize: getattr(kernels, q)(x, group_size, bits),
            lambda q=quantize: getattr(ref, q)(x, group_size, bits),
            nbytes(x) + packed,
        )
        args = (codes, scales, zeros, tokens, group_size, bits, x.dtype)
        yield (
            dequantize,
            lambda d=dequantize, a=args: getattr(kernels, d)(*a),
            lambda d=dequantize, a=args: getattr(ref, d)(*a),
            packed + nbytes(x),
        )


def attention_rows(kernels: BackendOps, args):
    """Yields table rows for packed_key_scores / packed_value_combine against dense fp32 torch matmuls."""
    hq, hkv, d, g, bits = args.attn_heads, args.attn_kv_heads, args.attn_head_dim, args.group_size, 2
    meta = getattr(torch, args.attn_meta_dtype)
    rep = hq // hkv
    for batch in args.batch:
        for tokens in args.attn_tokens:
            keys = torch.randn(batch, hkv, tokens, d)
            values = torch.randn(batch, hkv, tokens, d)
            key_pack = ref.quantize_keys(keys, g, bits, meta)
            value_pack = ref.quantize_values(values, g, bits, meta)
            query = torch.randn(batch, hq, 1, d)
            probs = torch.softmax(torch.randn(batch, hq, 1, tokens), dim=-1)
            grouped_q, grouped_p = query.view(batch, hkv, rep, d), probs.view(batch, hkv, rep, tokens)
            keys_t = keys.transpose(2, 3)
            ops = (
                (
                    "packed_key_scores",
                    partial(kernels.packed_key_scores, query, *key_pack, tokens, g, bits),
                    partial(torch.matmul, grouped_q, keys_t),
                    nbytes(*key_pack),
                ),
                (
                    "packed_value_combine",
                    partial(kernels.packed_value_combine, probs, *value_pack, tokens, g, bits),
                    partial(torch.matmul, grouped_p, values),
                    nbytes(*value_pack),
                ),
            )
            for op, fused, dense, packed in ops:
                fused_s = median_seconds(fused, args.repeats, args.warmup)
                dense_s = median_seconds(dense, args.repeats, args.warmup)
                yield (
                    f"| {op} | {batch} | {tokens} | {packed / 1e6:.2f} | {fused_s * 1e3:.3f} | "
                    f"{packed / fused_s / 1e9:.2f} | {dense_s * 1e3:.3f} | {dense_s / fused_s:.2f} |"
                )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--group-size", type=int, default=32)
    parser.add_argument("--bits", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "float16"])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--backend", choices=("sycl", "native"), default="sycl", help="kernels to measure")
    parser.add_argument(
        "--sycl-device", default=None, help="SYCL filter string (default: $KIVI_XPU_DEVICE / first GPU / CPU)"
    )
    parser.add_argument("--attention-only", action="store_true", help="only the fused attention table")
    parser.add_argument("--attn-tokens", type=int, nargs="+", default=[1024, 4096, 8192])
    parser.add_argument("--attn-heads", type=int, default=9, help="query heads Hq")
    parser.add_argument("--attn-kv-heads", type=int, default=3, help="kv heads Hkv")
    parser.add_argument("--attn-head-dim", type=int, default=64)
    parser.add_argument("--attn-meta-dtype", default="float16")
    args = parser.parse_args()

    if args.sycl_device:
        os.environ[backend.DEVICE_ENV] = args.sycl_device  # CPU tensors run on this SYCL device
    kernels = for_backend(args.backend)
    print(f"kernels: {backend.select(args.backend).describe()}, torch threads: {torch.get_num_threads()}\n")
    if not args.attention_only:
        quantize_table(kernels, args)
    print(
        f"\nfused attention, decode: Hq={args.attn_heads}, Hkv={args.attn_kv_heads}, D={args.attn_head_dim}, L=1, "
        f"2-bit, G={args.group_size}, {args.attn_meta_dtype} metadata\n"
    )
    print("| op | B | T | packed MB | kernel ms | packed GB/s | dense fp32 torch ms | vs dense |")
    print("|---|---|---|---|---|---|---|---|")
    for row in attention_rows(kernels, args):
        print(row, flush=True)


def quantize_table(kernels: BackendOps, args) -> None:
    print("| op | B | dtype | bits | MB moved | kernel ms | kernel GB/s | vs copy_ | reference ms | speedup |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    copy_cache: dict[int, float] = {}
    for batch in args.batch:
        for dtype_name in args.dtypes:
            x = torch.randn(batch, args.heads, args.tokens, args.head_dim).to(getattr(torch, dtype_name))
            for bits in args.bits:
                for op, kernel_call, reference_call, moved in cases(kernels, x, args.group_size, bits):
                    kernel_s = median_seconds(kernel_call, args.repeats, args.warmup)
                    reference_s = median_seconds(reference_call, max(3, args.repeats // 2), 1)
                    if moved not in copy_cache:
                        copy_cache[moved] = copy_seconds(moved, args.repeats, args.warmup)
                    copy_s = copy_cache[moved]
                    print(
                        f"| {op} | {batch} | {dtype_name} | {bits} | {moved / 1e6:.1f} | {kernel_s * 1e3:.2f} | "
                        f"{moved / kernel_s / 1e9:.2f} | {copy_s / kernel_s:.2f} | {reference_s * 1e3:.2f} | "
                        f"{reference_s / kernel_s:.1f}x |",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
