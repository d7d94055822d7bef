"""The environment a result was measured in: library versions, threads, the CPU model and ISA, which
implementation ran the KIVI kernels, and the machine's measured read bandwidth (:func:`read_bandwidth`)."""

from __future__ import annotations

import datetime
import glob
import importlib
import os
import platform
import re
import subprocess
import time

import torch
import transformers

from .. import __version__
from ..runtime import attention_arithmetic
from .options import ToolOptions


def report_header(tool: str, options: ToolOptions, model: str | None = None, model_path: str | None = None) -> dict:
    """The fields every tool's JSON report starts with: ``tool``, ``date`` (UTC), ``model`` (default
    ``options.model``), ``model_path`` (when given), ``settings`` and ``environment``."""
    header = {
        "tool": tool,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "model": options.model if model is None else model,
    }
    if model_path is not None:
        header["model_path"] = model_path
    return header | {"settings": options.settings(), "environment": environment(options)}


def environment(options: ToolOptions) -> dict:
    from ..backend import select

    kivi_backend = kivi_kernels = None
    if any(name.startswith("kivi") for name in options.caches):
        selection = select(options.backend, options.sycl_device)
        kivi_backend, kivi_kernels = selection.describe(), kernel_implementation(selection)
    return {
        "kivi_xpu": __version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "kivi_backend": kivi_backend,
        "kivi_kernels": kivi_kernels,
        "cpu": cpu_facts(),
    }


# The instruction-set extensions that decide which kernels a CPU can run fast ("amx" stands for every amx_* flag).
ISA_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "avx512_fp16")


def cpu_facts() -> dict:
    """``{"model": ..., "CPU family": ..., "Model": ..., "isa": [...]}``: the CPU model name, family and model number
    (as ``lscpu`` names them) and which of ``ISA_FLAGS`` (and AMX) it has, from ``/proc/cpuinfo`` (else ``lscpu``;
    else the model from :mod:`platform` and no flags)."""
    text = _read_cpuinfo()
    model = _field(text, ("model name", "Model name")) or platform.processor() or None
    flags = set((_field(text, ("flags", "Flags")) or "").split())
    isa = [f for f in ISA_FLAGS if f in flags]
    amx = sorted(f for f in flags if f.startswith("amx"))
    family, number = _field(text, ("cpu family", "CPU family")), _field(text, ("model", "Model"))
    return {
        "model": model,
        "CPU family": family,
        "Model": number,
        "isa": isa + (["amx (" + ", ".join(amx) + ")"] if amx else []),
    }


def lscpu_lines() -> list[str]:
    """The ``Model name``, ``CPU family``, ``Model`` and ``Flags`` lines of ``lscpu``, which every measurement prints
    beside its numbers (a VM's model name may say only "AMD EPYC": the family and model tell its generation); empty
    where ``lscpu`` is missing."""
    return [line for line in _lscpu().splitlines() if line.startswith(("Model name", "CPU family", "Model:", "Flags"))]


def _lscpu(*options: str) -> str:
    """What ``lscpu`` with ``options`` prints ("" where it is missing or fails)."""
    try:
        return subprocess.run(["lscpu", *options], capture_output=True, text=True, timeout=10, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def _read_cpuinfo() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return f.read()
    except OSError:
        return _lscpu()


def _field(text: str, names: tuple[str, ...]) -> str | None:
    """The value of the first ``name: value`` line whose name is one of ``names``."""
    for line in text.splitlines():
        name, sep, value = line.partition(":")
        if sep and name.strip() in names:
            return value.strip()
    return None


def kernel_implementation(cache_or_backend) -> dict | None:
    """Which implementation runs a KIVI cache's kernels: ``{"backend": name, "description": ..., "isa": ...,
    "attention_arithmetic": ...}`` from a ``KiviCache`` (its ``backend``) or a backend selection; ``None`` for
    anything without one. ``isa`` is what ``kivi_xpu._cpu.isa()`` reports when that native CPU module exists, and
    ``attention_arithmetic`` the native decode attention's arithmetic on packed codes (``int8`` or ``fp32``)."""
    backend = getattr(cache_or_backend, "backend", cache_or_backend)
    name = getattr(backend, "name", None)
    if name is None:
        return None
    describe = getattr(backend, "describe", None)
    isa, arithmetic = _native_facts()
    return {
        "backend": name,
        "description": describe() if callable(describe) else None,
        "isa": isa,
        "attention_arithmetic": arithmetic,
    }


def _native_facts() -> tuple[str | None, str | None]:
    """(ISA, decode-attention arithmetic) of the native CPU module, (None, None) when it is not built."""
    try:
        module = importlib.import_module("kivi_xpu._cpu")
    except ImportError:
        return None, None
    return str(module.isa()), attention_arithmetic(module)


MIB = 1 << 20
# The read-bandwidth probe's buffer: 4x the last-level cache, at least MIN_PROBE_BYTES (so that even a cache that
# keeps part of a streamed buffer cannot serve a noticeable share of it), at most MAX_PROBE_BYTES.
MIN_PROBE_BYTES = 256 * MIB
MAX_PROBE_BYTES = 4096 * MIB


def read_bandwidth(repeats: int = 10) -> dict:
    """The machine's streaming read bandwidth with torch's current thread count (``torch.get_num_threads()``, what
    the benchmark runs with): ``buf.sum()`` over a float32 buffer of 4x the last-level cache (at least 256 MiB, at
    most 4 GiB; its pages written once first, so that no page fault is timed), one untimed call, then the best of
    ``repeats`` timed ones. Returns ``{"gb_per_s": buffer bytes / seconds / 1e9, "buffer_bytes", "llc_bytes"
    (None when unknown), "threads", "repeats", "method"}``.

    A float32 sum is vectorised and split over torch's threads, so it reads as fast as memory delivers (checked
    against an AVX2 OpenMP loop of loads and adds and against NumPy's single-threaded sum: docs/tools.md); an int32
    or uint8 ``sum`` is not (it widens every element to int64 first, at a few percent of the bandwidth)."""
    llc = last_level_cache_bytes()
    nbytes = min(max(4 * (llc or 0), MIN_PROBE_BYTES), MAX_PROBE_BYTES) // 64 * 64
    buf = torch.ones(nbytes // 4, dtype=torch.float32)
    buf.sum()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - start)
    del buf
    return {
        "gb_per_s": nbytes / best / 1e9,
        "buffer_bytes": nbytes,
        "llc_bytes": llc,
        "threads": torch.get_num_threads(),
        "repeats": repeats,
        "method": "torch.sum over a float32 buffer (4x the last-level cache, 256 MiB to 4 GiB), best of the "
        "repeats after one warm-up call",
    }


def last_level_cache_bytes() -> int | None:
    """The bytes of the last-level cache over the whole machine: from sysfs, the size of the highest-level data or
    unified cache times its number of instances (distinct ``shared_cpu_list`` over the CPUs); else ``lscpu -B``'s
    total for its highest cache level; ``None`` when neither says."""
    caches: dict[int, dict[str, int]] = {}  # level -> {shared_cpu_list: bytes}
    for index in glob.glob("/sys/devices/system/cpu/cpu[0-9]*/cache/index[0-9]*"):
        try:
            if _read(f"{index}/type") == "Instruction":
                continue
            level, size = int(_read(f"{index}/level")), _size_bytes(_read(f"{index}/size"))
            caches.setdefault(level, {})[_read(f"{index}/shared_cpu_list")] = size
        except (OSError, ValueError):
            continue
    if caches:
        return sum(caches[max(caches)].values())
    text = _lscpu("-B")
    levels = {int(m[1]): int(m[2]) for m in re.finditer(r"^L(\d)[a-z]* cache:\s*(\d+)", text, re.MULTILINE)}
    return levels[max(levels)] if levels else None


def _read(path: str) -> str:
    with open(path) as f:
        return f.read().strip()


def _size_bytes(text: str) -> int:
    """sysfs cache sizes: ``"32768K"``, ``"1M"`` or plain bytes."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1]] if text[-1:] in units else int(text)
