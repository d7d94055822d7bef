"""Pure-PyTorch KIVI quantizer: the ground truth every SYCL kernel is tested against, and the fallback
implementation on devices without SYCL.

Quantization (asymmetric min-max, per group of ``G`` elements, in float32 arithmetic)::

    mn, mx = min(group), max(group)
    scale  = meta((mx - mn) / (2**bits - 1))      # meta() = cast to the metadata dtype (fp16 by default)
    zero   = meta(mn)
    q      = clamp(round_half_even((x - zero) / scale), 0, 2**bits - 1)      (q = 0 where scale == 0)
    x'     = q * scale + zero

The codes are computed from the *stored* (metadata-dtype) scale and zero, so that dequantization is
consistent with what is kept. Rounding is round-half-to-even (``torch.round``; ``sycl::rint`` in the kernels).

Defined behaviour for edge cases:

* constant group (``mx == mn``, or a scale that underflows the metadata dtype to 0): every code is 0 and
  the group reconstructs to ``zero`` exactly (i.e. to the constant, rounded to the metadata dtype);
* a group containing NaN or +-Inf, or whose scale/zero overflow the metadata dtype (|x| > 65504 in fp16):
  codes 0, scale and zero NaN, so the whole group dequantizes to NaN (a loud failure, never silent garbage).

Layouts (``B`` batch, ``H`` kv heads, ``T`` tokens, ``D`` head_dim, ``G`` group size, ``P = 8 // bits``
codes per byte; codes are packed little-end first: 2-bit byte = ``q0 | q1<<2 | q2<<4 | q3<<6``):

* keys, per-channel (a group is ``G`` consecutive tokens of one channel), stored channel-major so that
  kernels walk the tokens of a channel contiguously:
  ``x [B, H, T, D]`` -> ``codes uint8 [B, H, D, T/P]`` (packed along tokens: byte ``j`` of channel ``d`` holds
  tokens ``P*j .. P*j+P-1``), ``scales, zeros [B, H, D, T/G]``;
* values, per-token (a group is ``G`` consecutive channels of one token):
  ``x [B, H, T, D]`` -> ``codes uint8 [B, H, T, D/P]`` (packed along channels),
  ``scales, zeros [B, H, T, D/G]``.

The dequantize functions read only the first ``num_tokens`` tokens of the packed tensors, which may be
longer along their token axis (over-allocated storage: the last dim for keys, dim 2 for values).
"""

from __future__ import annotations

import torch

from .checks import check_attention_args, check_dequantize_args, check_quantize_args, codes_per_byte


def _quantize_groups(x: torch.Tensor, dim: int, bits: int, meta_dtype: torch.dtype):
    """Quantizes groups lying along ``dim`` of float32 ``x``. Returns (codes int32 like x, scale, zero)
    with ``scale``/``zero`` in ``meta_dtype`` and size 1 along ``dim``."""
    qmax = (1 << bits) - 1
    mn = x.amin(dim=dim, keepdim=True)
    mx = x.amax(dim=dim, keepdim=True)
    scale = ((mx - mn) / qmax).to(meta_dtype)
    zero = mn.to(meta_dtype)
    scale32, zero32 = scale.float(), zero.float()
    bad = ~(torch.isfinite(scale32) & torch.isfinite(zero32))
    positive = scale32 > 0
    q = torch.where(positive, (x - zero32) / torch.where(positive, scale32, 1.0), 0.0)
    q = torch.round(q).clamp_(0, qmax)
    q = torch.where(bad, 0.0, q).to(torch.int32)
    nan = torch.tensor(float("nan"), dtype=meta_dtype, device=x.device)
    return q, torch.where(bad, nan, scale), torch.where(bad, nan, zero)


def pack(q: torch.Tensor, dim: int, bits: int) -> torch.Tensor:
    """Packs int codes in ``[0, 2**bits)`` along ``dim`` into uint8, little-end first."""
    per = codes_per_byte(bits)
    dim = dim % q.dim()
    shape = list(q.shape)
    q = q.reshape(shape[:dim] + [shape[dim] // per, per] + shape[dim + 1 :])
    shifts = torch.arange(per, device=q.device, dtype=torch.int32) * bits
    shifts = shifts.view([per] + [1] * (q.dim() - dim - 2))
    return (q << shifts).sum(dim=dim + 1).to(torch.uint8)


def unpack(codes: torch.Tensor, dim: int, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack`: uint8 along ``dim`` -> int32 codes, ``8 // bits`` times longer along ``dim``."""
    per = codes_per_byte(bits)
    dim = dim % codes.dim()
    shifts = torch.arange(per, device=codes.device, dtype=torch.int32) * bits
    shifts = shifts.view([per] + [1] * (codes.dim() - dim - 1))
    q = (codes.to(torch.int32).unsqueeze(dim + 1) >> shifts) & ((1 << bits) - 1)
    shape = list(codes.shape)
    return q.reshape(shape[:dim] + [shape[dim] * per] + shape[dim + 1 :])


def quantize_keys(x: torch.Tensor, group_size: int, bits: int, meta_dtype: torch.dtype = torch.float16):
    """Per-channel key quantization.

    Args:
        x: ``[B, H, T, D]`` float32/float16/bfloat16, ``T`` a multiple of ``group_size``.
    Returns:
        ``codes`` uint8 ``[B, H, D, T * bits / 8]``, ``scales`` and ``zeros`` ``[B, H, D, T / G]`` in ``meta_dtype``.
    """
    check_quantize_args(x, group_size, bits, meta_dtype, axis="tokens")
    b, h, t, d = x.shape
    groups = x.float().transpose(2, 3).reshape(b, h, d, t // group_size, group_size)
    q, scale, zero = _quantize_groups(groups, 4, bits, meta_dtype)
    codes = pack(q.reshape(b, h, d, t), 3, bits)
    return codes, scale.squeeze(4).contiguous(), zero.squeeze(4).contiguous()


def quantize_values(x: torch.Tensor, group_size: int, bits: int, meta_dtype: torch.dtype = torch.float16):
    """Per-token value quantization.

    Args:
        x: ``[B, H, T, D]`` float32/float16/bfloat16, ``D`` a multiple of ``group_size``.
    Returns:
        ``codes`` uint8 ``[B, H, T, D * bits / 8]``, ``scales`` and ``zeros`` ``[B, H, T, D / G]`` in ``meta_dtype``.
    """
    check_quantize_args(x, group_size, bits, meta_dtype, axis="channels")
    b, h, t, d = x.shape
    groups = x.float().reshape(b, h, t, d // group_size, group_size)
    q, scale, zero = _quantize_groups(groups, 4, bits, meta_dtype)
    codes = pack(q.reshape(b, h, t, d), 3, bits)
    return codes, scale.squeeze(4).contiguous(), zero.squeeze(4).contiguous()


def dequantize_keys(
    codes: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    num_tokens: int,
    group_size: int,
    bits: int,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Inverse of :func:`quantize_keys` for the first ``num_tokens`` tokens. Returns ``[B, H, num_tokens, D]``."""
    check_dequantize_args(codes, scales, zeros, num_tokens, group_size, bits, out_dtype, axis="tokens")
    per = codes_per_byte(bits)
    q = unpack(codes[..., : num_tokens // per], 3, bits).float()
    n_groups = num_tokens // group_size
    scale = scales[..., :n_groups].float().repeat_interleave(group_size, dim=3)
    zero = zeros[..., :n_groups].float().repeat_interleave(group_size, dim=3)
    return (q * scale + zero).to(out_dtype).transpose(2, 3).contiguous()


def dequantize_values(
    codes: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    num_tokens: int,
    group_size: int,
    bits: int,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Inverse of :func:`quantize_values` for the first ``num_tokens`` tokens. Returns ``[B, H, num_tokens, D]``."""
    check_dequantize_args(codes, scales, zeros, num_tokens, group_size, bits, out_dtype, axis="channels")
    q = unpack(codes[:, :, :num_tokens], 3, bits).float()
    scale = scales[:, :, :num_tokens].float().repeat_interleave(group_size, dim=3)
    zero = zeros[:, :, :num_tokens].float().repeat_interleave(group_size, dim=3)
    return (q * scale + zero).to(out_dtype)


def group_queries(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``[B, Hq, L, X] -> [B, Hkv, (Hq / Hkv) * L, X]``: the query heads sharing a kv head, side by side (GQA)."""
    b, hq, length, width = x.shape
    return x.reshape(b, kv_heads, hq // kv_heads * length, width)


def packed_key_scores(
    query: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    num_tokens: int,
    group_size: int,
    bits: int,
) -> torch.Tensor:
    """Attention scores against packed per-channel keys, without keeping a dequantized copy.

    Args:
        query: ``[B, Hq, L, D]`` float32 (already scaled); ``Hq`` a multiple of the ``Hkv`` kv heads (GQA:
            query head ``h`` reads kv head ``h // (Hq / Hkv)``).
        codes, scales, zeros: packed keys as produced by :func:`quantize_keys` (possibly over-allocated).
    Returns:
        ``[B, Hq, L, num_tokens]`` float32: ``query @ dequantize_keys(...)^T``.
    """
    check_attention_args("query", query, codes, scales, zeros, num_tokens, group_size, bits, "tokens")
    b, hq, length, _ = query.shape
    keys = dequantize_keys(codes, scales, zeros, num_tokens, group_size, bits, torch.float32)
    scores = group_queries(query, codes.shape[1]) @ keys.transpose(2, 3)
    return scores.reshape(b, hq, length, num_tokens)


def packed_value_combine(
    probs: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    num_tokens: int,
    group_size: int,
    bits: int,
) -> torch.Tensor:
    """Probability-weighted sum of packed per-token values.

    Args:
        probs: ``[B, Hq, L, num_tokens]`` float32 attention weights of the quantized tokens.
        codes, scales, zeros: packed values as produced by :func:`quantize_values` (possibly over-allocated).
    Returns:
        ``[B, Hq, L, D]`` float32: ``probs @ dequantize_values(...)``.
    """
    check_attention_args("probs", probs, codes, scales, zeros, num_tokens, group_size, bits, "channels")
    b, hq, length, _ = probs.shape
    values = dequantize_values(codes, scales, zeros, num_tokens, group_size, bits, torch.float32)
    out = group_queries(probs, codes.shape[1]) @ values
    return out.reshape(b, hq, length, values.shape[3])
