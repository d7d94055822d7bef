"""Native CPU implementations of the ops (``kivi_xpu._cpu``, sources in ``csrc/cpu/``): SIMD code for the CPU's ISA
(AVX-512, AVX2 or a portable baseline, chosen at run time; ``$KIVI_XPU_CPU_ISA`` forces one), run in torch's own
intra-op thread pool, so they never compete with torch for the cores (size it with ``torch.set_num_threads``). They
read CPU tensors only: the device rule (:meth:`kivi_xpu.backend.Selection.for_device`) gives them only the layers on
the CPU. Arguments arrive checked (:mod:`.declarations`); the extension re-checks what it relies on."""

from __future__ import annotations

import functools

from ..runtime import load_native_extension
from .library import register_direct, register_kernel

NATIVE_OPS = (
    "quantize_keys",
    "quantize_values",
    "quantize_values_into",
    "dequantize_keys",
    "dequantize_values",
    "decode_attention",
    "append_decode_step",
    "paged_decode_attention",
)


@functools.cache
def _extension_function(op: str):
    """The extension's function of ``op`` (loaded, and the environment checked, at its first use)."""
    return getattr(load_native_extension(), op)


def _native(op: str):
    def run(*args):
        return _extension_function(op)(*args)

    run.__name__ = op
    return run


for _op in NATIVE_OPS:
    register_kernel(_op, "native")(_native(_op))


@register_direct("append_decode_step", "native")
def _direct_decode_step(key_window):
    """The extension's function itself: a steady run's decode steps call it with no Python in between (the device
    rule gives the native kernels only layers on the CPU, so the windows are host memory)."""
    return _extension_function("append_decode_step")
