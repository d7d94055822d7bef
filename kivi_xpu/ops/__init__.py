"""Quantization ops: the pure-PyTorch reference (:mod:`.reference`), the SYCL kernels' host wrappers
(:mod:`.sycl`, kernels in ``csrc/``), their torch.library registration (:mod:`.library`), and the shared
argument checks (:mod:`.checks`). Which implementation a cache uses is chosen by :func:`kivi_xpu.backend.select`.
"""

from __future__ import annotations

import functools


# TEMPORARY shim, replaced by the coordinator: kernel(op_name, backend_name) with this contract.
@functools.cache
def kernel(op_name: str, backend_name: str):
    """The op ``op_name`` of backend ``backend_name`` ("reference" or "sycl") as a plain function with the
    reference's signature; ``"decode_attention"`` is the composed attention of :mod:`kivi_xpu.attention`."""
    if op_name == "decode_attention":
        from ..attention import composed_decode_attention

        def decode_attention(*args):
            return composed_decode_attention(*args, backend=backend_name)

        return decode_attention
    from ..backend import select

    return getattr(select(backend_name).kernels, op_name)
