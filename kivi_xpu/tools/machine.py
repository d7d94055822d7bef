"""The environment a result was measured in: library versions, threads, the CPU model and ISA, and which
implementation ran the KIVI kernels."""

from __future__ import annotations

import datetime
import importlib
import os
import platform
import subprocess

import torch
import transformers

from .. import __version__
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
        selection = select(options.backend, options.device)
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
    """``{"model": ..., "isa": [...]}``: the CPU model name and which of ``ISA_FLAGS`` (and AMX) it has, from
    ``/proc/cpuinfo`` (else ``lscpu``; else the model from :mod:`platform` and no flags)."""
    text = _read_cpuinfo()
    model = _field(text, ("model name", "Model name")) or platform.processor() or None
    flags = set((_field(text, ("flags", "Flags")) or "").split())
    isa = [f for f in ISA_FLAGS if f in flags]
    amx = sorted(f for f in flags if f.startswith("amx"))
    return {"model": model, "isa": isa + (["amx (" + ", ".join(amx) + ")"] if amx else [])}


def _read_cpuinfo() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return f.read()
    except OSError:
        pass
    try:
        return subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def _field(text: str, names: tuple[str, ...]) -> str | None:
    """The value of the first ``name: value`` line whose name is one of ``names``."""
    for line in text.splitlines():
        name, sep, value = line.partition(":")
        if sep and name.strip() in names:
            return value.strip()
    return None


def kernel_implementation(cache_or_backend) -> dict | None:
    """Which implementation runs a KIVI cache's kernels: ``{"backend": name, "description": ..., "isa": ...}``
    from a ``KiviCache`` (its ``backend``) or a backend selection; ``None`` for anything without one. ``isa`` is
    what ``kivi_xpu._cpu.isa()`` reports when that native CPU module exists."""
    backend = getattr(cache_or_backend, "backend", cache_or_backend)
    name = getattr(backend, "name", None)
    if name is None:
        return None
    describe = getattr(backend, "describe", None)
    return {"backend": name, "description": describe() if callable(describe) else None, "isa": _native_isa()}


def _native_isa() -> str | None:
    try:
        module = importlib.import_module("kivi_xpu._cpu")
    except ImportError:
        return None
    isa = getattr(module, "isa", None)
    return str(isa()) if callable(isa) else None
