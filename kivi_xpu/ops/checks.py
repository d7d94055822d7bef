"""Argument validation shared by every implementation of the ops: the pieces (bits, group sizes, tensors, rotations)
and the quantization ops' checks (the attention ops': :mod:`.attention_checks`). An op's check takes its arguments
as the op's named tuple (:class:`~.library.OpDef`), so that the op's signature is written once, in the reference.

Each check raises a ``ValueError`` / ``TypeError`` that names the offending argument and the allowed values,
so that bad input never reaches a kernel (where it could read out of bounds) and never produces silent garbage.
"""

from __future__ import annotations

import torch

from ..validation import integer
from .library import OPS

# The operands' named parts, imported from here by the cache modules (stream, attention, paged, tools.timing).

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


FITS = ("minmax", "least_squares")  # how a group's line is fitted (kivi_xpu/ops/reference.py)


def check_fit(fit, name: str = "fit") -> str:
    if fit not in FITS:
        raise ValueError(f"`{name}` must be one of {FITS}, got {fit!r}")
    return fit


def check_quantize_args(x: torch.Tensor, group_size: int, bits: int, meta_dtype, axis: str, fit="minmax") -> None:
    """Checks for ``quantize_keys`` (axis='tokens') and ``quantize_values`` (axis='channels')."""
    check_float_tensor(x, "x")
    check_bits(bits)
    check_group_size(group_size, bits)
    check_meta_dtype(meta_dtype)
    check_fit(fit)
    dim = 2 if axis == "tokens" else 3
    if x.shape[dim] % group_size != 0:
        what = "number of tokens x.shape[2]" if axis == "tokens" else "head_dim x.shape[3]"
        raise ValueError(f"`group_size` ({group_size}) must divide the {what} ({x.shape[dim]})")


def check_dequantize_args(codes, scales, zeros, num_tokens, group_size, bits, out_dtype, axis: str) -> None:
    """Checks for ``dequantize_keys`` (axis='tokens') and ``dequantize_values`` (axis='channels'), given their
    arguments in order, and of any packed operand (a decode attention's history: as for dequantization).

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


def check_quantize_into_args(a) -> None:
    """Checks for ``quantize_values_into``: ``x [B, H, n, D]`` (or ``x @ rotation``, ``rotation`` ``None`` or float32
    ``[D, D]`` on ``x``'s device) goes to token rows ``[offset, offset + n)`` of packed value storage ``codes [B, H,
    capacity, D/P]``, ``scales``/``zeros [B, H, capacity, D/G]`` (their dtype is the metadata dtype)."""
    x, codes, scales, bits = a.x, a.codes, a.scales, a.bits
    meta_dtype = scales.dtype if isinstance(scales, torch.Tensor) else None
    check_quantize_args(x, a.group_size, bits, meta_dtype, "channels", a.fit)
    offset = a.offset
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
        raise ValueError(f"`offset` must be a non-negative integer, got {offset!r}")
    check_dequantize_args(codes, scales, a.zeros, 0, a.group_size, bits, x.dtype, "channels")
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
    check_rotation(a.rotation, "rotation", d, x.device, owner="x")


def check_decode_step_args(a) -> None:
    """Checks for ``append_decode_step``: each kind's states ``[B, H, m, D]`` fit its window ``[B, H, capacity, D]``
    (same batch, heads, head_dim, dtype and device; ``0 <= start <= end``, ``end + m <= capacity``), and the value
    rows leaving the window go to the value storage as for ``quantize_values_into``."""
    for kind in ("key", "value"):
        states, window = getattr(a, f"{kind}_states"), getattr(a, f"{kind}_window")
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
        start = integer(getattr(a, f"{kind}_start"), f"{kind}_start", minimum=0)
        end = integer(getattr(a, f"{kind}_end"), f"{kind}_end", minimum=0)
        if start > end or end + s[2] > w[2]:
            raise ValueError(
                f"`{kind}_start` ({start}) <= `{kind}_end` ({end}) and `{kind}_end` + new tokens ({s[2]}) <= the "
                f"window's capacity ({w[2]}) must hold"
            )
    key_states, value_states = a.key_states, a.value_states
    if value_states.shape[2] != key_states.shape[2]:
        raise ValueError(
            f"`value_states` must hold as many tokens as `key_states` ({key_states.shape[2]}), got "
            f"{value_states.shape[2]}"
        )
    leaving = integer(a.value_leaving, "value_leaving", minimum=0)
    if a.value_start + leaving > a.value_end + value_states.shape[2]:
        raise ValueError(
            f"`value_leaving` ({leaving}) must not exceed the value window's rows after the append "
            f"({a.value_end + value_states.shape[2] - a.value_start})"
        )
    rows = a.value_window.narrow(2, a.value_start, leaving)
    if isinstance(a.value_codes, torch.Tensor) and rows.device != a.value_codes.device:
        rows = torch.empty_like(rows, device=a.value_codes.device)  # (the op moves the leaving rows to the storage)
    storage = (a.value_codes, a.value_scales, a.value_zeros)
    into = OPS["quantize_values_into"].arguments
    check_quantize_into_args(
        into(
            rows,
            *storage,
            a.value_offset,
            a.value_group,
            a.value_bits,
            a.value_rotation,
            check_fit(a.value_fit, "value_fit"),
        )
    )
