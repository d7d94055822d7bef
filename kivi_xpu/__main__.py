"""Command line: ``python -m kivi_xpu info`` (also the ``kivi-xpu`` console script)."""

from __future__ import annotations

import argparse
import json
import sys

from . import __version__, backend
from .ops.library import OPS


def _print_info(facts: dict) -> None:
    print(f"kivi-xpu {__version__}")
    for key in ("torch", "dpctl", "intel-sycl-rt", "intel-opencl-rt"):
        print(f"  {key:<16} {facts.get(key) or 'not installed'}")
    print("SYCL devices:")
    for device in facts["devices"] or [{"filter": "-", "name": "none found"}]:
        print(f"  {device['filter']:<20} {device['name']}")
    print(f"backend: {facts['backend']} ({facts['reason']})")
    if facts["backend"] == "sycl":
        d = facts["device_facts"]
        print(f"  device {facts['device']}: {d['name']}, driver {d['driver_version']}")
        print(f"  kernels compiled: yes, in {facts['compile_seconds']:.2f} s (build options {d['build_options']})")
        print(f"  host memory access (usm_system_allocations): {d['usm_system_allocations']}")
    else:
        print("  kernels compiled: no")
    print(f"kernel cache: {facts['SYCL_CACHE_DIR']} (persistent={facts['SYCL_CACHE_PERSISTENT']})")
    print(f"OCL_ICD_FILENAMES: {facts['OCL_ICD_FILENAMES']}")
    if facts["backend"] == "error":
        return
    op_backend = "SYCL kernels" if facts["backend"] == "sycl" else "pure-PyTorch reference"
    print(f"ops on CPU tensors -> {op_backend}: " + ", ".join(f"torch.ops.kivi_xpu.{op}" for op in OPS))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="kivi-xpu", description="kivi-xpu tools")
    commands = parser.add_subparsers(dest="command", required=True)
    info = commands.add_parser("info", help="versions, SYCL devices, chosen backend, kernel compilation")
    info.add_argument("--backend", choices=backend.BACKENDS, help="default: $KIVI_XPU_BACKEND or auto")
    info.add_argument("--device", help="SYCL device filter, default: $KIVI_XPU_DEVICE or the first GPU/CPU")
    info.add_argument("--json", action="store_true", help="print the facts as JSON")
    args = parser.parse_args(argv)

    facts = backend.info(args.backend, args.device)
    if args.json:
        print(json.dumps(facts, indent=2, default=str))
    else:
        _print_info(facts)
    return 1 if facts["backend"] == "error" else 0


if __name__ == "__main__":
    sys.exit(main())
