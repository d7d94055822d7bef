"""The SYCL decode attention's two implementations on the same inputs, interleaved, medians: the fused kernel
(``kivi_packed_attention``, what XPU tensors run) and the composed kernels (``packed_key_scores``, a torch softmax,
``packed_value_combine``: what CPU tensors run), on the SYCL device serving CPU tensors (``opencl:cpu`` here) or on
``--device xpu`` when torch has an Intel GPU. SmolLM2-135M's attention shapes (9 query heads, 3 KV heads, head_dim
64), 2-bit G=32 history, 4 sinks, a 128-token window.

    python benchmarks/bench_sycl_attention.py [--batch 1 4] [--context 1024 8192] [--repeats 30] [--device cpu]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from attention_cases import Case, build  # noqa: E402

from kivi_xpu.ops import OPS  # noqa: E402
from kivi_xpu.ops import sycl as sycl_ops  # noqa: E402
from kivi_xpu.tools.machine import lscpu_lines  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--batch", type=int, nargs="+", default=[1, 4])
p.add_argument("--context", type=int, nargs="+", default=[1024, 8192])
p.add_argument("--repeats", type=int, default=30)
p.add_argument("--device", default="cpu", help="cpu (the OpenCL CPU device) or xpu")
args = p.parse_args()
print(*lscpu_lines(), sep="\n")
print(f"torch threads: {torch.get_num_threads()}, device: {args.device}")
print("| batch | context | fused ms | composed ms | composed / fused |\n|---|---|---|---|---|")
for batch in args.batch:
    for context in args.context:
        case = Case(
            batch=batch, kv_heads=3, ratio=3, sinks=4, key_count=context, value_count=context + 96, key_tail=128
        )
        call = {k: (v.to(args.device) if isinstance(v, torch.Tensor) else v) for k, v in build(case).items()}
        call["softcap"] = 0.0
        operands = list(call.values())
        OPS["decode_attention"].check(*operands)
        paths = {"fused": sycl_ops.fused_decode_attention, "composed": sycl_ops.composed_decode_attention}
        torch.testing.assert_close(paths["fused"](*operands), paths["composed"](*operands), rtol=1e-4, atol=1e-4)
        times = {name: [] for name in paths}
        for _ in range(args.repeats):
            for name, run in paths.items():
                start = time.perf_counter()
                run(*operands)
                if args.device == "xpu":
                    torch.xpu.synchronize()
                times[name].append(time.perf_counter() - start)
        fused, composed = (statistics.median(times[n]) * 1e3 for n in ("fused", "composed"))
        print(f"| {batch} | {context} | {fused:.2f} | {composed:.2f} | {composed / fused:.2f}x |")
