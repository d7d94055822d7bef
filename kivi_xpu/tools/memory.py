"""Memory a cache configuration costs: the KV bytes (the cache's own accounting, cross-checked against the tensor
storages reachable from the cache object) and the process's peak resident set during a phase."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import re
import sys
import threading
import time
import types
from dataclasses import dataclass

import torch
from transformers import PreTrainedConfig

from ..cache import KiviCache
from ..rotation import is_shared

MIB = 1 << 20


@dataclass
class KvBytes:
    held: int  # bytes of the tokens held, from the cache's accounting
    allocated: int  # bytes reserved by that accounting (spare capacity included; = held for caches without spare)
    measured: int  # distinct tensor storages reachable from the cache object

    @property
    def check(self) -> str:
        """``"ok"`` when the reachable storages equal the reserved bytes, else what disagrees."""
        if self.measured == self.allocated:
            return "ok"
        return (
            f"accounting {self.allocated / MIB:.2f} MiB reserved ({self.held / MIB:.2f} MiB held) but "
            f"{self.measured / MIB:.2f} MiB of storages reachable"
        )


def _flat_tensors(obj) -> list[torch.Tensor]:
    """Plain tensors inside ``obj``: a tensor, a tensor subclass that wraps others (quanto's QTensor), or a
    tuple/list/dict of them (HQQ's ``(codes, meta)``)."""
    if isinstance(obj, torch.Tensor):
        if type(obj) is not torch.Tensor and hasattr(obj, "__tensor_flatten__"):
            names, _ = obj.__tensor_flatten__()
            return [t for n in names for t in _flat_tensors(getattr(obj, n))]
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for item in obj for t in _flat_tensors(item)]
    if isinstance(obj, dict):
        return [t for item in obj.values() for t in _flat_tensors(item)]
    return []


def accounted_bytes(cache) -> tuple[int, int]:
    """(held, reserved) bytes from the cache's own accounting: ``memory_report()`` for a ``KiviCache``, the
    tensors the layers hold (dense states; HF quantized states and their residual) otherwise."""
    if isinstance(cache, KiviCache):
        report = cache.memory_report()
        return report.total_bytes, report.allocated_bytes
    total = 0
    for layer in cache.layers:
        # cumulative_length: the token counter tensor of a StaticCache layer (8 bytes).
        for name in ("keys", "values", "_quantized_keys", "_quantized_values", "cumulative_length"):
            total += sum(t.nbytes for t in _flat_tensors(getattr(layer, name, None)))
    return total, total


_OPAQUE = (
    str,
    bytes,
    int,
    float,
    complex,
    bool,
    type(None),
    torch.dtype,
    torch.device,
    type,
    types.ModuleType,
    types.FunctionType,
    types.BuiltinFunctionType,
    types.MethodType,
    PreTrainedConfig,
    torch.nn.Module,
)


def reachable_storage_bytes(root) -> int:
    """Bytes of the distinct tensor storages reachable from ``root`` through attributes and containers, each
    storage counted once (by device and data pointer) at its allocated size. Model configs and modules are not
    followed, nor the rotation matrices that every KIVI cache shares (:func:`kivi_xpu.rotation.is_shared`)."""
    seen, storages, stack = set(), {}, [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, _OPAQUE) or (isinstance(obj, torch.Tensor) and is_shared(obj)):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            for t in _flat_tensors(obj):
                if t.device.type != "meta":
                    storage = t.untyped_storage()
                    key = (str(t.device), storage.data_ptr())
                    storages[key] = max(storages.get(key, 0), storage.nbytes())
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        else:
            stack.extend(getattr(obj, "__dict__", {}).values())
            for slot in getattr(type(obj), "__slots__", ()):
                if hasattr(obj, slot):
                    stack.append(getattr(obj, slot))
    return sum(storages.values())


def kv_bytes(cache) -> KvBytes:
    held, allocated = accounted_bytes(cache)
    return KvBytes(held, allocated, reachable_storage_bytes(cache))


def release_freed_memory() -> None:
    """Collects garbage and returns freed heap memory to the OS (glibc ``malloc_trim``), so that the resident set
    at the start of a measurement holds no leftovers of the previous one."""
    gc.collect()
    if _libc is not None:
        _libc.malloc_trim(0)


def _load_libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim  # noqa: B018  (glibc only)
        return libc
    except (OSError, AttributeError):
        return None


_libc = _load_libc()


class PeakMemory:
    """Peak resident set of this process since the last :meth:`reset`.

    Linux: the kernel's high-water mark ``VmHWM``, reset to the current resident set by writing ``5`` to
    ``/proc/self/clear_refs`` (exact, no overhead). Elsewhere, or when that file is not writable: a thread sampling
    the resident set every millisecond with psutil (may miss peaks shorter than that). Without either, ``None``.
    """

    def __init__(self):
        self.method, self._sampler_peak, self._lock = None, 0, threading.Lock()
        if self._reset_hwm():
            self.method = "VmHWM, reset through /proc/self/clear_refs"
            return
        try:
            import psutil

            self._process = psutil.Process()
            self.method = "psutil resident set sampled every 1 ms"
            threading.Thread(target=self._sample, daemon=True).start()
        except ImportError:
            pass

    @staticmethod
    def _reset_hwm() -> bool:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            return _status_kib("VmHWM") is not None
        except OSError:
            return False

    def _sample(self) -> None:
        while True:
            time.sleep(0.001)
            with self._lock:
                self._sampler_peak = max(self._sampler_peak, self._process.memory_info().rss)

    def current(self) -> int | None:
        if self.method is None:
            return None
        if self.method.startswith("VmHWM"):
            return _status_kib("VmRSS") * 1024
        return self._process.memory_info().rss

    def reset(self) -> None:
        if self.method is None:
            return
        if self.method.startswith("VmHWM"):
            self._reset_hwm()
        else:
            with self._lock:
                self._sampler_peak = self._process.memory_info().rss

    def peak(self) -> int | None:
        if self.method is None:
            return None
        if self.method.startswith("VmHWM"):
            return _status_kib("VmHWM") * 1024
        return max(self._sampler_peak, self._process.memory_info().rss)


def _status_kib(field_name: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            match = re.search(rf"^{field_name}:\s+(\d+) kB", f.read(), re.MULTILINE)
    except OSError:
        return None
    return int(match.group(1)) if match else None
