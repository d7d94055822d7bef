"""Core cycles of the fused decode attention's integer loops, warm, against the count of their multiply instructions:
how far the arithmetic of csrc/cpu/decode_int8.h is from the machine's limit, apart from memory. Compiles
benchmarks/int8_loop_cycles.cpp (the kernel headers of this tree and loop_harness.h; no torch) once per ISA
this CPU has and runs it on one core: a key group (int8 query factors, which read the metadata in place, and
products) and a value block of 32 tokens for SmolLM2-135M's shapes (3 query rows per kv head, head_dim 64,
2-bit codes, float16 scales and zeros), or with --head-dim 128 Llama-3.2-3B's.

With --lut it also runs benchmarks/lut_key_cycles.cpp (issue 70's lookup-table prototype for the keys, which needs
GFNI) on the avx512_vnni and avx2 builds: the integer key loop, lookup tables with and without GFNI, exact tables,
their cycles per key group and errors, the methods alternating in one process; --group sets its key group size.

    python benchmarks/bench_int8_loops.py [--isa avx512_vnni avx512 avx2] [--cxx g++] [--head-dim 128]
    python benchmarks/bench_int8_loops.py --isa avx512_vnni avx2 --head-dim 128 --lut [--group 128]

The throughput line (independent ymm vpdpbusd, or vpmaddubsw without VNNI) sets the floor: a key group or a value
block takes 192 of them (384 at head_dim 128). The timings move with the VM's speed (run the variants you compare in
one go).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
from pathlib import Path

from kivi_xpu import _cpu as native
from kivi_xpu.tools.machine import lscpu_lines

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "int8_loop_cycles.cpp"
LUT_SOURCE = HERE / "lut_key_cycles.cpp"
HEADERS = HERE.parent / "csrc" / "cpu"
# The native kernels' ISA names with integer loops -> the macro int8_loop_cycles.cpp selects that ISA by
ISAS = {"avx512_vnni": "LOOPS_AVX512_VNNI", "avx512": "LOOPS_AVX512", "avx2": "LOOPS_AVX2"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--isa", nargs="+", choices=list(ISAS), default=list(ISAS), help="ISAs to build (default: all)")
    parser.add_argument("--cxx", default=os.environ.get("CXX", "g++"), help="C++ compiler (default: $CXX or g++)")
    parser.add_argument("--head-dim", type=int, default=64, choices=[32, 64, 128, 256], help="head_dim (default 64)")
    parser.add_argument("--lut", action="store_true", help="also run the lookup-table prototype (needs GFNI)")
    parser.add_argument("--group", type=int, default=32, choices=[32, 64, 128], help="--lut's key group (default 32)")
    args = parser.parse_args()
    print(*lscpu_lines(), sep="\n")
    gfni = "gfni" in Path("/proc/cpuinfo").read_text().split()
    if args.lut and not gfni:
        print("\n--lut: skipped, this CPU has no GFNI (the prototype's bit transpose needs it)")
    available = native.available_isas()  # what the native kernels' own dispatch finds on this CPU
    with tempfile.TemporaryDirectory() as build:
        for isa in args.isa:
            if isa not in available:
                print(f"\n{isa}: skipped, this CPU has only {', '.join(available)}")
                continue
            binary = Path(build) / isa
            flags_of_build = ["-O3", "-std=c++17", f"-D{ISAS[isa]}", f"-I{HEADERS}"]
            subprocess.run([args.cxx, *flags_of_build, str(SOURCE), "-o", str(binary)], check=True, capture_output=True)
            # one core, so that the TSC-to-core-cycle ratio measured first holds for the loops that follow
            result = subprocess.run(
                ["taskset", "-c", "0", str(binary), str(args.head_dim)], check=True, capture_output=True, text=True
            )
            print(f"\n{isa}:\n{result.stdout}", end="")
            if args.lut and gfni and isa != "avx512":  # (the prototype has the avx512_vnni and avx2 builds)
                lut = Path(build) / f"lut_{isa}"
                build_lut = [args.cxx, *flags_of_build, str(LUT_SOURCE), "-o", str(lut)]
                subprocess.run(build_lut, check=True, capture_output=True)
                result = subprocess.run(
                    ["taskset", "-c", "0", str(lut), str(args.head_dim), str(args.group)],
                    check=True, capture_output=True, text=True,
                )  # fmt: skip
                print(result.stdout, end="")


if __name__ == "__main__":
    main()
