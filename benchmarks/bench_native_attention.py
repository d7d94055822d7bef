"""Benchmark of the native CPU fused decode attention (``kivi_xpu._cpu.decode_attention``) against dense SDPA.

SmolLM2-135M shapes (Hq 9, Hkv 3, head_dim 64, one query row per head), KIVI 2-bit, group 32, residual 128, fp16
metadata, fp32 model: for each batch and context ``n`` the op attends over ``n`` tokens (``n - 128`` packed
values, the packed keys in whole groups, the rest exact), and ``torch.nn.functional.scaled_dot_product_attention``
attends over the same ``n`` tokens of dense fp32 K/V preallocated at the maximum length (what a StaticCache costs).
Columns: best ms of each over ``--repeats`` calls in each of 3 interleaved rounds (the least disturbed call: on a
shared machine a descheduled pool thread adds whole time slices to the others), for each arithmetic of ``--dot``
(``int8``: integer dot products, the default; ``fp32``: codes converted to floats), ``dense/native`` (above 1: the
fused op is faster), and GB/s of packed bytes read (codes + scales + zeros of the packed tokens) by the native op.

    python benchmarks/bench_native_attention.py [--batch 1 4] [--context 1024 4096 8192] [--isa avx2]
        [--dot int8 fp32]

Prints the CPU model, its SIMD flags and the ISA used. Not a test: numbers depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import subprocess
import time

import torch

from kivi_xpu import _cpu as native
from kivi_xpu.ops.reference import quantize_keys, quantize_values

Q_HEADS, KV_HEADS, HEAD_DIM, BITS, GROUP, RESIDUAL = 9, 3, 64, 2, 32, 128
META = torch.float16


def cpu_description() -> str:
    info = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    fields = dict(line.split(":", 1) for line in info.splitlines() if ":" in line)
    flags = [f for f in fields.get("Flags", "").split() if f.startswith(("avx", "fma", "f16c"))]
    return f"{fields.get('Model name', '?').strip()} | flags: {' '.join(flags)}"


def best_seconds(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--context", type=int, nargs="+", default=[1024, 4096, 8192])
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument(
        "--isa", choices=["avx512_vnni", "avx512", "avx2", "baseline"], help="force an ISA (default: the best)"
    )
    parser.add_argument("--dot", choices=["int8", "fp32"], nargs="+", default=["int8", "fp32"], help="arithmetics")
    args = parser.parse_args()
    if args.isa:
        native.set_isa(args.isa)
    torch.manual_seed(0)
    print(f"CPU: {cpu_description()}")
    print(f"ISA: {native.isa()}  threads: {torch.get_num_threads()}  torch {torch.__version__}")
    print("| batch | context | arithmetic | native ms | dense SDPA ms | dense/native | native GB/s (packed) |")
    print("|---|---|---|---|---|---|---|")
    capacity = max(args.context)
    for batch in args.batch:
        keys = torch.randn(batch, KV_HEADS, capacity, HEAD_DIM)
        values = torch.randn(batch, KV_HEADS, capacity, HEAD_DIM)
        for n in args.context:
            op_args, packed_bytes = packed_layer(batch, n, capacity)
            query = op_args[0]
            k, v = keys[:, :, :n], values[:, :, :n]

            def fused(op_args=op_args):
                return native.decode_attention(*op_args)

            def dense(query=query, k=k, v=v):
                return torch.nn.functional.scaled_dot_product_attention(query, k, v, enable_gqa=True)

            fused_s, dense_s = {dot: [] for dot in args.dot}, []
            for _ in range(3):  # interleaved rounds, so a burst of load from elsewhere hits every column
                for dot in args.dot:
                    native.set_dot(dot)
                    fused_s[dot].append(best_seconds(fused, args.repeats))
                dense_s.append(best_seconds(dense, args.repeats))
            d = min(dense_s)
            for dot in args.dot:
                f = min(fused_s[dot])
                print(
                    f"| {batch} | {n} | {dot} | {f * 1e3:.3f} | {d * 1e3:.3f} | {d / f:.2f}x "
                    f"| {packed_bytes / f / 1e9:.1f} |"
                )


if __name__ == "__main__":
    main()
