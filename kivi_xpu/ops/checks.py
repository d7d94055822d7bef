"""Argument validation shared by every implementation of the quantization ops.

Each check raises a ``ValueError`` / ``TypeError`` that names the offending argument and the allowed values,
so that bad input never reaches a kernel (where it could read out of bounds) and never produces silent garbage.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..validation import integer

SUPPORTED_BITS = (2, 4, 8)
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
META_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _names(dtypes) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


def codes_per_byte(bits: int) -> int:
    """How many quantized codes one uint8 holds (4 for 2-bit, 2 for 4-bit, 1 for 8-bit)."""
    return 8 // bits


def check_bits(bits, name: str = "bits") -> int:
    """``bits`` as an int (any integer type, see :mod:`kivi_xpu.validation`) if it is one of SUPPORTED_BITS."""
    bits = integer(bits, name)
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"`{name}` must be one of {SUPPORTED_BITS}, got {bits!r}")
    return bits


def check_group_size(group_size, bits: int, name: str = "group_size") -> int:
    """``group_size`` as an int if it is a positive whole number of packed bytes (so groups never share a byte)."""
    group_size = integer(group_size, name, minimum=1)
    per = codes_per_byte(bits)
    if group_size % per != 0:
        raise ValueError(
            f"`{name}` must be a multiple of {per} for {bits}-bit codes (whole bytes per group), got {group_size}"
        )
    return group_size


def check_float_tensor(t, name: str, rank: int = 4, dtypes=FLOAT_DTYPES) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"`{name}` must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != rank:
        raise ValueError(f"`{name}` must have rank {rank} [batch, heads, tokens, head_dim], got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise TypeError(f"`{name}` must have dtype in ({_names(dtypes)}), got {t.dtype}")


def check_meta_dtype(meta_dtype, name: str = "meta_dtype") -> None:
    if isinstance(meta_dtype, str):
        raise TypeError(
            f"`{name}` must be a torch.dtype, one of ({', '.join(map(str, META_DTYPES))}), got the string "
            f"{meta_dtype!r} (names are accepted only in generate's cache_config)"
        )
    if not isinstance(meta_dtype, torch.dtype):
        raise TypeError(f"`{name}` must be a torch.dtype, one of ({_names(META_DTYPES)}), got {meta_dtype!r}")
    if meta_dtype not in META_DTYPES:
        raise ValueError(f"`{name}` must be one of ({_names(META_DTYPES)}), got {meta_dtype!r}")


def check_quantize_args(x: torch.Tensor, group_size: int, bits: int, meta_dtype, axis: str) -> None:
    """Checks for ``quantize_keys`` (axis='tokens') and ``quantize_values`` (axis='channels')."""
    check_float_tensor(x, "x")
    check_bits(bits)
    check_group_size(group_size, bits)
    check_meta_dtype(meta_dtype)
    dim = 2 if axis == "tokens" else 3
    if x.shape[dim] % group_size != 0:
        what = "number of tokens x.shape[2]" if axis == "tokens" else "head_dim x.shape[3]"
        raise ValueError(f"`group_size` ({group_size}) must divide the {what} ({x.shape[dim]})")


def check_dequantize_args(
    codes: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    num_tokens: int,
    group_size: int,
    bits: int,
    out_dtype,
    axis: str,
) -> None:
    """Checks for ``dequantize_keys`` (axis='tokens') and ``dequantize_values`` (axis='channels').

    The packed buffers may be longer along the token axis than ``num_tokens`` (over-allocated storage);
    only their first ``num_tokens`` tokens are read.
    """
    check_bits(bits)
    check_group_size(group_size, bits)
    check_float_tensor(codes, "codes", dtypes=(torch.uint8,))
    check_float_tensor(scales, "scales", dtypes=META_DTYPES)
    check_float_tensor(zeros, "zeros", dtypes=META_DTYPES)
    if out_dtype not in FLOAT_DTYPES:
        raise ValueError(f"`out_dtype` must be one of ({_names(FLOAT_DTYPES)}), got {out_dtype!r}")
    if scales.dtype != zeros.dtype:
        raise TypeError(f"`scales` and `zeros` must share a dtype, got {scales.dtype} and {zeros.dtype}")
    if scales.shape != zeros.shape:
        raise ValueError(
            f"`scales` and `zeros` must have the same shape, got {tuple(scales.shape)} and {tuple(zeros.shape)}"
        )
    for t, name in ((codes, "codes"), (scales, "scales"), (zeros, "zeros")):
        if t.device != codes.device:
            raise ValueError(f"`{name}` is on {t.device} but `codes` is on {codes.device}: all must share a device")
        if not t.is_contiguous():
            raise ValueError(f"`{name}` must be contiguous (packed storage is laid out densely)")
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
        raise ValueError(f"`num_tokens` must be a non-negative integer, got {num_tokens!r}")
    per = codes_per_byte(bits)
    b, h = codes.shape[:2]
    if scales.shape[:2] != (b, h):
        raise ValueError(f"`scales` batch/heads {tuple(scales.shape[:2])} do not match `codes` batch/heads {(b, h)}")
    if axis == "tokens":
        if num_tokens % group_size != 0:
            raise ValueError(f"`num_tokens` ({num_tokens}) must be a multiple of `group_size` ({group_size}) for keys")
        head_dim = codes.shape[2]  # keys are channel-major: [B, H, D, T/P]
        need_rows, need_groups = num_tokens // per, num_tokens // group_size
        if scales.shape[2] != head_dim:
            raise ValueError(f"`scales` dim 2 ({scales.shape[2]}) must equal head_dim {head_dim} (per-channel keys)")
        if codes.shape[3] < need_rows or scales.shape[3] < need_groups:
            raise ValueError(
                f"`num_tokens` ({num_tokens}) exceeds the stored tokens: codes hold {codes.shape[3] * per}, "
                f"scales hold {scales.shape[3] * group_size}"
            )
    else:
        head_dim = codes.shape[3] * per
        if head_dim % group_size != 0:
            raise ValueError(f"`group_size` ({group_size}) must divide head_dim ({head_dim}) for values")
        if scales.shape[3] != head_dim // group_size:
            raise ValueError(
                f"`scales` last dim {scales.shape[3]} must equal head_dim / group_size = {head_dim // group_size}"
            )
        if codes.shape[2] < num_tokens or scales.shape[2] < num_tokens:
            raise ValueError(
                f"`num_tokens` ({num_tokens}) exceeds the stored tokens: codes hold {codes.shape[2]}, "
                f"scales hold {scales.shape[2]}"
            )


def check_quantize_into_args(
    x: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    offset: int,
    group_size: int,
    bits: int,
    rotation: torch.Tensor | None = None,
) -> None:
    """Checks for ``quantize_values_into``: ``x [B, H, n, D]`` (or ``x @ rotation``, ``rotation`` ``None`` or float32
    ``[D, D]`` on ``x``'s device) goes to token rows ``[offset, offset + n)`` of packed value storage ``codes [B, H,
    capacity, D/P]``, ``scales``/``zeros [B, H, capacity, D/G]`` (their dtype is the metadata dtype)."""
    check_quantize_args(x, group_size, bits, scales.dtype if isinstance(scales, torch.Tensor) else None, "channels")
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
        raise ValueError(f"`offset` must be a non-negative integer, got {offset!r}")
    check_dequantize_args(codes, scales, zeros, 0, group_size, bits, x.dtype, "channels")
    b, h, n, d = x.shape
    expected = (b, h, codes.shape[2], d // codes_per_byte(bits))
    if tuple(codes.shape) != expected:
        raise ValueError(
            f"`codes` must have shape {expected} (batch, heads, capacity, D/P) for `x` of shape "
            f"{tuple(x.shape)}, got {tuple(codes.shape)}"
        )
    if scales.shape[2] != codes.shape[2]:
        raise ValueError(f"`scales` capacity ({scales.shape[2]}) must equal `codes` capacity ({codes.shape[2]})")
    if x.device != codes.device:
        raise ValueError(f"`x` is on {x.device} but `codes` is on {codes.device}: all must share a device")
    if offset + n > codes.shape[2]:
        raise ValueError(f"`offset` + tokens ({offset} + {n}) exceeds the storage capacity ({codes.shape[2]})")
    check_rotation(rotation, "rotation", d, x.device, owner="x")


def check_decode_step_args(
    key_states,
    value_states,
    key_window,
    key_start,
    key_end,
    value_window,
    value_start,
    value_end,
    value_codes,
    value_scales,
    value_zeros,
    value_offset,
    value_leaving,
    value_group,
    value_bits,
    value_rotation=None,
) -> None:
    """Checks for ``append_decode_step``: each kind's states ``[B, H, m, D]`` fit its window ``[B, H, capacity, D]``
    (same batch, heads, head_dim, dtype and device; ``0 <= start <= end``, ``end + m <= capacity``), and the value
    rows leaving the window go to the value storage as for ``quantize_values_into``."""
    kinds = (
        ("key", key_states, key_window, key_start, key_end),
        ("value", value_states, value_window, value_start, value_end),
    )
    for kind, states, window, start, end in kinds:
        check_float_tensor(states, f"{kind}_states")
        check_float_tensor(window, f"{kind}_window")
        s, w = states.shape, window.shape
        if (s[0], s[1], s[3]) != (w[0], w[1], w[3]) or states.dtype != window.dtype or states.device != window.device:
            raise ValueError(
                f"`{kind}_states` {tuple(s)} {states.dtype} on {states.device} must match `{kind}_window` {tuple(w)} "
                f"{window.dtype} on {window.device} in batch, heads, head_dim, dtype and device"
            )
        if not window.is_contiguous():
            raise ValueError(f"`{kind}_window` must be contiguous (a window buffer)")
        start, end = integer(start, f"{kind}_start", minimum=0), integer(end, f"{kind}_end", minimum=0)
        if start > end or end + s[2] > w[2]:
            raise ValueError(
                f"`{kind}_start` ({start}) <= `{kind}_end` ({end}) and `{kind}_end` + new tokens ({s[2]}) <= the "
                f"window's capacity ({w[2]}) must hold"
            )
    if value_states.shape[2] != key_states.shape[2]:
        raise ValueError(
            f"`value_states` must hold as many tokens as `key_states` ({key_states.shape[2]}), got "
            f"{value_states.shape[2]}"
        )
    leaving = integer(value_leaving, "value_leaving", minimum=0)
    if value_start + leaving > value_end + value_states.shape[2]:
        raise ValueError(
            f"`value_leaving` ({leaving}) must not exceed the value window's rows after the append "
            f"({value_end + value_states.shape[2] - value_start})"
        )
    rows = value_window.narrow(2, value_start, leaving)
    if isinstance(value_codes, torch.Tensor) and rows.device != value_codes.device:
        rows = torch.empty_like(rows, device=value_codes.device)  # (the op moves the leaving rows to the storage)
    check_quantize_into_args(
        rows, value_codes, value_scales, value_zeros, value_offset, value_group, value_bits, value_rotation
    )


def check_attention_args(
    name: str,
    query: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    num_tokens: int,
    group_size: int,
    bits: int,
    axis: str,
) -> None:
    """Checks for ``packed_key_scores`` (``name='query'``, axis='tokens') and ``packed_value_combine``
    (``name='probs'``, axis='channels'): the packed arguments as for dequantization, plus the dense operand."""
    check_dequantize_args(codes, scales, zeros, num_tokens, group_size, bits, torch.float32, axis)
    check_float_tensor(query, name, dtypes=(torch.float32,))
    if query.device != codes.device:
        raise ValueError(f"`{name}` is on {query.device} but `codes` is on {codes.device}: all must share a device")
    b, kv_heads = codes.shape[:2]
    if kv_heads == 0:
        raise ValueError(f"`codes` must hold at least one kv head, got shape {tuple(codes.shape)}")
    if query.shape[0] != b or query.shape[1] % kv_heads != 0:
        raise ValueError(
            f"`{name}` shape {tuple(query.shape)} must be [batch={b}, a multiple of the {kv_heads} kv heads, ...]"
        )
    if axis == "tokens" and query.shape[3] != codes.shape[2]:
        raise ValueError(f"`query` head_dim {query.shape[3]} does not match the keys' head_dim {codes.shape[2]}")
    if axis == "channels" and query.shape[3] != num_tokens:
        raise ValueError(f"`probs` last dim {query.shape[3]} must equal `num_tokens` ({num_tokens})")


class KindOperands(NamedTuple):
    """One kind (keys or values) of a ``decode_attention`` call, its tokens in position order: ``sinks [B, Hkv, S, D]``
    exact, the first ``count`` tokens of the packed ``codes``/``scales``/``zeros`` (``group`` size, ``bits``), then
    ``tail [B, Hkv, T, D]`` exact; ``rotation``: ``None``, or the ``Q [D, D]`` float32 whose ``x @ Q`` the codes hold
    (:mod:`kivi_xpu.rotation`). The op takes the first eight in this order, the rotations last (``packed(...)``)."""

    sinks: torch.Tensor
    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    count: int
    group: int
    bits: int
    tail: torch.Tensor
    rotation: torch.Tensor | None = None

    # These two build the tuple with tuple.__new__ on the fields in order, half the cost of the named constructor:
    # every layer takes them at every decode step.
    def with_tail(self, tail: torch.Tensor | None) -> KindOperands:
        """The same operands with another ``tail``."""
        return _new_tuple(KindOperands, (*self[:7], tail, self[8]))

    def with_count(self, count: int, rotation: torch.Tensor | None) -> KindOperands:
        """The same operands with ``count`` packed tokens and ``rotation``."""
        return _new_tuple(KindOperands, (*self[:4], count, self[5], self[6], self[7], rotation))


_new_tuple = tuple.__new__


def decode_args(keys: KindOperands, values: KindOperands, mask, scaling: float, softcap: float) -> tuple:
    """The flat arguments of ``decode_attention`` after ``query``, the inverse of :func:`split_decode_args`."""
    return (*keys[:8], *values[:8], mask, scaling, softcap, keys.rotation, values.rotation)


def split_decode_args(args: tuple) -> tuple:
    """``decode_attention``'s arguments after ``query`` -> ``(keys, values, mask, scaling, softcap)`` with ``keys``
    and ``values`` as :class:`KindOperands` (the op's schema is flat; its parts have names here)."""
    key_rotation, value_rotation = (*args[19:21], None, None)[:2]
    keys, values = KindOperands(*args[:8], key_rotation), KindOperands(*args[8:16], value_rotation)
    return keys, values, *args[16:19]


def check_rotation(rotation, name: str, head_dim: int, device, owner: str = "query") -> None:
    """``None``, or a float32 ``[head_dim, head_dim]`` tensor on ``device`` (that of the argument ``owner``)."""
    if rotation is None:
        return
    if not isinstance(rotation, torch.Tensor):
        raise TypeError(f"`{name}` must be None or a torch.Tensor, got {type(rotation).__name__}")
    if rotation.dtype != torch.float32 or tuple(rotation.shape) != (head_dim, head_dim):
        raise ValueError(
            f"`{name}` must be a float32 [{head_dim}, {head_dim}] matrix, got {rotation.dtype} {tuple(rotation.shape)}"
        )
    if rotation.device != device:
        raise ValueError(f"`{name}` is on {rotation.device} but `{owner}` is on {device}")


def check_decode_args(query, *args) -> None:
    """Checks for ``decode_attention``: each packed operand as for dequantization, the exact parts and the query
    consistent with it (batch, kv heads, head_dims, dtypes, devices), equal token counts for keys and values, and a
    mask of shape ``[B or 1, 1 or Hq, L, >= n]``."""
    keys, values, mask, scaling, softcap = split_decode_args(args)
    check_float_tensor(query, "query")
    check_dequantize_args(
        keys.codes, keys.scales, keys.zeros, keys.count, keys.group, keys.bits, torch.float32, "tokens"
    )
    check_dequantize_args(
        values.codes, values.scales, values.zeros, values.count, values.group, values.bits, torch.float32, "channels"
    )
    key_codes, value_codes, value_bits = keys.codes, values.codes, values.bits
    b, kv_heads, head_dim = key_codes.shape[0], key_codes.shape[1], key_codes.shape[2]
    value_dim = value_codes.shape[3] * codes_per_byte(value_bits)
    if kv_heads == 0:
        raise ValueError(f"`key_codes` must hold at least one kv head, got shape {tuple(key_codes.shape)}")
    if query.shape[0] != b or query.shape[1] % kv_heads != 0 or query.shape[3] != head_dim:
        raise ValueError(
            f"`query` shape {tuple(query.shape)} must be [batch={b}, a multiple of the {kv_heads} kv heads, L, "
            f"head_dim={head_dim}]"
        )
    if tuple(value_codes.shape[:2]) != (b, kv_heads):
        raise ValueError(f"`value_codes` batch/heads {tuple(value_codes.shape[:2])} must be {(b, kv_heads)}")
    for name, t, width in (
        ("key_sinks", keys.sinks, head_dim),
        ("key_tail", keys.tail, head_dim),
        ("value_sinks", values.sinks, value_dim),
        ("value_tail", values.tail, value_dim),
    ):
        check_float_tensor(t, name)
        if tuple(t.shape[:2]) != (b, kv_heads) or t.shape[3] != width:
            raise ValueError(f"`{name}` shape {tuple(t.shape)} must be [{b}, {kv_heads}, tokens, {width}]")
        if t.dtype != keys.tail.dtype or t.device != query.device:
            raise ValueError(
                f"`{name}` ({t.dtype} on {t.device}) must share the dtype of `key_tail` ({keys.tail.dtype}) and the "
                f"device of `query` ({query.device})"
            )
        if t.stride(3) != 1 and t.shape[3] > 1:
            raise ValueError(f"`{name}` must be contiguous along head_dim (stride 1), got strides {t.stride()}")
    if keys.sinks.shape[2] != values.sinks.shape[2]:
        raise ValueError(f"`key_sinks` ({keys.sinks.shape[2]}) and `value_sinks` ({values.sinks.shape[2]}) differ")
    n = keys.count + keys.tail.shape[2]
    if values.count + values.tail.shape[2] != n:
        raise ValueError(
            f"keys hold {n} tokens after the sinks (key_count {keys.count} + key_tail {keys.tail.shape[2]}) but values "
            f"hold {values.count + values.tail.shape[2]} (value_count {values.count} + value_tail "
            f"{values.tail.shape[2]})"
        )
    n += keys.sinks.shape[2]
    if mask is not None:
        if not isinstance(mask, torch.Tensor) or mask.dim() != 4:
            raise ValueError(f"`mask` must be None or a rank-4 tensor [B, 1 or Hq, L, >= n], got {mask!r:.80}")
        if mask.dtype != torch.bool and mask.dtype not in FLOAT_DTYPES:
            raise TypeError(f"`mask` must be bool (True = attend) or float (additive), got {mask.dtype}")
        hq, length = query.shape[1], query.shape[2]
        if mask.shape[0] not in (1, b) or mask.shape[1] not in (1, hq) or mask.shape[2] != length or mask.shape[3] < n:
            raise ValueError(f"`mask` shape {tuple(mask.shape)} must be [1 or {b}, 1 or {hq}, {length}, >= {n} tokens]")
        if mask.device != query.device:
            raise ValueError(f"`mask` is on {mask.device} but `query` is on {query.device}")
    check_rotation(keys.rotation, "key_rotation", head_dim, query.device)
    check_rotation(values.rotation, "value_rotation", value_dim, query.device)
    for name, value in (("scaling", scaling), ("softcap", softcap)):
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise TypeError(f"`{name}` must be a float, got {value!r}")
    if softcap < 0:
        raise ValueError(f"`softcap` must be 0 (none) or positive, got {softcap}")


# Columns of ``paged_decode_attention``'s ``requests`` table, one row per request (csrc/cpu/paged_attention.cpp).
PAGED_REQUEST_COLUMNS = ("slot", "sinks", "key_count", "key_tail_row", "value_count", "value_tail_row", "length")


def _check_pages(t, name: str, blocks: int, heads: int, dtypes) -> None:
    if not isinstance(t, torch.Tensor) or t.dim() != 4:
        raise ValueError(f"`{name}` must be a rank-4 tensor [blocks, H, ...], got {t!r:.80}")
    if t.dtype not in dtypes:
        raise TypeError(f"`{name}` must have dtype in ({_names(dtypes)}), got {t.dtype}")
    if tuple(t.shape[:2]) != (blocks, heads):
        raise ValueError(f"`{name}` shape {tuple(t.shape)} must be [{blocks} blocks, {heads} kv heads, ...]")
    if t[0].numel() and not t[0].is_contiguous():
        raise ValueError(f"`{name}` must be contiguous within each block, got strides {t.stride()}")


def check_paged_decode_args(query, key_windows, value_windows, key_codes, key_scales, key_zeros, value_codes,
                            value_scales, value_zeros, block_table, requests, key_bits, value_group, value_bits,
                            scaling, key_rotation=None, value_rotation=None) -> None:  # fmt: skip
    """Checks for ``paged_decode_attention``: the query ``[N, Hq, 1, D]``, the exact windows ``[slots, H, W, D]``, the
    pages (key codes ``[blocks, H, D, T/P]``, scales/zeros ``[blocks, H, D, 1]``; value codes ``[blocks, H, T,
    Dv/P]``, scales/zeros ``[blocks, H, T, Dv/value_group]``), and every request's row of ``requests`` (columns
    :data:`PAGED_REQUEST_COLUMNS`) within its slot, its pages within ``block_table`` and the blocks."""
    check_float_tensor(query, "query")
    check_float_tensor(key_windows, "key_windows")
    check_float_tensor(value_windows, "value_windows")
    key_bits, value_bits = check_bits(key_bits, "key_bits"), check_bits(value_bits, "value_bits")
    n_requests, q_heads, length, head_dim = query.shape
    slots, heads = key_windows.shape[:2]
    if length != 1:
        raise ValueError(f"`query` must hold one row per request [N, Hq, 1, D], got shape {tuple(query.shape)}")
    if heads == 0 or q_heads % heads or key_windows.shape[3] != head_dim:
        raise ValueError(
            f"`key_windows` shape {tuple(key_windows.shape)} must be [slots, H, rows, {head_dim}] with H dividing the "
            f"{q_heads} query heads"
        )
    if value_windows.dtype != key_windows.dtype or tuple(value_windows.shape[:2]) != (slots, heads):
        raise ValueError(
            f"`value_windows` ({value_windows.dtype} {tuple(value_windows.shape)}) must be [{slots}, {heads}, rows, "
            f"Dv] in the dtype of `key_windows` ({key_windows.dtype})"
        )
    blocks = key_codes.shape[0] if isinstance(key_codes, torch.Tensor) else -1
    for name, t, dtypes in (
        ("key_codes", key_codes, (torch.uint8,)),
        ("key_scales", key_scales, META_DTYPES),
        ("key_zeros", key_zeros, META_DTYPES),
        ("value_codes", value_codes, (torch.uint8,)),
        ("value_scales", value_scales, META_DTYPES),
        ("value_zeros", value_zeros, META_DTYPES),
    ):
        _check_pages(t, name, blocks, heads, dtypes)
    tokens = key_codes.shape[3] * codes_per_byte(key_bits)
    value_dim = value_codes.shape[3] * codes_per_byte(value_bits)
    value_group = integer(value_group, "value_group", minimum=1)
    if (
        key_scales.shape != key_zeros.shape
        or tuple(key_scales.shape[2:]) != (head_dim, 1)
        or key_codes.shape[2] != head_dim
    ):
        raise ValueError(
            f"key pages must be codes [blocks, H, {head_dim}, T/P] and scales/zeros [blocks, H, {head_dim}, 1], got "
            f"{tuple(key_codes.shape)}, {tuple(key_scales.shape)}, {tuple(key_zeros.shape)}"
        )
    if value_dim % value_group or value_windows.shape[3] != value_dim:
        raise ValueError(
            f"`value_group` ({value_group}) must divide the value head_dim {value_dim}, and `value_windows` must end "
            f"in it, got {tuple(value_windows.shape)}"
        )
    if tuple(value_codes.shape[2:3]) != (tokens,) or tuple(value_scales.shape[2:]) != (
        tokens,
        value_dim // value_group,
    ):
        raise ValueError(
            f"value pages must be codes [blocks, H, {tokens}, Dv/P] and scales/zeros [blocks, H, {tokens}, "
            f"{value_dim // value_group}], got {tuple(value_codes.shape)} and {tuple(value_scales.shape)}"
        )
    if value_scales.shape != value_zeros.shape or key_scales.dtype != key_zeros.dtype:
        raise ValueError("scales and zeros must share shapes and dtypes")
    for name, t, width in (("block_table", block_table, None), ("requests", requests, len(PAGED_REQUEST_COLUMNS))):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int64 or t.dim() != 2 or t.shape[0] != n_requests:
            raise ValueError(f"`{name}` must be an int64 [{n_requests}, {width or 'pages'}] tensor, got {t!r:.80}")
        if width is not None and t.shape[1] != width:
            raise ValueError(f"`{name}` must have the {width} columns {PAGED_REQUEST_COLUMNS}, got {tuple(t.shape)}")
    for name, t in (("key_windows", key_windows), ("value_windows", value_windows), ("key_codes", key_codes),
                    ("value_codes", value_codes), ("block_table", block_table), ("requests", requests)):  # fmt: skip
        if t.device != query.device:
            raise ValueError(f"`{name}` is on {t.device} but `query` is on {query.device}")
    if isinstance(scaling, bool) or not isinstance(scaling, int | float):
        raise TypeError(f"`scaling` must be a float, got {scaling!r}")
    check_rotation(key_rotation, "key_rotation", head_dim, query.device)
    check_rotation(value_rotation, "value_rotation", value_dim, query.device)
    if n_requests and not _without_data(requests, block_table):
        _check_paged_requests(requests, block_table, slots, key_windows.shape[2], value_windows.shape[2], tokens,
                              blocks)  # fmt: skip


def _without_data(*tensors) -> bool:
    """Whether any of ``tensors`` has no values to read (a fake or meta tensor: ``torch.compile``, opcheck)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return any(isinstance(t, FakeTensor) or t.device.type == "meta" for t in tensors)


def _check_paged_requests(requests, block_table, slots: int, key_rows: int, value_rows: int, tokens: int,
                          blocks: int) -> None:  # fmt: skip
    """Each request's row of ``requests``: slot, rows and page counts in range, its pages real blocks."""
    slot, sinks, key_count, key_tail_row, value_count, value_tail_row, length = requests.cpu().unbind(1)
    key_tail, value_tail = length - sinks - key_count, length - sinks - value_count
    pages = torch.maximum(key_count, value_count).add(tokens - 1).div(tokens, rounding_mode="floor")
    rules = {
        f"slot in [0, {slots})": (slot >= 0) & (slot < slots),
        f"0 <= sinks <= {min(key_rows, value_rows)}": (sinks >= 0) & (sinks <= min(key_rows, value_rows)),
        f"key_count a non-negative multiple of the page size {tokens}": (key_count >= 0) & (key_count % tokens == 0),
        "value_count >= 0 and length > 0": (value_count >= 0) & (length > 0),
        "length >= sinks + key_count and >= sinks + value_count": (key_tail >= 0) & (value_tail >= 0),
        f"the key tail within the window's {key_rows} rows": (key_tail_row >= 0)
        & (key_tail_row + key_tail <= key_rows),
        f"the value tail within the window's {value_rows} rows": (value_tail_row >= 0)
        & (value_tail_row + value_tail <= value_rows),
        f"at most {block_table.shape[1]} pages (the columns of `block_table`)": pages <= block_table.shape[1],
    }
    for rule, ok in rules.items():
        if not bool(ok.all()):
            bad = int((~ok).nonzero()[0, 0])
            raise ValueError(
                f"`requests` row {bad} {dict(zip(PAGED_REQUEST_COLUMNS, requests[bad].tolist(), strict=True))} breaks: "
                f"{rule}"
            )
    used = torch.arange(block_table.shape[1]).unsqueeze(0) < pages.unsqueeze(1)
    table = block_table.cpu()
    bad = used & ((table < 0) | (table >= blocks))
    if bool(bad.any()):
        row, column = bad.nonzero()[0].tolist()
        raise ValueError(f"`block_table`[{row}, {column}] = {int(table[row, column])} is not a block in [0, {blocks})")
