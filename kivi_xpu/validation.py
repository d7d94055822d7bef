"""The one rule for bad input, for every option and every environment variable kivi-xpu reads.

* **Integers** (``bits``, ``group_size``, ``residual_length``, ``sink_tokens``, ``crop``'s count, ...) accept any
  integer ``operator.index`` takes (``int``, numpy integers, 0-d integer tensors) and are stored as ``int``; ``bool``,
  ``float`` and other types are a ``TypeError``, a value out of range a ``ValueError``.
* **Names** (``backend``, ``attention``, ``device``) must be a ``str`` (``TypeError`` otherwise, ``None`` meaning the
  default) and one of the allowed values (``ValueError`` otherwise); a SYCL ``device`` filter is
  ``backend:device_type:index`` or a part of it (``"opencl:cpu"``, ``"gpu"``), never empty.
* **Environment variables** (:data:`ENVIRONMENT`): unset and empty mean the same, the default; any other value is
  checked like the argument it stands for; a variable naming a file must name a readable regular file.
* Every error names the argument or variable, the value and what is allowed, and a bad value is an error whatever
  backend is chosen (``auto`` included): it never silently falls back.
"""

from __future__ import annotations

import operator
import os
import re

# Every environment variable kivi-xpu reads (besides XDG_CACHE_HOME and HOME for the cache root), and its meaning.
ENVIRONMENT = {
    "KIVI_XPU_BACKEND": "the `backend` of caches built without one: auto, native, sycl, reference",
    "KIVI_XPU_DEVICE": "the SYCL `device` filter of caches built without one, e.g. opencl:cpu:0",
    "KIVI_XPU_CPU_ISA": "the native kernels' instruction set: avx512_vnni, avx512, avx2, baseline (those of this CPU)",
    "KIVI_XPU_CPU_DOT": "the arithmetic of the native decode attention on 2/4-bit codes: int8 (default), fp32",
    "KIVI_XPU_KERNEL_SOURCE": "a SYCL kernel source file compiled instead of the built-in one (development)",
    "KIVI_XPU_CACHE": "the directory of kivi-xpu's caches (compiled kernels, models, texts)",
}

# One field of a dpctl filter string: a backend, a device type or an index (`*` matches any).
_FILTER_FIELD = re.compile(r"[A-Za-z0-9_*]+")


def integer(value, name: str, minimum: int | None = None) -> int:
    """``value`` as an ``int`` (anything ``operator.index`` takes, but not ``bool``), at least ``minimum``."""
    if isinstance(value, bool):
        raise TypeError(f"`{name}` must be an integer, got the bool {value!r}")
    try:
        number = operator.index(value)
    except TypeError:
        raise TypeError(f"`{name}` must be an integer, got {type(value).__name__} {value!r}") from None
    if minimum is not None and number < minimum:
        what = {0: "a non-negative integer", 1: "a positive integer"}.get(minimum, f"an integer >= {minimum}")
        raise ValueError(f"`{name}` must be {what}, got {number}")
    return number


def name_choice(value, name: str, allowed: tuple[str, ...]) -> str:
    """``value`` if it is one of the strings ``allowed``."""
    if not isinstance(value, str):
        raise TypeError(f"`{name}` must be a string, one of {allowed}, got {type(value).__name__} {value!r}")
    if value not in allowed:
        raise ValueError(f"`{name}` must be one of {allowed}, got {value!r}")
    return value


def device_filter(value, name: str) -> str:
    """``value`` if it has the form of a SYCL filter string (dpctl then says whether such a device exists)."""
    if not isinstance(value, str):
        raise TypeError(
            f"`{name}` must be a SYCL filter string such as 'opencl:cpu:0' (or None for automatic), got "
            f"{type(value).__name__} {value!r}"
        )
    fields = [field for part in value.split(",") for field in part.split(":")]
    if not all(_FILTER_FIELD.fullmatch(field) for field in fields) or len(value.split(",")[0].split(":")) > 3:
        raise ValueError(
            f"`{name}` must be a SYCL filter string backend:device_type:index or a part of it (e.g. 'opencl:cpu:0', "
            f"'opencl:cpu', 'gpu'), got {value!r}"
        )
    return value


def environment_variable(variable: str) -> str | None:
    """The value of an environment variable, None when it is unset or empty (the same for every variable)."""
    return os.environ.get(variable) or None


def file_variable(variable: str) -> str | None:
    """The path an environment variable names, which must be a readable regular file; None when unset or empty."""
    path = environment_variable(variable)
    if path is None:
        return None
    if not os.path.isfile(path) or not os.access(path, os.R_OK):
        what = "a directory" if os.path.isdir(path) else "missing" if not os.path.exists(path) else "not readable"
        raise ValueError(
            f"${variable}={path!r} must name a readable file, but it is {what} (unset it to use the default)"
        )
    return path


__all__ = ["ENVIRONMENT", "device_filter", "environment_variable", "file_variable", "integer", "name_choice"]
