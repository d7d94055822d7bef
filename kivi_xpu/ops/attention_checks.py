"""Argument checks of the attention ops: ``packed_key_scores`` / ``packed_value_combine``, ``decode_attention`` and
``paged_decode_attention`` (each given the op's arguments as its named tuple, see :mod:`.checks`)."""

from __future__ import annotations

import itertools

import torch

from ..validation import integer
from .checks import (
    FLOAT_DTYPES,
    META_DTYPES,
    _names,
    check_bits,
    check_dequantize_args,
    check_float_tensor,
    check_rotation,
    codes_per_byte,
)
from .operands import PAGED_REQUEST_COLUMNS, RequestColumns, split_decode_args


def check_attention_args(a, axis: str) -> None:
    """Checks for ``packed_key_scores`` (its dense operand ``query``, axis='tokens') and ``packed_value_combine``
    (``probs``, axis='channels'): the packed arguments as for dequantization, plus the dense operand."""
    name, query = a._fields[0], a[0]
    codes, num_tokens = a.codes, a.num_tokens
    check_dequantize_args(*a[1:], torch.float32, axis)
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


def check_decode_args(a) -> None:
    """Checks for ``decode_attention``: each packed operand as for dequantization, the exact parts and the query
    consistent with it (batch, kv heads, head_dims, dtypes, devices), equal token counts for keys and values, and a
    mask of shape ``[B or 1, 1 or Hq, L, >= n]``."""
    query = a.query
    keys, values, mask, scaling, softcap = split_decode_args(a[1:])
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


def _check_pages(t, name: str, blocks: int, heads: int, dtypes) -> None:
    if not isinstance(t, torch.Tensor) or t.dim() != 4:
        raise ValueError(f"`{name}` must be a rank-4 tensor [blocks, H, ...], got {t!r:.80}")
    if t.dtype not in dtypes:
        raise TypeError(f"`{name}` must have dtype in ({_names(dtypes)}), got {t.dtype}")
    if tuple(t.shape[:2]) != (blocks, heads):
        raise ValueError(f"`{name}` shape {tuple(t.shape)} must be [{blocks} blocks, {heads} kv heads, ...]")
    if t[0].numel() and not t[0].is_contiguous():
        raise ValueError(f"`{name}` must be contiguous within each block, got strides {t.stride()}")


def check_paged_decode_args(a) -> None:
    """Checks for ``paged_decode_attention``: the query ``[N, Hq, 1, D]``, the exact windows ``[slots, H, W, D]``, the
    pages (key codes ``[blocks, H, D, T/P]``, scales/zeros ``[blocks, H, T/G, D]``: ``T/G`` key groups of ``G``
    tokens, a whole number of code bytes each; value codes ``[blocks, H, T,
    Dv/P]``, scales/zeros ``[blocks, H, T, Dv/value_group]``), and every request's row of ``requests`` (columns
    :class:`~.operands.RequestColumns`) within its slot, its pages within ``block_table`` and the blocks."""
    query, key_windows, value_windows, block_table, requests = (
        a.query, a.key_windows, a.value_windows, a.block_table, a.requests
    )  # fmt: skip
    key_codes, key_scales, key_zeros = a.key_codes, a.key_scales, a.key_zeros
    value_codes, value_scales, value_zeros = a.value_codes, a.value_scales, a.value_zeros
    check_float_tensor(query, "query")
    check_float_tensor(key_windows, "key_windows")
    check_float_tensor(value_windows, "value_windows")
    key_bits, value_bits = check_bits(a.key_bits, "key_bits"), check_bits(a.value_bits, "value_bits")
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
    for kind, part in itertools.product(("key", "value"), ("codes", "scales", "zeros")):  # the pages
        dtypes = (torch.uint8,) if part == "codes" else META_DTYPES
        _check_pages(getattr(a, f"{kind}_{part}"), f"{kind}_{part}", blocks, heads, dtypes)
    tokens = key_codes.shape[3] * codes_per_byte(key_bits)
    value_dim = value_codes.shape[3] * codes_per_byte(value_bits)
    value_group = integer(a.value_group, "value_group", minimum=1)
    groups = key_scales.shape[2] if key_scales.dim() == 4 else 0
    if (
        key_scales.shape != key_zeros.shape
        or key_scales.shape[3] != head_dim
        or key_codes.shape[2] != head_dim
        or groups < 1
        or tokens % groups
        or tokens // groups % codes_per_byte(key_bits)
    ):
        raise ValueError(
            f"key pages must be codes [blocks, H, {head_dim}, T/P] and scales/zeros [blocks, H, T/G, {head_dim}] (T/G "
            f"key groups of G tokens per page, G a multiple of {codes_per_byte(key_bits)} codes per byte), got "
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
    for name in ("key_windows", "value_windows", "key_codes", "value_codes", "block_table", "requests"):
        t = getattr(a, name)
        if t.device != query.device:
            raise ValueError(f"`{name}` is on {t.device} but `query` is on {query.device}")
    if isinstance(a.scaling, bool) or not isinstance(a.scaling, int | float):
        raise TypeError(f"`scaling` must be a float, got {a.scaling!r}")
    check_rotation(a.key_rotation, "key_rotation", head_dim, query.device)
    check_rotation(a.value_rotation, "value_rotation", value_dim, query.device)
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
    r = RequestColumns(*requests.cpu().unbind(1))
    key_tail, value_tail = r.length - r.sinks - r.key_count, r.length - r.sinks - r.value_count
    pages = torch.maximum(r.key_count, r.value_count).add(tokens - 1).div(tokens, rounding_mode="floor")
    exact_rows = min(key_rows, value_rows)
    rules = {
        f"slot in [0, {slots})": (r.slot >= 0) & (r.slot < slots),
        f"0 <= sinks <= {exact_rows}": (r.sinks >= 0) & (r.sinks <= exact_rows),
        f"key_count a non-negative multiple of the page size {tokens}": (r.key_count >= 0)
        & (r.key_count % tokens == 0),
        "value_count >= 0 and length > 0": (r.value_count >= 0) & (r.length > 0),
        "length >= sinks + key_count and >= sinks + value_count": (key_tail >= 0) & (value_tail >= 0),
        f"the key tail within the window's {key_rows} rows": (r.key_tail_row >= 0)
        & (r.key_tail_row + key_tail <= key_rows),
        f"the value tail within the window's {value_rows} rows": (r.value_tail_row >= 0)
        & (r.value_tail_row + value_tail <= value_rows),
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
