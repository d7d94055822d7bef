"""Where the kernels run: the run-time environment, SYCL device discovery and extension loading.

Nothing happens at import. The first call that needs the SYCL runtime (:func:`sycl_runtime`, :func:`sycl_devices`)
prepares the environment once, before the runtime loads:

* ``OCL_ICD_FILENAMES`` -> the installed ``libintelocl.so`` (the ICD file shipped by pip points nowhere), unless set;
* ``SYCL_CACHE_PERSISTENT=1`` and ``SYCL_CACHE_DIR`` (a directory under :func:`kivi_xpu.kernel_cache.cache_root`)
  unless either is set, so kernels compile once per machine instead of once per process; the cache is checked
  against its checksums first, so a corrupted entry is rebuilt, never executed (:mod:`kivi_xpu.kernel_cache`).

A program that loads the SYCL runtime itself (``import dpctl``) before kivi-xpu does should call
:func:`prepare_environment` first. ``$KIVI_XPU_DEVICE`` (a dpctl filter string such as ``opencl:cpu:0``) names the
SYCL device; see :func:`select_device`. This module never imports :mod:`kivi_xpu.ops`.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
import json
import os
import site
import sys
import warnings
from dataclasses import dataclass, fields
from pathlib import Path
from types import ModuleType

import torch

from . import kernel_cache
from .validation import device_filter, environment_variable, file_variable

DEVICE_ENV = "KIVI_XPU_DEVICE"
KERNEL_SOURCE_ENV = "KIVI_XPU_KERNEL_SOURCE"
CPU_ISA_ENV = "KIVI_XPU_CPU_ISA"
CPU_DOT_ENV = "KIVI_XPU_CPU_DOT"


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


@functools.cache
def prepare_environment() -> Path | None:
    """Sets the variables the SYCL runtime reads when it first loads (once; values the user set are kept) and checks
    the kernel cache (see :mod:`kivi_xpu.kernel_cache`); returns the cache directory kivi-xpu manages, or None."""
    if "OCL_ICD_FILENAMES" not in os.environ:
        runtime = _find_opencl_cpu_runtime()
        if runtime is not None:
            os.environ["OCL_ICD_FILENAMES"] = runtime
    return kernel_cache.prepare()


def sycl_devices() -> list[dict[str, str]]:
    """SYCL devices visible through dpctl: ``[{"filter": "opencl:cpu:0", "name": ...}, ...]`` ([] without dpctl)."""
    prepare_environment()
    try:
        import dpctl
    except ImportError:
        return []
    return [{"filter": d.filter_string, "name": d.name} for d in dpctl.get_devices()]


def describe_devices(devices: list[dict[str, str]]) -> str:
    return ", ".join(f"{d['filter']} ({d['name']})" for d in devices) or "none"


def xpu_available() -> bool:
    """Whether this torch build can allocate on an Intel GPU (``torch.xpu``)."""
    return hasattr(torch, "xpu") and torch.xpu.is_available()


def requested_device(device: str | None = None) -> tuple[str | None, str]:
    """The SYCL device filter asked for and who asked: ``(device, "device")``, else ``($KIVI_XPU_DEVICE,
    "KIVI_XPU_DEVICE")``, else ``(None, ...)`` for automatic; the form is checked (:mod:`kivi_xpu.validation`), not
    whether such a device exists."""
    if device is not None:
        return device_filter(device, "device"), "device"
    value = environment_variable(DEVICE_ENV)
    return (None if value is None else device_filter(value, f"${DEVICE_ENV}")), DEVICE_ENV


def select_device(device: str | None = None) -> str:
    """Canonical filter string of the SYCL device to use: ``device``, else ``$KIVI_XPU_DEVICE``, else the first
    GPU when torch has XPU support, else the first CPU device. Raises ValueError naming the argument if the filter
    matches no device, RuntimeError if dpctl is missing or there is no device at all."""
    prepare_environment()
    try:
        import dpctl
    except ImportError as error:
        raise RuntimeError(f"dpctl is not installed ({error}): `pip install dpctl intel-opencl-rt`") from None
    requested, source = requested_device(device)
    if requested is not None:
        try:
            return dpctl.SyclDevice(requested).filter_string
        except Exception as error:  # dpctl raises SyclDeviceCreationError / TypeError for bad filters
            available = describe_devices(sycl_devices())
            raise ValueError(
                f"`{source}`={requested!r} matches no SYCL device ({error}); available: {available}"
            ) from None
    # A GPU only helps when torch can allocate on it (an XPU build of torch); otherwise the CPU device.
    preferred = ("gpu", "cpu") if xpu_available() else ("cpu", "gpu")
    devices = dpctl.get_devices()
    for wanted in preferred:
        for d in devices:
            if d.device_type.name == wanted:
                return d.filter_string
    raise RuntimeError(f"no SYCL GPU or CPU device found; available: {describe_devices(sycl_devices())}")


@dataclass(frozen=True)
class DeviceFacts:
    """What ``kivi_xpu._C.init`` reports about one SYCL device (see csrc/kivi_ext.cpp)."""

    filter: str  # canonical filter string, e.g. "opencl:cpu:0"
    name: str
    backend: str  # "opencl", "level_zero", ...
    device_type: str  # "cpu", "gpu", ...
    driver_version: str
    max_work_group_size: int
    max_compute_units: int
    sub_group_sizes: tuple[int, ...]
    usm_system_allocations: bool  # the device can dereference ordinary host memory (CPU tensors)
    fp16: bool
    fp64: bool
    build_options: tuple[str, ...]
    variants: int  # kernel variants the table lists; each compiles when first launched

    @classmethod
    def from_dict(cls, facts: dict) -> DeviceFacts:
        values = {f.name: facts[f.name] for f in fields(cls)}
        values["sub_group_sizes"] = tuple(values["sub_group_sizes"])
        values["build_options"] = tuple(values["build_options"])
        return cls(**values)


@dataclass(frozen=True)
class SyclRuntime:
    """The SYCL extension initialised for one device: ``module`` is ``kivi_xpu._C``, ``device`` its filter."""

    module: ModuleType
    device: str
    facts: DeviceFacts


def reinstall_command() -> str:
    """The one command that rebuilds the extensions against the torch installed now: from the source directory of an
    in-place build, else from the directory pip installed the package from (its ``direct_url.json``), else from
    the package's source distribution."""
    source = Path(__file__).resolve().parents[1]
    if (source / "setup.py").is_file() and (source / "csrc").is_dir():
        return f"pip install --no-deps --force-reinstall -e {source}"
    try:
        origin = json.loads(importlib.metadata.distribution("kivi-xpu").read_text("direct_url.json") or "{}")
    except (importlib.metadata.PackageNotFoundError, ValueError):
        origin = {}
    url = origin.get("url", "")
    if url.startswith("file://") and "dir_info" in origin:
        editable = "-e " if origin["dir_info"].get("editable") else ""
        return f"pip install --no-deps --force-reinstall {editable}{url[len('file://') :]}"
    return "pip install --no-deps --force-reinstall <kivi-xpu's source directory>"  # (not published on PyPI)


def build_mismatch(built: dict | None, torch_version: str, cxx11_abi: bool) -> str | None:
    """Why extensions built with ``built`` (kivi_xpu/_build_info.py as a dict, None when absent) cannot load into
    this torch, or None. Releases are compared without their local label (``2.13.0+cpu`` and ``2.13.0+xpu`` share
    the C++ API), and the C++ ABI flag."""
    if built is None:
        return "kivi_xpu/_build_info.py is missing (the package was not built by its setup.py)"
    public = torch_version.split("+", 1)[0]
    if built["TORCH_VERSION"].split("+", 1)[0] != public:
        return f"it was built against torch {built['TORCH_VERSION']}, but torch {torch_version} is installed"
    if built["CXX11_ABI"] != cxx11_abi:
        return f"it was built with _GLIBCXX_USE_CXX11_ABI={int(built['CXX11_ABI'])}, torch uses {int(cxx11_abi)}"
    return None


def build_info() -> dict | None:
    """kivi_xpu/_build_info.py as a dict (TORCH_VERSION, CXX11_ABI, SYCL), None when the package has none."""
    try:
        module = importlib.import_module("kivi_xpu._build_info")
    except ImportError:
        return None
    return {name: getattr(module, name) for name in ("TORCH_VERSION", "CXX11_ABI", "SYCL")}


def _import_extension(name: str, what: str) -> ModuleType:
    """Imports ``kivi_xpu.<name>`` after checking it was built for this torch; RuntimeError saying what is wrong and
    the one command that fixes it. Cheap once loaded (called per op for XPU tensors): the fixing command, which
    may read package metadata, is only worked out for an error."""
    problem = build_mismatch(build_info(), torch.__version__, bool(torch._C._GLIBCXX_USE_CXX11_ABI))
    if problem is not None and importlib.util.find_spec(f"kivi_xpu.{name}") is not None:
        raise RuntimeError(
            f"the {what} kivi_xpu.{name} cannot be loaded: {problem}. Rebuild it with `{reinstall_command()}`"
        )
    try:
        return importlib.import_module(f"kivi_xpu.{name}")
    except ImportError as error:
        fix = reinstall_command()
        if "libsycl" in str(error):
            fix = 'pip install "intel-sycl-rt>=2025.3"'
        elif name == "_C" and (build_info() or {}).get("SYCL") is False:
            error = f"{error}; the package was built with KIVI_XPU_NO_SYCL=1"
        raise RuntimeError(f"the {what} kivi_xpu.{name} is not available ({error}); fix: `{fix}`") from None


def load_sycl_extension() -> ModuleType:
    """Imports ``kivi_xpu._C``; RuntimeError with the reason and the fixing command if it was not built (or built
    for another torch) or cannot load."""
    prepare_environment()
    return _import_extension("_C", "SYCL extension")


def attention_arithmetic(module: ModuleType) -> str:
    """The arithmetic of the native decode attention on packed 2/4-bit codes now: ``module.dot()`` ("int8" or
    "fp32"), except on the baseline ISA, which only has fp32."""
    return "fp32" if module.isa() == "baseline" else str(module.dot())


def load_native_extension() -> ModuleType:
    """Imports ``kivi_xpu._cpu`` (native CPU kernels); RuntimeError with the reason and the fixing command if it was
    not built (or built for another torch), ValueError if ``$KIVI_XPU_CPU_ISA`` names an instruction set this CPU
    lacks or ``$KIVI_XPU_CPU_DOT`` an unknown arithmetic."""
    module = _import_extension("_cpu", "native CPU extension")
    isa = environment_variable(CPU_ISA_ENV)
    if isa is not None and isa not in module.available_isas():
        raise ValueError(
            f"`${CPU_ISA_ENV}` must be one of the instruction sets of this CPU {tuple(module.available_isas())} "
            f"(known: avx512_vnni, avx512, avx2, baseline), got {isa!r}"
        )
    dot = environment_variable(CPU_DOT_ENV)
    if dot is not None and dot not in ("int8", "fp32"):
        raise ValueError(f"`${CPU_DOT_ENV}` must be one of ('int8', 'fp32'), got {dot!r}")
    return module


def _record_compiled(filter_string: str, names: tuple[str, ...], seconds: float) -> None:
    """Called by ``kivi_xpu._C`` after every kernel build: vouches for the files the SYCL runtime just wrote."""
    cache_directory = prepare_environment()
    if cache_directory is None:
        return
    try:
        kernel_cache.record(cache_directory, [f"{filter_string} {name}" for name in names])
    except OSError as error:
        warnings.warn(f"kivi_xpu: recording the SYCL kernel cache failed ({error})", RuntimeWarning, stacklevel=2)


@functools.cache
def _runtime_for(filter_string: str) -> SyclRuntime:
    module = load_sycl_extension()
    file_variable(KERNEL_SOURCE_ENV)  # a bad path is a clear error here, not a C++ stream failure
    module.set_compile_hook(_record_compiled)
    facts = DeviceFacts.from_dict(dict(module.init(filter_string)))
    return SyclRuntime(module, filter_string, facts)


def compiled_kernels(device: str) -> dict[str, float]:
    """``{template-id: build seconds}`` of the kernel variants this process compiled (or loaded from the persistent
    cache) for SYCL device ``device`` so far; {} when its runtime was never initialised."""
    if _runtime_for.cache_info().currsize == 0 or "kivi_xpu._C" not in sys.modules:
        return {}
    module = sys.modules["kivi_xpu._C"]
    try:
        return dict(module.compiled(device))
    except ValueError:  # not initialised
        return {}


def sycl_runtime(device: str | None = None) -> SyclRuntime:
    """The extension initialised for ``device`` (see :func:`select_device`); each kernel variant compiles when a launch
    first needs it (one progress line on stderr while a build takes longer than a persistent-cache hit)."""
    load_sycl_extension()  # report a missing extension before looking for devices
    return _runtime_for(select_device(device))


@functools.cache
def host_sycl_runtime() -> SyclRuntime:
    """The SYCL device that runs kernels on CPU tensors: ``$KIVI_XPU_DEVICE`` when it can read host memory, else
    the first SYCL CPU device."""
    chosen = sycl_runtime()
    if chosen.facts.usm_system_allocations:
        return chosen
    for d in sycl_devices():
        if d["filter"].split(":")[1] == "cpu":
            return sycl_runtime(d["filter"])
    raise RuntimeError(
        f"no SYCL device can read host memory (CPU tensors); available: {describe_devices(sycl_devices())}"
    )


def gpu_filter(device: torch.device) -> str:
    """The SYCL device holding torch's ``xpu:<i>`` tensors: ``level_zero:gpu:<i>`` (torch numbers its XPU devices
    as the Level Zero GPUs the SYCL runtime lists; ``kivi_xpu._C`` checks every pointer against its queue's device,
    so a mismatch is an error, never a silent copy). ``xpu`` without an index is the current XPU device."""
    if device.type != "xpu":
        raise ValueError(f"`device` must be an xpu device, got {device}")
    index = device.index if device.index is not None else torch.xpu.current_device()
    return f"level_zero:gpu:{index}"


@functools.cache
def _gpu_runtime(filter_string: str, device: str) -> SyclRuntime:
    try:
        return sycl_runtime(filter_string)
    except ValueError:
        raise ValueError(
            f"tensors on {device} are served by the SYCL device {filter_string!r}, which does not exist; available: "
            f"{describe_devices(sycl_devices())}"
        ) from None


def sycl_runtime_for(device: torch.device) -> SyclRuntime:
    """The SYCL device (and so the in-order queue) that serves tensors on ``device``: the host device for CPU
    tensors (:func:`host_sycl_runtime`), the Level Zero GPU of the same index for ``xpu:<i>`` tensors
    (:func:`gpu_filter`), each initialised once. Where tensors live is decided by
    :meth:`kivi_xpu.backend.Selection.storage_device`."""
    if device.type == "cpu":
        return host_sycl_runtime()
    if device.type == "xpu":
        return _gpu_runtime(gpu_filter(device), str(device))
    raise ValueError(f"tensors on {device} cannot be served by a SYCL device (expected cpu or xpu tensors)")
