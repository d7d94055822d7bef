"""Command line: ``python -m kivi_xpu {info,bench,eval-ppl,calibrate,plan,serve}`` (the ``kivi-xpu`` script).

* ``info``: versions, SYCL devices, the chosen backend, whether the kernels compile, the kernel cache's variants;
* ``bench``: prefill time, decode speed, KV memory, peak memory and token match of several caches
  (:mod:`kivi_xpu.tools.bench`, also ``python -m kivi_xpu.tools.bench``);
* ``eval-ppl``: perplexity on a text with the cache in the loop, decode or streaming mode
  (:mod:`kivi_xpu.tools.eval_ppl`, also ``python -m kivi_xpu.tools.eval_ppl``);
* ``calibrate``: per-layer KIVI settings for a bits/element budget from a short calibration, written as a
  ``layer_overrides`` JSON file (:mod:`kivi_xpu.tools.calibrate`, also ``python -m kivi_xpu.tools.calibrate``);
* ``plan``: how many requests of a given length a KV budget holds, with KIVI pages and without, in transformers'
  batching and in vLLM, and the longest prompt (:mod:`kivi_xpu.tools.plan`);
* ``serve``: transformers' OpenAI-compatible server (``transformers serve``) with the KIVI cache
  (:mod:`kivi_xpu.tools.serve`; its arguments go to that module unparsed, since most are transformers').
"""

from __future__ import annotations

import argparse
import json
import sys

from . import __version__, backend
from .backend import PROBE_VARIANT
from .ops.library import OPS
from .tools import bench as bench_tool
from .tools import calibrate as calibrate_tool
from .tools import eval_ppl as evaluate_tool
from .tools import plan as plan_tool
from .tools import serve as serve_tool
from .tools.cli import run_tool


def _print_info(facts: dict) -> None:
    print(f"kivi-xpu {__version__}")
    for key in ("torch", "dpctl", "intel-sycl-rt", "intel-opencl-rt"):
        print(f"  {key:<16} {facts.get(key) or 'not installed'}")
    print("SYCL devices:")
    for device in facts["devices"] or [{"filter": "-", "name": "none found"}]:
        print(f"  {device['filter']:<20} {device['name']}")
    if facts["native_isa"]:
        print(f"native CPU kernels: {facts['native_isa']} (decode attention: {facts['native_attention_arithmetic']})")
    else:
        print(f"native CPU kernels: not built: {facts.get('native_reason', '')}")
    print(f"backend: {facts['backend']} ({facts['reason']})")
    if facts["backend"] == "sycl":
        d = facts["device_facts"]
        print(f"  device {facts['device']}: {d['name']}, driver {d['driver_version']}")
        print(
            f"  kernels compiled: yes ({PROBE_VARIANT} in {facts['compile_seconds']:.2f} s; build options "
            f"{d['build_options']}); each of the {d['variants']} variants compiles when first used"
        )
        print(f"  host memory access (usm_system_allocations): {d['usm_system_allocations']}")
    else:
        print("  SYCL kernels: not used by this backend (nothing to compile)")
    print(f"kernel cache: {facts['SYCL_CACHE_DIR']} (persistent={facts['SYCL_CACHE_PERSISTENT']})")
    cached = facts["cached_variants"]
    print(f"  {len(cached)} kernel variant(s) cached" + "".join(f"\n    {name}" for name in cached))
    print(f"OCL_ICD_FILENAMES: {facts['OCL_ICD_FILENAMES']}")
    if facts["backend"] == "error":
        return
    print("a KiviCache layer whose keys arrive on (the device rule, docs/devices.md):")
    for device, kernels in facts["device_rule"].items():
        print(f"  {device:<22} {kernels}")
    op_backend = {"sycl": "SYCL kernels", "native": "native CPU kernels"}.get(
        facts["backend"], "pure-PyTorch reference"
    )
    print(f"ops on CPU tensors -> {op_backend}: " + ", ".join(f"torch.ops.kivi_xpu.{op}" for op in OPS))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="kivi-xpu", description="kivi-xpu tools")
    commands = parser.add_subparsers(dest="command", required=True)
    info = commands.add_parser("info", help="versions, SYCL devices, chosen backend, kernel compilation")
    info.add_argument("--backend", choices=backend.BACKENDS, help="default: $KIVI_XPU_BACKEND or auto")
    # --sycl-device as in the tools, where --device is the model's torch device.
    info.add_argument(
        "--sycl-device", help="SYCL device filter, e.g. opencl:cpu (default: $KIVI_XPU_DEVICE or the first GPU/CPU)"
    )
    info.add_argument("--json", action="store_true", help="print the facts as JSON")
    for name, tool, summary in (
        ("bench", bench_tool, "decode speed, KV and peak memory, token match of several caches"),
        ("eval-ppl", evaluate_tool, "perplexity on a text with the cache in the loop (decode or streaming)"),
        ("calibrate", calibrate_tool, "per-layer KIVI settings for a bits/element budget (layer_overrides file)"),
        ("plan", plan_tool, "requests and tokens a KV budget holds, KIVI pages or not, in each engine (no model run)"),
    ):
        sub = commands.add_parser(
            name, help=summary, description=tool.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
        )
        tool.add_arguments(sub)
        sub.set_defaults(func=tool.command)
    # Listed here for --help; its arguments (transformers serve's and the KIVI options) are parsed by the tool.
    commands.add_parser("serve", help="transformers' OpenAI-compatible server with the KIVI cache", add_help=False)
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["serve"]:
        return serve_tool.main(argv[1:])
    args = parser.parse_args(argv)
    if args.command != "info":
        return run_tool(args.func, args)

    facts = backend.info(args.backend, args.sycl_device)
    if args.json:
        print(json.dumps(facts, indent=2, default=str))
    else:
        _print_info(facts)
    return 1 if facts["backend"] == "error" else 0


if __name__ == "__main__":
    sys.exit(main())
