"""Native CPU implementations of the ops (``kivi_xpu._cpu``, sources in ``csrc/cpu/``): SIMD code for the CPU's ISA
(AVX-512, AVX2 or a portable baseline, chosen at run time; ``$KIVI_XPU_CPU_ISA`` forces one), run in torch's own
intra-op thread pool, so they never compete with torch for the cores (size it with ``torch.set_num_threads``).
Arguments arrive checked (:mod:`.declarations`); the extension re-checks what it relies on."""

from __future__ import annotations

import functools

from ..runtime import load_native_extension
from .library import register_direct, register_kernel
from .reference import composed_decode_step

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


def _native(op: str):
    @functools.cache
    def resolve():
        return getattr(load_native_extension(), op)

    def run(*args):
        return resolve()(*args)

    run.__name__ = op
    return run


for _op in NATIVE_OPS:
    if _op != "append_decode_step":  # (below: not every layer's windows are host memory)
        register_kernel(_op, "native")(_native(_op))


_native_step = _native("append_decode_step")
_composed_step = composed_decode_step(_native("quantize_values_into"))


@register_kernel("append_decode_step", "native")
def append_decode_step(key_states, value_states, key_window, *args):
    """One native call when the windows are host memory; a layer on another device (its packed history is still
    host memory, see ``Selection.storage_device``) copies with torch and quantizes natively."""
    step = _native_step if key_window.device.type == "cpu" else _composed_step
    return step(key_states, value_states, key_window, *args)


@register_direct("append_decode_step", "native")
def _direct_decode_step(key_window):
    """The extension's function itself for a layer whose windows are host memory (a steady run's decode steps)."""
    return load_native_extension().append_decode_step if key_window.device.type == "cpu" else None
