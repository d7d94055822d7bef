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

``fit="least_squares"`` (the default preset's; ``"minmax"`` is the authors') refits each valid group's line once to
its min-max codes ``q`` (the least-squares line through the points ``(q_i, x_i)``), then quantizes again::

    Sq, Sqq, Sx, Sqx = sum(q), sum(q * q), sum(x), sum(q * x)   # float32, added in group order from element 0
    det = n * Sqq - Sq * Sq                                     # n = G as float32
    s   = (n * Sqx - Sq * Sx) / det,   z = (Sx - s * Sq) / n    # each product, difference and quotient rounded
    scale, zero = meta(s), meta(z)   if det > 0 and meta(s) > 0 and both finite, else the min-max ones
    q   = clamp(round_half_even((x - zero) / scale), 0, 2**bits - 1)

The refit line minimises the squared error of the min-max codes; quantizing again to the nearest level cannot undo
that, so a group's error only grows by the rounding of the metadata. It keeps the bytes and the dequantization (a
line per group), so every reader of the codes is unchanged. Every sum is a sequence of float32 additions in element
order, so that the kernels reproduce it bit for bit.

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

from ..rotation import rotate, unrotate
from .checks import codes_per_byte
from .library import register_kernel
from .operands import KindOperands, RequestColumns, decode_args


def _codes(x: torch.Tensor, scale32: torch.Tensor, zero32: torch.Tensor, qmax: int) -> torch.Tensor:
    """Float codes of ``x`` on the line ``(scale32, zero32)`` (0 where the scale is not positive)."""
    positive = scale32 > 0
    q = torch.where(positive, (x - zero32) / torch.where(positive, scale32, 1.0), 0.0)
    return torch.round(q).clamp_(0, qmax)


def _in_order_sum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Sum along ``dim`` (keepdim) as float32 additions in element order from +0, as the kernels add."""
    total = torch.zeros_like(x.narrow(dim, 0, 1))
    for i in range(x.shape[dim]):
        total = total + x.narrow(dim, i, 1)
    return total


def _refit(x, q, dim: int, scale, zero, meta_dtype: torch.dtype):
    """The least-squares line of groups ``x`` through their codes ``q`` (module docstring), in ``meta_dtype``;
    the given ``scale``/``zero`` where that line is not usable."""
    n = torch.tensor(float(x.shape[dim]), device=x.device)
    sq, sqq = _in_order_sum(q, dim), _in_order_sum(q * q, dim)
    sx, sqx = _in_order_sum(x, dim), _in_order_sum(q * x, dim)
    det = n * sqq - sq * sq
    usable = det > 0
    s = (n * sqx - sq * sx) / torch.where(usable, det, 1.0)
    z = (sx - s * sq) / n
    s, z = s.to(meta_dtype), z.to(meta_dtype)
    s32, z32 = s.float(), z.float()
    usable &= (s32 > 0) & torch.isfinite(s32) & torch.isfinite(z32)
    return torch.where(usable, s, scale), torch.where(usable, z, zero)


def _quantize_groups(x: torch.Tensor, dim: int, bits: int, meta_dtype: torch.dtype, fit: str = "minmax"):
    """Quantizes groups lying along ``dim`` of float32 ``x``. Returns (codes int32 like x, scale, zero)
    with ``scale``/``zero`` in ``meta_dtype`` and size 1 along ``dim``."""
    qmax = (1 << bits) - 1
    mn = x.amin(dim=dim, keepdim=True)
    mx = x.amax(dim=dim, keepdim=True)
    scale = ((mx - mn) / qmax).to(meta_dtype)
    zero = mn.to(meta_dtype)
    scale32, zero32 = scale.float(), zero.float()
    bad = ~(torch.isfinite(scale32) & torch.isfinite(zero32))
    q = _codes(x, scale32, zero32, qmax)
    if fit == "least_squares":
        scale, zero = _refit(x, torch.where(bad, 0.0, q), dim, scale, zero, meta_dtype)
        q = _codes(x, scale.float(), zero.float(), qmax)
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


def _quantize_rows(x: torch.Tensor, group_size: int, bits: int, meta_dtype: torch.dtype, fit: str):
    """Quantizes float32 ``x [B, H, R, C]`` in groups of ``group_size`` along its last axis, codes packed along it:
    ``codes [B, H, R, C / P]``, ``scales``/``zeros [B, H, R, C / G]``."""
    b, h, r, c = x.shape
    q, scale, zero = _quantize_groups(x.reshape(b, h, r, c // group_size, group_size), 4, bits, meta_dtype, fit)
    return pack(q.reshape(b, h, r, c), 3, bits), scale.squeeze(4).contiguous(), zero.squeeze(4).contiguous()


@register_kernel("quantize_keys", "reference")
def quantize_keys(
    x: torch.Tensor, group_size: int, bits: int, meta_dtype: torch.dtype = torch.float16, fit: str = "minmax"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-channel key quantization of ``x [B, H, T, D]`` (float32/float16/bfloat16, ``T`` a multiple of
    ``group_size``) -> ``codes`` uint8 ``[B, H, D, T * bits / 8]``, ``scales``/``zeros [B, H, D, T / G]``; ``fit``
    one of :data:`~kivi_xpu.ops.checks.FITS`."""
    return _quantize_rows(x.float().transpose(2, 3), group_size, bits, meta_dtype, fit)  # channel-major


@register_kernel("quantize_values", "reference")
def quantize_values(
    x: torch.Tensor, group_size: int, bits: int, meta_dtype: torch.dtype = torch.float16, fit: str = "minmax"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token value quantization of ``x [B, H, T, D]`` (float32/float16/bfloat16, ``D`` a multiple of
    ``group_size``) -> ``codes`` uint8 ``[B, H, T, D * bits / 8]``, ``scales``/``zeros [B, H, T, D / G]``; ``fit``
    one of :data:`~kivi_xpu.ops.checks.FITS`."""
    return _quantize_rows(x.float(), group_size, bits, meta_dtype, fit)


@register_kernel("quantize_values_into", "reference")
def quantize_values_into(
    x: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    offset: int,
    group_size: int,
    bits: int,
    rotation: torch.Tensor | None = None,
    fit: str = "minmax",
) -> None:
    """:func:`quantize_values` (with ``fit``) of ``x [B, H, n, D]``, or of ``x @ rotation`` in float32 (``rotation``
    ``[D, D]`` float32, see :mod:`kivi_xpu.rotation`), written into token rows ``[offset, offset + n)`` of packed value
    storage ``codes [B, H, capacity, D * bits / 8]``, ``scales``/``zeros [B, H, capacity, D / G]`` (metadata in their
    dtype): how a decode step stores the token leaving the window, without temporaries in the fast kernels."""
    x = rotate(x, rotation)
    store_value_rows(quantize_values(x, group_size, bits, scales.dtype, fit), (codes, scales, zeros), offset)


def store_value_rows(parts, storage, offset: int) -> None:
    """Copies quantized values ``parts = (codes, scales, zeros)`` of ``n`` tokens into token rows ``[offset, offset
    + n)`` of value ``storage`` (the same three, with a larger capacity)."""
    for buffer, part in zip(storage, parts, strict=True):
        buffer.narrow(2, offset, part.shape[2]).copy_(part)


def composed_decode_step(quantize_into):
    """``append_decode_step`` composed of torch copies and a backend's ``quantize_values_into`` (the reference's,
    or the SYCL one, whose storage may sit on another device than the windows)."""

    def append_decode_step(
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        key_window: torch.Tensor,
        key_start: int,
        key_end: int,
        value_window: torch.Tensor,
        value_start: int,
        value_end: int,
        value_codes: torch.Tensor,
        value_scales: torch.Tensor,
        value_zeros: torch.Tensor,
        value_offset: int,
        value_leaving: int,
        value_group: int,
        value_bits: int,
        value_rotation: torch.Tensor | None = None,
        value_fit: str = "minmax",
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A layer's cache work of one decode step, in place: ``key_states``/``value_states [B, H, m, D]`` are copied
        into rows ``[end, end + m)`` of their full-precision windows ``[B, H, capacity, D]``; value window rows
        ``[value_start, value_start + value_leaving)`` (the oldest, leaving the window) are quantized as
        :func:`quantize_values_into` (rotated by ``value_rotation``, with ``value_fit``, on the storage's device) into
        token rows ``[value_offset, value_offset + value_leaving)`` of the value storage
        ``value_codes``/``value_scales``/``value_zeros``. Returns the tails attention reads, views ``key_window[:, :,
        key_start:key_end + m]`` and ``value_window[:, :, value_start:value_end + m]`` (the leaving rows included:
        attention still reads them exact)."""
        m = key_states.shape[2]
        key_window.narrow(2, key_end, m).copy_(key_states)
        value_window.narrow(2, value_end, m).copy_(value_states)
        if value_leaving:
            leaving = value_window.narrow(2, value_start, value_leaving).to(value_codes.device)
            storage = (value_codes, value_scales, value_zeros)
            quantize_into(leaving, *storage, value_offset, value_group, value_bits, value_rotation, value_fit)
        return (
            key_window.narrow(2, key_start, key_end + m - key_start),
            value_window.narrow(2, value_start, value_end + m - value_start),
        )

    return append_decode_step


append_decode_step = register_kernel("append_decode_step", "reference")(composed_decode_step(quantize_values_into))


@register_kernel("dequantize_keys", "reference")
def dequantize_keys(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, num_tokens: int, group_size: int,
                    bits: int, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:  # fmt: skip
    """Inverse of :func:`quantize_keys` for the first ``num_tokens`` tokens. Returns ``[B, H, num_tokens, D]``."""
    per = codes_per_byte(bits)
    q = unpack(codes[..., : num_tokens // per], 3, bits).float()
    n_groups = num_tokens // group_size
    scale = scales[..., :n_groups].float().repeat_interleave(group_size, dim=3)
    zero = zeros[..., :n_groups].float().repeat_interleave(group_size, dim=3)
    return (q * scale + zero).to(out_dtype).transpose(2, 3).contiguous()


@register_kernel("dequantize_values", "reference")
def dequantize_values(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, num_tokens: int, group_size: int,
                      bits: int, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:  # fmt: skip
    """Inverse of :func:`quantize_values` for the first ``num_tokens`` tokens. Returns ``[B, H, num_tokens, D]``."""
    q = unpack(codes[:, :, :num_tokens], 3, bits).float()
    scale = scales[:, :, :num_tokens].float().repeat_interleave(group_size, dim=3)
    zero = zeros[:, :, :num_tokens].float().repeat_interleave(group_size, dim=3)
    return (q * scale + zero).to(out_dtype)


def group_queries(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``[B, Hq, L, X] -> [B, Hkv, (Hq / Hkv) * L, X]``: the query heads sharing a kv head, side by side (GQA)."""
    b, hq, length, width = x.shape
    return x.reshape(b, kv_heads, hq // kv_heads * length, width)


@register_kernel("packed_key_scores", "reference")
def packed_key_scores(query: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                      num_tokens: int, group_size: int, bits: int) -> torch.Tensor:  # fmt: skip
    """Attention scores against packed per-channel keys, without keeping a dequantized copy.

    Args:
        query: ``[B, Hq, L, D]`` float32 (already scaled); ``Hq`` a multiple of the ``Hkv`` kv heads (GQA:
            query head ``h`` reads kv head ``h // (Hq / Hkv)``).
        codes, scales, zeros: packed keys as produced by :func:`quantize_keys` (possibly over-allocated).
    Returns:
        ``[B, Hq, L, num_tokens]`` float32: ``query @ dequantize_keys(...)^T``.
    """
    b, hq, length, _ = query.shape
    keys = dequantize_keys(codes, scales, zeros, num_tokens, group_size, bits, torch.float32)
    scores = group_queries(query, codes.shape[1]) @ keys.transpose(2, 3)
    return scores.reshape(b, hq, length, num_tokens)


@register_kernel("packed_value_combine", "reference")
def packed_value_combine(probs: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                         num_tokens: int, group_size: int, bits: int) -> torch.Tensor:  # fmt: skip
    """Probability-weighted sum of packed per-token values.

    Args:
        probs: ``[B, Hq, L, num_tokens]`` float32 attention weights of the quantized tokens.
        codes, scales, zeros: packed values as produced by :func:`quantize_values` (possibly over-allocated).
    Returns:
        ``[B, Hq, L, D]`` float32: ``probs @ dequantize_values(...)``.
    """
    b, hq, length, _ = probs.shape
    values = dequantize_values(codes, scales, zeros, num_tokens, group_size, bits, torch.float32)
    out = group_queries(probs, codes.shape[1]) @ values
    return out.reshape(b, hq, length, values.shape[3])


def masked_scores(scores: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """Applies a transformers mask (bool, True = attend; or additive float) to ``scores [B, Hq, L, n]``, using the
    mask's last ``n`` columns; without a mask the last ``L`` tokens are the queries themselves and attend causally."""
    if attention_mask is not None:
        mask = attention_mask[..., -scores.shape[-1] :]
        if mask.dtype == torch.bool:
            return scores.masked_fill(~mask, float("-inf"))
        return scores + mask.float()
    length, n = scores.shape[-2:]
    if length == 1:
        return scores
    causal = torch.ones(length, n, dtype=torch.bool, device=scores.device).tril(n - length)
    return scores.masked_fill(~causal, float("-inf"))


def softmax_rows(scores: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim where a fully masked row (every score -inf) gives zeros, as a padding query needs;
    a NaN or +inf score anywhere else propagates as in a dense softmax (never hidden)."""
    probs = torch.softmax(scores, dim=-1)
    fully_masked = (scores == float("-inf")).all(dim=-1, keepdim=True)
    return probs.masked_fill(fully_masked, 0.0)


def dense_attention(query, keys, values, attention_mask, scaling: float, softcap: float = 0.0) -> torch.Tensor:
    """``softmax(mask(softcap(q·kᵀ·scaling)))·v`` in fp32 with GQA: ``query [B, Hq, L, D]``, ``keys [B, Hkv, n, D]``,
    ``values [B, Hkv, n, Dv]`` -> ``[B, Hq, L, Dv]`` in query's dtype; ``softcap`` 0 means none."""
    b, hq, length, _ = query.shape
    kv_heads = keys.shape[1]
    grouped = group_queries(query.float() * scaling, kv_heads)
    scores = (grouped @ keys.float().transpose(2, 3)).reshape(b, hq, length, keys.shape[2])
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    probs = softmax_rows(masked_scores(scores, attention_mask))
    out = group_queries(probs, kv_heads) @ values.float()
    return out.reshape(b, hq, length, values.shape[3]).to(query.dtype)  # sizes given: an empty batch has no -1


@register_kernel("decode_attention", "reference")
def decode_attention(
    query: torch.Tensor,
    key_sinks: torch.Tensor,
    key_codes: torch.Tensor,
    key_scales: torch.Tensor,
    key_zeros: torch.Tensor,
    key_count: int,
    key_group: int,
    key_bits: int,
    key_tail: torch.Tensor,
    value_sinks: torch.Tensor,
    value_codes: torch.Tensor,
    value_scales: torch.Tensor,
    value_zeros: torch.Tensor,
    value_count: int,
    value_group: int,
    value_bits: int,
    value_tail: torch.Tensor,
    mask: torch.Tensor | None = None,
    scaling: float = 1.0,
    softcap: float = 0.0,
    key_rotation: torch.Tensor | None = None,
    value_rotation: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of ``query [B, Hq, L, D]`` (unscaled) over a layer's ``n`` tokens held as ``[sinks | packed | tail]``
    per kind: ``key_sinks [B, Hkv, S, D]`` exact, the first ``key_count`` tokens of the packed keys, ``key_tail
    [B, Hkv, Tk, D]`` exact (likewise values, with their own count), ``S + key_count + Tk == S + value_count + Tv``.
    ``mask``: None or a transformers mask whose last ``n`` columns apply (see :func:`masked_scores`); ``softcap`` 0
    means none. ``key_rotation`` / ``value_rotation``: ``None`` or the ``Q [D, D]`` whose ``x @ Q`` the packed codes
    hold (:mod:`kivi_xpu.rotation`). Returns ``[B, Hq, L, Dv]`` in query's dtype. The twin of every fused
    implementation: it dequantizes the history, rotates it back and attends densely in fp32."""
    device = query.device  # (sinks None and softcap None are accepted too, as by the native kernel)
    keys = [] if key_sinks is None else [key_sinks.float()]
    if key_count:
        packed = dequantize_keys(key_codes, key_scales, key_zeros, key_count, key_group, key_bits, torch.float32)
        keys.append(unrotate(packed.to(device), key_rotation))
    values = [] if value_sinks is None else [value_sinks.float()]
    if value_count:
        packed = dequantize_values(value_codes, value_scales, value_zeros, value_count, value_group, value_bits)
        values.append(unrotate(packed.to(device), value_rotation))
    keys = torch.cat(keys + [key_tail.float()], dim=2)
    values = torch.cat(values + [value_tail.float()], dim=2)
    return dense_attention(query, keys, values, mask, scaling, softcap or 0.0)


def gather_pages(kind: str, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, pages: torch.Tensor):
    """The packed pages ``pages`` (int64 block ids, in token order) of one request as one history of batch 1
    (copies). Keys (a page holds ``T/G`` key groups): codes ``[blocks, H, D, T/P]``, scales/zeros ``[blocks, H,
    T/G, D]`` (group-major) -> ``[1, H, D, n*T/P]`` and ``[1, H, D, n*T/G]``; values: codes ``[blocks, H, T,
    Dv/P]``, scales/zeros ``[blocks, H, T, Dv/G]`` -> ``[1, H, n*T, Dv/P]`` and ``[1, H, n*T, Dv/G]``."""
    codes, scales, zeros = (x.index_select(0, pages) for x in (codes, scales, zeros))
    if kind == "keys":  # tokens along the last axis
        codes = codes.permute(1, 2, 0, 3).flatten(2, 3)
        scales, zeros = (x.permute(1, 3, 0, 2).flatten(2, 3) for x in (scales, zeros))
        return tuple(x.unsqueeze(0).contiguous() for x in (codes, scales, zeros))
    return tuple(x.transpose(0, 1).flatten(1, 2).unsqueeze(0).contiguous() for x in (codes, scales, zeros))


def _request_kind(kind: str, r: RequestColumns, windows, storage, pages, page_size: int, count: int, group: int,
                  bits: int, tail_row: int, rotation) -> KindOperands:  # fmt: skip
    """One kind's operands of a request of ``paged_decode_attention`` as ``decode_attention`` takes them (batch 1):
    its sinks (the first rows of its slot of ``windows``), its ``count`` packed tokens from the first of its
    ``pages`` (``page_size`` tokens each) in the packed ``storage`` (codes, scales, zeros), its tail from row
    ``tail_row`` of its slot."""
    window = windows[r.slot : r.slot + 1]
    packed = gather_pages(kind, *storage, pages[: -(-count // page_size)])
    tail = window[:, :, tail_row : tail_row + r.length - r.sinks - count]
    return KindOperands(window[:, :, : r.sinks], *packed, count, group, bits, tail, rotation)


def composed_paged_decode_attention(decode_attention):
    """``paged_decode_attention`` as one ``decode_attention`` (of a backend) per request over its gathered pages."""

    def paged_decode_attention(
        query: torch.Tensor,
        key_windows: torch.Tensor,
        value_windows: torch.Tensor,
        key_codes: torch.Tensor,
        key_scales: torch.Tensor,
        key_zeros: torch.Tensor,
        value_codes: torch.Tensor,
        value_scales: torch.Tensor,
        value_zeros: torch.Tensor,
        block_table: torch.Tensor,
        requests: torch.Tensor,
        key_bits: int,
        value_group: int,
        value_bits: int,
        scaling: float,
        key_rotation: torch.Tensor | None = None,
        value_rotation: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Decode attention of continuous batching over KIVI pages, ``query [N, Hq, 1, D]`` (one row per request,
        unscaled) -> ``[N, Hq, 1, Dv]`` in query's dtype. Request ``i`` (row ``i`` of ``requests``, its columns
        :class:`~.operands.RequestColumns`) attends to its ``length`` tokens as
        ``decode_attention`` over ``[sinks | packed | tail]`` per kind: the sinks are rows ``[0, sinks)`` of its slot
        of ``key_windows`` / ``value_windows [slots, H, W, D]``; the packed tokens (``key_count`` / ``value_count``)
        are pages ``block_table[i, 0], block_table[i, 1], ...`` of ``T`` tokens each (key codes ``[blocks, H, D,
        T/P]``, scales/zeros ``[blocks, H, T/G, D]``: ``T/G`` key groups of ``G`` tokens per page; value codes
        ``[blocks, H, T, Dv/P]``, scales/zeros ``[blocks, H, T, Dv/value_group]``); the tail is the rest, exact, from
        rows ``key_tail_row`` / ``value_tail_row`` of its slot. Rotations as in ``decode_attention``."""
        tokens = key_codes.shape[3] * codes_per_byte(key_bits)  # per page
        key_group = tokens // key_scales.shape[2]
        key_storage, value_storage = (key_codes, key_scales, key_zeros), (value_codes, value_scales, value_zeros)
        outputs = []
        for i, row in enumerate(requests.tolist()):
            r, pages = RequestColumns(*row), block_table[i]
            keys = _request_kind("keys", r, key_windows, key_storage, pages, tokens, r.key_count, key_group, key_bits,
                                 r.key_tail_row, key_rotation)  # fmt: skip
            values = _request_kind("values", r, value_windows, value_storage, pages, tokens, r.value_count,
                                   value_group, value_bits, r.value_tail_row, value_rotation)  # fmt: skip
            outputs.append(decode_attention(query[i : i + 1], *decode_args(keys, values, None, scaling, 0.0)))
        if not outputs:
            return query.new_empty(0, query.shape[1], 1, value_windows.shape[3])
        return torch.cat(outputs)

    return paged_decode_attention


paged_decode_attention = register_kernel("paged_decode_attention", "reference")(
    composed_paged_decode_attention(decode_attention)
)
