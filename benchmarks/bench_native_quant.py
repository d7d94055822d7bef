"""Bandwidth of the native CPU quantize / dequantize kernels (kivi_xpu._cpu) per ISA, against ``torch.Tensor.copy_``.

Shapes of a real decode of SmolLM2 (3 kv heads, head_dim 64, group 32): a 128-token key block and a single value
token (what one decode step quantizes), and an 8k-token bulk quantize / dequantize (prefill, or a whole cache).
For each op, GB/s = bytes the op moves (the float tensor read or written + the packed codes and metadata) over its
best time; ``copy_`` GB/s = 2 x the same float bytes (read + write) over the best time of copying that float tensor,
measured interleaved with the op in the same run; ``vs copy_`` is their ratio (the target for bulk ops is >= 0.5).
With one thread (the default) times are the thread's CPU time, so a machine shared with other busy processes still
gives meaningful ratios; with more threads (``--threads``) they are wall-clock times.

    python benchmarks/bench_native_quant.py [--batch 1 4] [--bits 2] [--dtype float32] [--rounds 15] [--threads 1]

Prints the CPU model and flags, then a markdown table. Not a test: numbers depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import time

import torch

from kivi_xpu import _cpu as native
from kivi_xpu.tools.machine import lscpu_lines

HEADS, HEAD_DIM, GROUP = 3, 64, 32


def seconds(fn, inner: int) -> float:
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    start = clock()
    for _ in range(inner):
        fn()
    return (clock() - start) / inner


def compare(op, source: torch.Tensor, rounds: int) -> tuple[float, float]:
    """Best seconds of `op` and of copying `source`, measured alternately so both see the same machine load."""
    target = torch.empty_like(source)
    op(), target.copy_(source)  # warm up: allocations, page faults, thread pool
    once = max(min(seconds(op, 1) for _ in range(3)), 1e-6)
    inner = max(1, int(5e-3 / once))  # ~5 ms per sample
    op_best = copy_best = float("inf")
    for _ in range(rounds):
        op_best = min(op_best, seconds(op, inner))
        copy_best = min(copy_best, seconds(lambda: target.copy_(source), inner))
    return op_best, copy_best


def nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def cases(batch: int, bits: int, dtype: torch.dtype):
    """(name, op, float tensor it reads or writes, bytes it moves)."""
    for label, tokens, keys, values in (
        ("key block", 128, True, False),
        ("value token", 1, False, True),
        ("bulk 8k", 8192, True, True),
    ):
        x = torch.randn(batch, HEADS, tokens, HEAD_DIM).to(dtype)
        if keys:
            packed = native.quantize_keys(x, GROUP, bits, torch.float16)
            moved = nbytes(x, *packed)
            yield f"{label} quantize_keys", lambda x=x: native.quantize_keys(x, GROUP, bits, torch.float16), x, moved
            yield (
                f"{label} dequantize_keys",
                lambda p=packed, t=tokens: native.dequantize_keys(*p, t, GROUP, bits, dtype),
                x,
                moved,
            )
        if values:
            packed = native.quantize_values(x, GROUP, bits, torch.float16)
            moved = nbytes(x, *packed)
            yield (
                f"{label} quantize_values",
                lambda x=x: native.quantize_values(x, GROUP, bits, torch.float16),
                x,
                moved,
            )
            yield (
                f"{label} dequantize_values",
                lambda p=packed, t=tokens: native.dequantize_values(*p, t, GROUP, bits, dtype),
                x,
                moved,
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--bits", type=int, default=2, choices=(2, 4, 8))
    parser.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: CPU-time clock)")
    parser.add_argument("--isa", nargs="+", default=native.available_isas(), help="ISAs to measure (default: all)")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    torch.set_num_threads(args.threads)

    print(*lscpu_lines(), sep="\n")
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} intra-op threads, {args.bits}-bit, G={GROUP}, "
        f"{args.dtype} data, fp16 metadata\n"
    )
    print("| ISA | batch | op | op GB/s | copy_ GB/s | vs copy_ |")
    print("|---|---|---|---|---|---|")
    for isa in args.isa:
        native.set_isa(isa)
        for batch in args.batch:
            for name, op, source, moved in cases(batch, args.bits, dtype):
                op_s, copy_s = compare(op, source, args.rounds)
                op_gbs, copy_gbs = moved / op_s / 1e9, 2 * nbytes(source) / copy_s / 1e9
                print(
                    f"| {isa} | {batch} | {name} | {op_gbs:.1f} | {copy_gbs:.1f} | {op_gbs / copy_gbs:.2f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
