"""Run-time environment, SYCL device selection and backend choice for the kernels.

Importing this module prepares the environment, so it must be imported before anything loads the SYCL runtime
(dpctl or ``kivi_xpu._C``):

* ``OCL_ICD_FILENAMES`` -> the installed ``libintelocl.so`` (the ICD file shipped by pip points nowhere), unless set;
* ``SYCL_CACHE_PERSISTENT=1`` and ``SYCL_CACHE_DIR`` (``$XDG_CACHE_HOME/kivi_xpu/sycl``, default
  ``~/.cache/kivi_xpu/sycl``) unless set, so kernels compile once per machine instead of once per process.

Environment variables read:

* ``KIVI_XPU_BACKEND`` = ``auto`` (default) | ``sycl`` | ``reference``;
* ``KIVI_XPU_DEVICE`` = a dpctl filter string such as ``opencl:cpu:0`` or ``level_zero:gpu:0`` (default: the first
  GPU, else the first CPU device).
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import os
import site
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

BACKENDS = ("auto", "sycl", "reference")
BACKEND_ENV = "KIVI_XPU_BACKEND"
DEVICE_ENV = "KIVI_XPU_DEVICE"


def _library_dirs() -> list[Path]:
    """Where pip wheels (intel-opencl-rt, intel-sycl-rt) put shared libraries: ``<prefix>/lib``."""
    prefixes = [Path(sys.prefix), Path(sys.base_prefix)]
    prefixes += [Path(p).parents[2] for p in site.getsitepackages() + [site.getusersitepackages()]]
    return [prefix / "lib" for prefix in dict.fromkeys(prefixes)]


def _find_opencl_cpu_runtime() -> str | None:
    for lib_dir in _library_dirs():
        candidate = lib_dir / "libintelocl.so"
        if candidate.exists():
            return str(candidate)
    return None


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kivi_xpu" / "sycl"


def configure_environment() -> None:
    """Sets the variables the SYCL runtime reads when it first loads; values the user set are kept."""
    if "OCL_ICD_FILENAMES" not in os.environ:
        runtime = _find_opencl_cpu_runtime()
        if runtime is not None:
            os.environ["OCL_ICD_FILENAMES"] = runtime
    os.environ.setdefault("SYCL_CACHE_PERSISTENT", "1")
    os.environ.setdefault("SYCL_CACHE_DIR", str(default_cache_dir()))


configure_environment()


def available_devices() -> list[dict[str, str]]:
    """SYCL devices visible through dpctl: ``[{"filter": "opencl:cpu:0", "name": ...}, ...]`` ([] without dpctl)."""
    try:
        import dpctl
    except ImportError:
        return []
    return [{"filter": d.filter_string, "name": d.name} for d in dpctl.get_devices()]


def _describe(devices: list[dict[str, str]]) -> str:
    return ", ".join(f"{d['filter']} ({d['name']})" for d in devices) or "none"


def select_device(device: str | None = None) -> str:
    """Canonical filter string of the SYCL device to use: ``device``, else ``$KIVI_XPU_DEVICE``, else the first
    GPU when torch has XPU support, else the first CPU device. Raises ValueError naming the argument if the filter
    matches no device."""
    import dpctl

    requested, source = (device, "device") if device is not None else (os.environ.get(DEVICE_ENV), DEVICE_ENV)
    if requested:
        try:
            return dpctl.SyclDevice(requested).filter_string
        except Exception as error:  # dpctl raises SyclDeviceCreationError / TypeError for bad filters
            available = _describe(available_devices())
            raise ValueError(
                f"`{source}`={requested!r} matches no SYCL device ({error}); available: {available}"
            ) from None
    devices = dpctl.get_devices()
    # A GPU only helps when torch can allocate on it (an XPU build of torch); otherwise the CPU device.
    preferred = ("gpu", "cpu") if hasattr(torch, "xpu") and torch.xpu.is_available() else ("cpu", "gpu")
    for wanted in preferred:
        for d in devices:
            if d.device_type.name == wanted:
                return d.filter_string
    raise RuntimeError(f"no SYCL GPU or CPU device found; available: {_describe(available_devices())}")


def backend_choice(backend: str | None = None) -> str:
    """``backend`` argument, else ``$KIVI_XPU_BACKEND``, else ``auto``; validated."""
    value, source = (backend, "backend") if backend is not None else (os.environ.get(BACKEND_ENV, "auto"), BACKEND_ENV)
    if value not in BACKENDS:
        raise ValueError(f"`{source}` must be one of {BACKENDS}, got {value!r}")
    return value


@dataclass(frozen=True)
class Runtime:
    """The loaded extension and the facts its ``init`` returned for one device (see csrc/kivi_ext.cpp)."""

    module: Any  # kivi_xpu._C
    device: str  # canonical filter string, e.g. "opencl:cpu:0"
    facts: dict


def load_extension():
    """Imports ``kivi_xpu._C``; RuntimeError with the reason if it was not built or cannot load."""
    try:
        return importlib.import_module("kivi_xpu._C")
    except ImportError as error:
        raise RuntimeError(
            f"the SYCL extension kivi_xpu._C is not available ({error}); it is built by "
            "`pip install --no-build-isolation -e .` when the intel-sycl-rt runtime is installed"
        ) from None


@functools.cache
def _runtime_for(filter_string: str) -> Runtime:
    module = load_extension()
    return Runtime(module, filter_string, dict(module.init(filter_string)))


def get_runtime(device: str | None = None) -> Runtime:
    """The extension initialised for ``device`` (see :func:`select_device`); kernels compile on first use."""
    load_extension()  # report a missing extension before looking for devices
    return _runtime_for(select_device(device))


@dataclass(frozen=True)
class Selection:
    """Outcome of :func:`select`: ``kernels`` exposes the four ops with the reference's signatures."""

    name: str  # "sycl" or "reference"
    kernels: Any
    sycl_device: str | None
    reason: str  # why this backend was chosen

    def storage_device(self, model_device) -> torch.device:
        """Where a cache keeps its packed history: host memory for a SYCL device that can read it (the
        OpenCL CPU device), torch's XPU device for a GPU, the model's device on the reference path."""
        if self.name == "reference":
            return torch.device(model_device)
        return torch.device("cpu") if self.kernels.facts["usm_system_allocations"] else torch.device("xpu")

    def describe(self) -> str:
        if self.name == "reference":
            return f"reference (pure PyTorch; packed history on the model's device): {self.reason}"
        return f"sycl on {self.sycl_device} ({self.kernels.facts['name']})"


@functools.cache
def _warn_fallback_once(reason: str) -> None:
    warnings.warn(f"kivi_xpu: using the reference (pure PyTorch) kernels: {reason}", RuntimeWarning, stacklevel=3)


def select(backend: str | None = None, device: str | None = None) -> Selection:
    """Chooses the kernels: ``reference`` never loads the extension; ``sycl`` raises if the extension or device is
    missing; ``auto`` falls back to the reference path with one warning. A ``device`` (or ``$KIVI_XPU_DEVICE``)
    that names no device is an error in every mode but ``reference``."""
    from .ops import reference

    choice = backend_choice(backend)
    if choice == "reference":
        return Selection("reference", reference, None, f"{BACKEND_ENV}/backend is 'reference'")
    try:
        runtime = get_runtime(device)
        if not runtime.facts["usm_system_allocations"] and not (hasattr(torch, "xpu") and torch.xpu.is_available()):
            raise RuntimeError(
                f"SYCL device {runtime.device} ({runtime.facts['name']}) cannot read host memory and this torch "
                "build has no XPU support to allocate on it: install an XPU build of torch, or pick a CPU device"
            )
    except ValueError:
        raise  # a device the user named does not exist: never silently ignored
    except (RuntimeError, ImportError) as error:
        if choice == "sycl":
            raise RuntimeError(f"backend 'sycl' requested but unavailable: {error}") from error
        _warn_fallback_once(str(error))
        return Selection("reference", reference, None, str(error))
    from .ops.sycl import SyclKernels

    return Selection("sycl", SyclKernels(runtime.device), runtime.device, f"SYCL device {runtime.facts['name']}")


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def info(backend: str | None = None, device: str | None = None) -> dict:
    """Facts for an ``info`` command; compiles the kernels (or reads them from the cache) unless the reference
    backend is chosen. Never raises for a missing extension or device: the reason is reported instead."""
    facts: dict[str, Any] = {
        "torch": torch.__version__,
        "dpctl": _version("dpctl"),
        "intel-sycl-rt": _version("intel-sycl-rt"),
        "intel-opencl-rt": _version("intel-opencl-rt"),
        "devices": available_devices(),
        "OCL_ICD_FILENAMES": os.environ.get("OCL_ICD_FILENAMES"),
        "SYCL_CACHE_DIR": os.environ.get("SYCL_CACHE_DIR"),
        "SYCL_CACHE_PERSISTENT": os.environ.get("SYCL_CACHE_PERSISTENT"),
    }
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the reason is reported in the dict
            selection = select(backend, device)
    except (ValueError, RuntimeError) as error:
        facts.update(backend="error", reason=str(error), kernels_compiled=False)
        return facts
    facts.update(backend=selection.name, reason=selection.reason, device=selection.sycl_device)
    facts["kernels_compiled"] = selection.name == "sycl"
    if selection.name == "sycl":
        runtime = get_runtime(selection.sycl_device)
        facts["device_facts"] = runtime.facts
        facts["compile_seconds"] = runtime.facts["compile_seconds"]
    return facts
