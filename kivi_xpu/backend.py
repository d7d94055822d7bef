"""Which implementation of the kernels a cache uses: the backend choice.

Backends (``backend=`` argument, else ``$KIVI_XPU_BACKEND``, else ``auto``):

* ``native``: the native CPU kernels of ``kivi_xpu._cpu`` (SIMD for the CPU's ISA, run in torch's own thread pool);
  the packed history lives in host memory;
* ``sycl``: the SYCL kernels of ``kivi_xpu._C`` on a SYCL device (``device=`` / ``$KIVI_XPU_DEVICE``, see
  :func:`kivi_xpu.runtime.select_device`): on the CPU device the packed history lives in host memory, on a GPU
  each layer's lives on that layer's device (:meth:`Selection.storage_device`);
* ``reference``: the pure-PyTorch reference kernels on the model's device;
* ``auto``: the kernels of each layer's device (the device rule, :meth:`Selection.for_device`): native on the CPU
  (else SYCL on the CPU device), SYCL on an Intel GPU (``xpu``), the reference on any other device (``cuda``,
  ``mps``); with nothing built, the reference everywhere with one warning.

A :class:`Selection` is a frozen record of strings (a cache keeps it, so it pickles and deep-copies); the ops are
looked up by its name in :mod:`kivi_xpu.ops`.
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import warnings
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from . import kernel_cache, runtime
from .runtime import DEVICE_ENV as DEVICE_ENV  # re-exported: the backend and device variables side by side
from .runtime import KERNEL_SOURCE_ENV
from .validation import environment_variable, file_variable, name_choice

BACKENDS = ("auto", "native", "sycl", "reference")
BACKEND_ENV = "KIVI_XPU_BACKEND"


def backend_choice(backend: str | None = None) -> str:
    """``backend`` argument, else ``$KIVI_XPU_BACKEND`` (empty = unset), else ``auto``; validated."""
    if backend is not None:
        return name_choice(backend, "backend", BACKENDS)
    value = environment_variable(BACKEND_ENV)
    return "auto" if value is None else name_choice(value, f"${BACKEND_ENV}", BACKENDS)


@dataclass(frozen=True)
class Selection:
    """Outcome of :func:`select`."""

    name: str  # "native", "sycl" or "reference"
    reason: str  # why this backend was chosen
    sycl_device: str | None = None  # filter string of the SYCL device (sycl only)
    device_name: str | None = None  # its name, or the ISA path of the native kernels
    requested: str = "auto"  # the backend asked for: "auto" lets the device rule (for_device) pick per layer

    @property
    def gpu(self) -> bool:
        """Whether the SYCL device chosen is a GPU (its canonical filter is ``backend:gpu:index``)."""
        return self.name == "sycl" and self.sycl_device is not None and self.sycl_device.split(":")[1] == "gpu"

    def for_device(self, layer_device) -> Selection:
        """The device rule, stated here only: the kernels that serve a layer whose keys arrive on ``layer_device``
        (keyed on those tensors, never on a process-wide default; :meth:`storage_device` of the result says where
        the layer's packed history lives):

        * ``cpu``: the native CPU kernels (the SYCL ones when native was not built, or ``backend="sycl"``);
        * ``xpu:<i>``: the SYCL kernels on that GPU, the packed history on it;
        * any other device (``cuda``, ``mps``, ``meta``, ...): the pure-PyTorch kernels on that device, with one
          warning: history and window stay there and the fused attention is composed in torch. Never a copy to the
          host.

        An explicit ``backend="native"`` / ``"sycl"`` whose kernels cannot read ``layer_device`` raises ValueError
        naming both; ``"reference"`` serves every device."""
        device = torch.device(layer_device)
        if self.name == "reference":
            return self
        if device.type == "cpu":
            return _native_or(self) if self.gpu and self.requested == "auto" else self
        if device.type == "xpu" and self.gpu:
            return self
        if self.requested == "auto":
            return _reference_for(device.type)
        served = "cpu and xpu" if self.gpu else "cpu"
        raise ValueError(
            f"`layer_device` is {device}, but backend={self.requested!r} runs its kernels on {served} tensors only: "
            "use backend='auto' (the kernels of each layer's device) or backend='reference' (any device)"
        )

    def storage_device(self, layer_device) -> torch.device:
        """Where a layer served by these kernels (a :meth:`for_device` result) keeps its packed history:
        ``layer_device`` for the reference kernels and for SYCL on a GPU (a layer on ``xpu:1`` on ``xpu:1``, a layer
        on the CPU in host memory), host memory for the native kernels and SYCL on a CPU device. The exact sinks and
        window always stay on ``layer_device``.

        A SYCL op runs on the device holding its tensors (:func:`kivi_xpu.runtime.sycl_runtime_for`), so with
        ``device_map`` or tensor parallelism each layer's history and kernels follow that layer."""
        device = torch.device(layer_device)
        if self.name == "reference" or (self.gpu and device.type == "xpu"):
            return device
        if device.type != "cpu":
            raise ValueError(f"`layer_device` is {device}: ask for_device({str(device)!r}) which kernels serve it")
        return device

    def describe(self) -> str:
        if self.name == "reference":
            return f"reference (pure PyTorch; packed history on the model's device): {self.reason}"
        if self.name == "native":
            return f"native CPU kernels ({self.device_name}, torch's thread pool)"
        return f"sycl on {self.sycl_device} ({self.device_name})"


@functools.cache
def _native_or(fallback: Selection) -> Selection:
    """The native kernels for CPU layers when the automatic choice went to a SYCL GPU; ``fallback`` if not built."""
    try:
        return _native()
    except RuntimeError:
        return fallback


@functools.cache
def _reference_for(device_type: str) -> Selection:
    reason = f"no kivi-xpu kernels read {device_type} tensors (native: cpu; SYCL: cpu, xpu)"
    if device_type != "meta":  # (meta tensors carry shapes only: nothing runs)
        warnings.warn(
            f"kivi_xpu: layers on {device_type} use the pure-PyTorch kernels on that device ({reason}); correct, "
            "not tuned",
            RuntimeWarning,
            stacklevel=4,
        )
    return Selection("reference", reason)


@functools.cache
def _warn_fallback_once(reason: str) -> None:
    warnings.warn(f"kivi_xpu: using the reference (pure PyTorch) kernels: {reason}", RuntimeWarning, stacklevel=3)


def _native() -> Selection:
    module = runtime.load_native_extension()
    isa, arithmetic = module.isa(), runtime.attention_arithmetic(module)
    return Selection("native", f"native CPU kernels ({isa}, {arithmetic} attention)", device_name=isa)


def _sycl(device: str | None) -> Selection:
    rt = runtime.sycl_runtime(device)
    if not rt.facts.usm_system_allocations and not runtime.xpu_available():
        raise RuntimeError(
            f"SYCL device {rt.device} ({rt.facts.name}) cannot read host memory and this torch build has no XPU "
            "support to allocate on it: install an XPU build of torch, or pick a CPU device"
        )
    return Selection("sycl", f"SYCL device {rt.facts.name}", rt.device, rt.facts.name)


def select(backend: str | None = None, device: str | None = None) -> Selection:
    """Chooses the kernels (see the module doc): ``reference`` loads no extension; ``native`` and ``sycl`` raise if
    theirs is missing; ``auto`` falls back with one warning. A ``device`` (or ``$KIVI_XPU_DEVICE``) that names no
    SYCL device is an error in every mode but ``reference``. The form of every argument and environment variable is
    checked in every mode (:mod:`kivi_xpu.validation`). The result records the choice (``requested``): under
    ``auto`` each layer's kernels then follow its device (:meth:`Selection.for_device`)."""
    choice = backend_choice(backend)
    return replace(_select(choice, device), requested=choice)


def _select(choice: str, device: str | None) -> Selection:
    requested, _ = runtime.requested_device(device)
    file_variable(KERNEL_SOURCE_ENV)
    if choice == "reference":
        return Selection("reference", f"{BACKEND_ENV}/backend is 'reference'")
    try:
        if choice == "native":
            return _native()
        if choice == "sycl":
            return _sycl(device)
        named = requested is not None
        if named:
            runtime.select_device(device)  # a named device must exist, whatever runs
        if named or runtime.xpu_available():
            return _sycl(device)
        try:
            return _native()
        except RuntimeError:
            return _sycl(device)
    except ValueError:
        raise  # a device the user named does not exist: never silently ignored
    except (RuntimeError, ImportError) as error:
        if choice != "auto":
            raise RuntimeError(f"backend {choice!r} requested but unavailable: {error}") from error
        _warn_fallback_once(str(error))
        return Selection("reference", str(error))


def device_rule(selection: Selection) -> dict[str, str]:
    """What :meth:`Selection.for_device` gives layers on each kind of device, in words (for ``kivi-xpu info``)."""
    anywhere = "pure-PyTorch kernels on that device"
    if selection.name == "reference":
        return {"cpu": anywhere, "xpu": anywhere, "other (cuda, mps, ...)": anywhere}
    other = (
        anywhere
        if selection.requested == "auto"
        else f"refused: backend={selection.requested!r} cannot read those tensors"
    )
    if selection.gpu:
        xpu = selection.describe()
    elif selection.requested == "auto":
        xpu = anywhere + " (no SYCL GPU selected: this torch has no XPU support, or no Level Zero GPU answered)"
    else:
        xpu = other
    return {"cpu": selection.for_device("cpu").describe(), "xpu": xpu, "other (cuda, mps, ...)": other}


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


# The variant every fp32 model uses first: `info` builds it (or loads it from the cache) to prove the compiler works.
PROBE_VARIANT = "kivi_quantize_keys<F32, F32>"


def info(backend: str | None = None, device: str | None = None) -> dict:
    """Facts for an ``info`` command; when the SYCL backend is chosen, builds :data:`PROBE_VARIANT` (or loads it
    from the kernel cache) and lists the variants the cache holds. Never raises for a missing extension or device:
    the reason is reported instead."""
    facts: dict[str, Any] = {
        "torch": torch.__version__,
        "dpctl": _version("dpctl"),
        "intel-sycl-rt": _version("intel-sycl-rt"),
        "intel-opencl-rt": _version("intel-opencl-rt"),
        "devices": runtime.sycl_devices(),
    }
    try:
        module = runtime.load_native_extension()
        facts["native_isa"] = module.isa()
        facts["native_attention_arithmetic"] = runtime.attention_arithmetic(module)
    except RuntimeError as error:
        facts["native_isa"] = None
        facts["native_reason"] = str(error)
    facts.update(
        OCL_ICD_FILENAMES=os.environ.get("OCL_ICD_FILENAMES"),
        SYCL_CACHE_DIR=os.environ.get("SYCL_CACHE_DIR"),
        SYCL_CACHE_PERSISTENT=os.environ.get("SYCL_CACHE_PERSISTENT"),
    )
    directory = runtime.prepare_environment()
    facts["cached_variants"] = [] if directory is None else kernel_cache.cached_variants(directory)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the reason is reported in the dict
            selection = select(backend, device)
    except (ValueError, RuntimeError) as error:
        facts.update(backend="error", reason=str(error), kernels_compiled=False)
        return facts
    facts.update(backend=selection.name, reason=selection.reason, device=selection.sycl_device)
    facts["device_rule"] = device_rule(selection)
    facts["kernels_compiled"] = False
    if selection.name == "sycl":
        rt = runtime.sycl_runtime(selection.sycl_device)
        facts["device_facts"] = asdict(rt.facts)
        facts["compile_seconds"] = rt.module.compile(rt.device, PROBE_VARIANT)
        facts["kernels_compiled"] = True
        facts["compiled_variants"] = runtime.compiled_kernels(rt.device)
        if directory is not None:
            facts["cached_variants"] = kernel_cache.cached_variants(directory)
    return facts
