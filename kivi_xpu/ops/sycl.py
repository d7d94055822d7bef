"""Host wrappers of the SYCL kernels, with exactly the signatures and semantics of :mod:`.reference`.

The module-level functions run on the default SYCL device (``$KIVI_XPU_DEVICE``, else the first GPU, else the
first CPU device; chosen once per process); :class:`SyclKernels` binds the same ops (the four quantize/dequantize
ops and the two fused attention ops ``packed_key_scores`` / ``packed_value_combine``) to another device.
Arguments are validated by the same checks as the reference, outputs are allocated here on the input's device and
filled by ``kivi_xpu._C``, which waits for each kernel to finish.
"""

from __future__ import annotations

import functools

import torch

from .. import backend
from .checks import check_attention_args, check_dequantize_args, check_quantize_args, codes_per_byte

# packed_value_combine splits the token loop into chunks whose partial sums are added afterwards (in order), so that a
# decode step (few kv heads, one query row) still spreads over all cores / EUs. Each chunk is a work-group with a fixed
# start-up cost, so chunks are as long as possible while leaving VALUE_GROUPS_PER_UNIT work-groups per compute unit
# (load balance), and at least VALUE_CHUNK_TOKENS long (on the 2-core CPU device 1024-token chunks ran ~1.5x faster
# than 256-token ones).
VALUE_CHUNK_TOKENS = 256
VALUE_GROUPS_PER_UNIT = 4


def value_chunk_tokens(num_tokens: int, kv_heads: int, compute_units: int) -> int:
    """Chunk length for ``kv_heads`` (batch x kv heads) independent token loops of ``num_tokens`` tokens."""
    chunks = max(1, -(-VALUE_GROUPS_PER_UNIT * compute_units // max(kv_heads, 1)))
    return max(VALUE_CHUNK_TOKENS, -(-num_tokens // chunks))


class SyclKernels:
    """The ops on one SYCL device (a dpctl filter string such as ``opencl:cpu:0``)."""

    def __init__(self, device: str | None = None):
        runtime = backend.get_runtime(device)
        self._C = runtime.module
        self.device = runtime.device
        self.facts = runtime.facts
        self._compute_units = int(self.facts.get("max_compute_units", 1))  # absent from a stale build of _C

    def _check_reachable(self, tensors: dict[str, torch.Tensor]) -> None:
        """Refuses memory the SYCL device cannot dereference (the extension re-checks XPU pointers precisely)."""
        for name, t in tensors.items():
            if t.device.type == "cpu":
                if not self.facts["usm_system_allocations"]:
                    raise ValueError(
                        f"`{name}` is a CPU tensor but SYCL device {self.device} ({self.facts['name']}) cannot access "
                        "host memory: move it to that device"
                    )
            elif t.device.type != "xpu":
                raise ValueError(f"`{name}` is on {t.device}, which SYCL device {self.device} cannot access")

    def _quantize(self, launch, x, group_size, bits, meta_dtype, axis):
        check_quantize_args(x, group_size, bits, meta_dtype, axis=axis)
        self._check_reachable({"x": x})
        x = x.contiguous()
        b, h, t, d = x.shape
        per = codes_per_byte(bits)
        if axis == "tokens":  # channel-major keys
            codes_shape, meta_shape = (b, h, d, t // per), (b, h, d, t // group_size)
        else:
            codes_shape, meta_shape = (b, h, t, d // per), (b, h, t, d // group_size)
        codes = torch.empty(codes_shape, dtype=torch.uint8, device=x.device)
        scales = torch.empty(meta_shape, dtype=meta_dtype, device=x.device)
        zeros = torch.empty(meta_shape, dtype=meta_dtype, device=x.device)
        if x.numel() > 0:
            launch(self.device, x, codes, scales, zeros, group_size, bits)
        return codes, scales, zeros

    def quantize_keys(self, x: torch.Tensor, group_size: int, bits: int, meta_dtype: torch.dtype = torch.float16):
        """``x [B, H, T, D]`` -> codes uint8 ``[B, H, D, T * bits / 8]``, scales/zeros ``[B, H, D, T / G]``."""
        return self._quantize(self._C.quantize_keys, x, group_size, bits, meta_dtype, "tokens")

    def quantize_values(self, x: torch.Tensor, group_size: int, bits: int, meta_dtype: torch.dtype = torch.float16):
        """``x [B, H, T, D]`` -> codes uint8 ``[B, H, T, D * bits / 8]``, scales/zeros ``[B, H, T, D / G]``."""
        return self._quantize(self._C.quantize_values, x, group_size, bits, meta_dtype, "channels")

    def _dequantize(self, launch, codes, scales, zeros, num_tokens, group_size, bits, out_dtype, axis):
        check_dequantize_args(codes, scales, zeros, num_tokens, group_size, bits, out_dtype, axis=axis)
        self._check_reachable({"codes": codes, "scales": scales, "zeros": zeros})
        b, h = codes.shape[:2]
        head_dim = codes.shape[2] if axis == "tokens" else codes.shape[3] * codes_per_byte(bits)
        out = torch.empty((b, h, num_tokens, head_dim), dtype=out_dtype, device=codes.device)
        if out.numel() > 0:
            launch(self.device, codes, scales, zeros, out, num_tokens, group_size, bits)
        return out

    def dequantize_keys(
        self,
        codes: torch.Tensor,
        scales: torch.Tensor,
        zeros: torch.Tensor,
        num_tokens: int,
        group_size: int,
        bits: int,
        out_dtype: torch.dtype = torch.float32,
    ) -> torch.Tensor:
        """First ``num_tokens`` tokens of ``codes [B, H, D, >=N*bits/8]``, ``scales``/``zeros`` ``[B, H, D, >=N/G]``
        -> ``[B, H, N, D]`` in ``out_dtype``."""
        return self._dequantize(
            self._C.dequantize_keys, codes, scales, zeros, num_tokens, group_size, bits, out_dtype, "tokens"
        )

    def dequantize_values(
        self,
        codes: torch.Tensor,
        scales: torch.Tensor,
        zeros: torch.Tensor,
        num_tokens: int,
        group_size: int,
        bits: int,
        out_dtype: torch.dtype = torch.float32,
    ) -> torch.Tensor:
        """First ``num_tokens`` tokens of ``codes [B, H, >=N, D*bits/8]``, ``scales``/``zeros`` ``[B, H, >=N, D/G]``
        -> ``[B, H, N, D]`` in ``out_dtype``."""
        return self._dequantize(
            self._C.dequantize_values, codes, scales, zeros, num_tokens, group_size, bits, out_dtype, "channels"
        )

    def packed_key_scores(
        self,
        query: torch.Tensor,
        codes: torch.Tensor,
        scales: torch.Tensor,
        zeros: torch.Tensor,
        num_tokens: int,
        group_size: int,
        bits: int,
    ) -> torch.Tensor:
        """``query [B, Hq, L, D]`` float32 against the first ``num_tokens`` packed keys (``Hkv`` kv heads, GQA) ->
        scores ``[B, Hq, L, num_tokens]`` float32; see :func:`kivi_xpu.ops.reference.packed_key_scores`."""
        check_attention_args("query", query, codes, scales, zeros, num_tokens, group_size, bits, "tokens")
        self._check_reachable({"query": query, "codes": codes, "scales": scales, "zeros": zeros})
        query = query.contiguous()
        b, hq, length, _ = query.shape
        out = torch.empty((b, hq, length, num_tokens), dtype=torch.float32, device=query.device)
        if out.numel() > 0:
            self._C.packed_key_scores(self.device, query, codes, scales, zeros, out, num_tokens, group_size, bits)
        return out

    def packed_value_combine(
        self,
        probs: torch.Tensor,
        codes: torch.Tensor,
        scales: torch.Tensor,
        zeros: torch.Tensor,
        num_tokens: int,
        group_size: int,
        bits: int,
    ) -> torch.Tensor:
        """``probs [B, Hq, L, num_tokens]`` float32 times the first ``num_tokens`` packed values (GQA) ->
        ``[B, Hq, L, D]`` float32; see :func:`kivi_xpu.ops.reference.packed_value_combine`."""
        check_attention_args("probs", probs, codes, scales, zeros, num_tokens, group_size, bits, "channels")
        self._check_reachable({"probs": probs, "codes": codes, "scales": scales, "zeros": zeros})
        probs = probs.contiguous()
        b, hq, length, _ = probs.shape
        per = codes_per_byte(bits)
        head_dim = codes.shape[3] * per
        if num_tokens == 0 or probs.numel() == 0:
            return torch.zeros((b, hq, length, head_dim), dtype=torch.float32, device=probs.device)
        chunk_tokens = value_chunk_tokens(num_tokens, b * codes.shape[1], self._compute_units)
        chunks = -(-num_tokens // chunk_tokens)
        partial = torch.empty((b, hq, length, chunks, head_dim), dtype=torch.float32, device=probs.device)
        self._C.packed_value_combine(
            self.device, probs, codes, scales, zeros, partial, num_tokens, group_size, bits, chunk_tokens
        )
        # Chunk sums in order (deterministic).
        return partial.view(b, hq, length, head_dim) if chunks == 1 else partial.sum(dim=3)


@functools.lru_cache(maxsize=1)
def default_kernels() -> SyclKernels:
    """The ops on the default device, initialised (and the kernels compiled) on first use."""
    return SyclKernels()


def quantize_keys(x: torch.Tensor, group_size: int, bits: int, meta_dtype: torch.dtype = torch.float16):
    """See :func:`kivi_xpu.ops.reference.quantize_keys`."""
    return default_kernels().quantize_keys(x, group_size, bits, meta_dtype)


def quantize_values(x: torch.Tensor, group_size: int, bits: int, meta_dtype: torch.dtype = torch.float16):
    """See :func:`kivi_xpu.ops.reference.quantize_values`."""
    return default_kernels().quantize_values(x, group_size, bits, meta_dtype)


def dequantize_keys(
    codes: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    num_tokens: int,
    group_size: int,
    bits: int,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """See :func:`kivi_xpu.ops.reference.dequantize_keys`."""
    return default_kernels().dequantize_keys(codes, scales, zeros, num_tokens, group_size, bits, out_dtype)


def dequantize_values(
    codes: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    num_tokens: int,
    group_size: int,
    bits: int,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """See :func:`kivi_xpu.ops.reference.dequantize_values`."""
    return default_kernels().dequantize_values(codes, scales, zeros, num_tokens, group_size, bits, out_dtype)


def packed_key_scores(
    query: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    num_tokens: int,
    group_size: int,
    bits: int,
) -> torch.Tensor:
    """See :func:`kivi_xpu.ops.reference.packed_key_scores`."""
    return default_kernels().packed_key_scores(query, codes, scales, zeros, num_tokens, group_size, bits)


def packed_value_combine(
    probs: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    num_tokens: int,
    group_size: int,
    bits: int,
) -> torch.Tensor:
    """See :func:`kivi_xpu.ops.reference.packed_value_combine`."""
    return default_kernels().packed_value_combine(probs, codes, scales, zeros, num_tokens, group_size, bits)
