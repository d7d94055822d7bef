"""The ops as first-class torch operators: ``torch.ops.kivi_xpu.{quantize,dequantize}_{keys,values}``.

One schema per op; the pure-PyTorch reference is the ``CompositeExplicitAutograd`` implementation (any
device); on CPU tensors the SYCL kernels take over when the SYCL backend is available (chosen like a cache's
default backend: ``$KIVI_XPU_BACKEND`` / ``$KIVI_XPU_DEVICE``, resolved on first call); fake (meta)
implementations give the output shapes without computing anything, for ``torch.compile`` and export.
"""

from __future__ import annotations

import functools

import torch

from . import reference
from .checks import check_dequantize_args, check_quantize_args, codes_per_byte

NAMESPACE = "kivi_xpu"
OPS = ("quantize_keys", "quantize_values", "dequantize_keys", "dequantize_values")

_lib = torch.library.Library(NAMESPACE, "DEF")
_QUANTIZE_SCHEMA = "(Tensor x, int group_size, int bits, ScalarType meta_dtype) -> (Tensor, Tensor, Tensor)"
_DEQUANTIZE_SCHEMA = (
    "(Tensor codes, Tensor scales, Tensor zeros, int num_tokens, int group_size, int bits, ScalarType out_dtype)"
    " -> Tensor"
)
for _name in OPS:
    _lib.define(_name + (_QUANTIZE_SCHEMA if _name.startswith("quantize") else _DEQUANTIZE_SCHEMA))
    _lib.impl(_name, getattr(reference, _name), "CompositeExplicitAutograd")


@functools.cache
def _cpu_kernels():
    """The kernels behind CPU tensors: SYCL on a host-accessible SYCL device when available, else the reference."""
    from ..backend import select

    selection = select()
    if selection.storage_device("cpu").type != "cpu":
        return reference  # a GPU was selected: CPU tensors stay on the reference path
    return selection.kernels


def _cpu_impl(name):
    def impl(*args):
        return getattr(_cpu_kernels(), name)(*args)

    impl.__name__ = f"{name}_cpu"
    return impl


for _name in OPS:
    _lib.impl(_name, _cpu_impl(_name), "CPU")


def _fake_quantize(axis):
    def fake(x, group_size, bits, meta_dtype):
        check_quantize_args(x, group_size, bits, meta_dtype, axis)
        b, h, t, d = x.shape
        per = codes_per_byte(bits)
        if axis == "tokens":
            codes_shape, meta_shape = (b, h, d, t // per), (b, h, d, t // group_size)
        else:
            codes_shape, meta_shape = (b, h, t, d // per), (b, h, t, d // group_size)
        codes = x.new_empty(codes_shape, dtype=torch.uint8)
        return codes, x.new_empty(meta_shape, dtype=meta_dtype), x.new_empty(meta_shape, dtype=meta_dtype)

    return fake


def _fake_dequantize(axis):
    def fake(codes, scales, zeros, num_tokens, group_size, bits, out_dtype):
        check_dequantize_args(codes, scales, zeros, num_tokens, group_size, bits, out_dtype, axis)
        b, h = codes.shape[:2]
        head_dim = codes.shape[2] if axis == "tokens" else codes.shape[3] * codes_per_byte(bits)
        return codes.new_empty((b, h, num_tokens, head_dim), dtype=out_dtype)

    return fake


torch.library.register_fake(f"{NAMESPACE}::quantize_keys", _fake_quantize("tokens"), lib=_lib)
torch.library.register_fake(f"{NAMESPACE}::quantize_values", _fake_quantize("channels"), lib=_lib)
torch.library.register_fake(f"{NAMESPACE}::dequantize_keys", _fake_dequantize("tokens"), lib=_lib)
torch.library.register_fake(f"{NAMESPACE}::dequantize_values", _fake_dequantize("channels"), lib=_lib)
