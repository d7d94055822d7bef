"""The KIVI ops, each declared here once: schema, argument check (:mod:`.checks`) and shape rule.

Layouts (``B`` batch, ``H`` kv heads, ``T`` tokens, ``D`` head_dim, ``G`` group size, ``P = 8 // bits`` codes per
byte; see :mod:`.reference` for the exact semantics):

* keys, per channel, channel-major: codes ``uint8 [B, H, D, T/P]``, scales/zeros ``[B, H, D, T/G]``;
* values, per token: codes ``uint8 [B, H, T, D/P]``, scales/zeros ``[B, H, T, D/G]``.

``quantize_values_into`` is ``quantize_values`` writing into rows of existing value storage (a decode step's token
leaving the window, without temporaries); with a ``rotation`` ``Q``, of ``x @ Q`` (the rotation folded into the op).
``append_decode_step`` is a layer's whole cache work of a decode step (window appends, the departing value tokens
quantized in place) in one call; it returns the tails as views of the windows. ``paged_decode_attention`` is
``decode_attention`` for continuous batching: one query row per request, each request's packed history in pages of
``key_group`` tokens named by its row of a block table, its sinks and tail in an exact slot (:mod:`kivi_xpu.paged`).

Packed buffers may be longer along their token axis than the count of valid tokens (over-allocated storage).
"""

from __future__ import annotations

import torch

from . import reference
from .checks import (
    check_attention_args,
    check_decode_args,
    check_decode_step_args,
    check_dequantize_args,
    check_paged_decode_args,
    check_quantize_args,
    check_quantize_into_args,
    codes_per_byte,
    split_decode_args,
)
from .library import define

_QUANTIZE = "(Tensor x, int group_size, int bits, ScalarType meta_dtype) -> (Tensor, Tensor, Tensor)"
_QUANTIZE_INTO = (
    "(Tensor x, Tensor(a!) codes, Tensor(b!) scales, Tensor(c!) zeros, int offset, int group_size, int bits, "
    "Tensor? rotation=None) -> ()"
)
_DECODE_STEP = (
    "(Tensor key_states, Tensor value_states, Tensor(a!) key_window, int key_start, int key_end, "
    "Tensor(b!) value_window, int value_start, int value_end, Tensor(c!) value_codes, Tensor(d!) value_scales, "
    "Tensor(e!) value_zeros, int value_offset, int value_leaving, int value_group, int value_bits, "
    "Tensor? value_rotation=None) -> (Tensor(a), Tensor(b))"
)
_PAGED_DECODE_ATTENTION = (
    "(Tensor query, Tensor key_windows, Tensor value_windows, Tensor key_codes, Tensor key_scales, Tensor key_zeros, "
    "Tensor value_codes, Tensor value_scales, Tensor value_zeros, Tensor block_table, Tensor requests, int key_bits, "
    "int value_group, int value_bits, float scaling, Tensor? key_rotation=None, Tensor? value_rotation=None) -> Tensor"
)
_DEQUANTIZE = (
    "(Tensor codes, Tensor scales, Tensor zeros, int num_tokens, int group_size, int bits, ScalarType out_dtype)"
    " -> Tensor"
)
_PACKED_ATTENTION = (
    "(Tensor {dense}, Tensor codes, Tensor scales, Tensor zeros, int num_tokens, int group_size, int bits) -> Tensor"
)
_DECODE_ATTENTION = (
    "(Tensor query, Tensor key_sinks, Tensor key_codes, Tensor key_scales, Tensor key_zeros, int key_count, "
    "int key_group, int key_bits, Tensor key_tail, Tensor value_sinks, Tensor value_codes, Tensor value_scales, "
    "Tensor value_zeros, int value_count, int value_group, int value_bits, Tensor value_tail, Tensor? mask, "
    "float scaling, float softcap, Tensor? key_rotation=None, Tensor? value_rotation=None) -> Tensor"
)


def _quantized_outputs(axis: str):
    def outputs(x, group_size, bits, meta_dtype):
        b, h, t, d = x.shape
        per = codes_per_byte(bits)
        if axis == "tokens":  # keys: channel-major
            codes_shape, meta_shape = (b, h, d, t // per), (b, h, d, t // group_size)
        else:
            codes_shape, meta_shape = (b, h, t, d // per), (b, h, t, d // group_size)
        codes = x.new_empty(codes_shape, dtype=torch.uint8)
        return codes, x.new_empty(meta_shape, dtype=meta_dtype), x.new_empty(meta_shape, dtype=meta_dtype)

    return outputs


def _dequantized_output(axis: str):
    def outputs(codes, scales, zeros, num_tokens, group_size, bits, out_dtype):
        b, h = codes.shape[:2]
        head_dim = codes.shape[2] if axis == "tokens" else codes.shape[3] * codes_per_byte(bits)
        return codes.new_empty((b, h, num_tokens, head_dim), dtype=out_dtype)

    return outputs


def _scores_output(query, codes, scales, zeros, num_tokens, group_size, bits):
    b, hq, length, _ = query.shape
    return query.new_empty((b, hq, length, num_tokens), dtype=torch.float32)


def _combine_output(probs, codes, scales, zeros, num_tokens, group_size, bits):
    b, hq, length, _ = probs.shape
    return probs.new_empty((b, hq, length, codes.shape[3] * codes_per_byte(bits)), dtype=torch.float32)


def _decode_output(query, *args):
    _, values, *_ = split_decode_args(args)
    b, hq, length, _ = query.shape
    return query.new_empty((b, hq, length, values.tail.shape[3]))


for _axis, _kind in (("tokens", "keys"), ("channels", "values")):
    define(
        f"quantize_{_kind}",
        _QUANTIZE,
        lambda x, g, bits, meta, axis=_axis: check_quantize_args(x, g, bits, meta, axis),
        _quantized_outputs(_axis),
        getattr(reference, f"quantize_{_kind}"),
    )
    define(
        f"dequantize_{_kind}",
        _DEQUANTIZE,
        lambda c, s, z, n, g, bits, out, axis=_axis: check_dequantize_args(c, s, z, n, g, bits, out, axis),
        _dequantized_output(_axis),
        getattr(reference, f"dequantize_{_kind}"),
    )
# In place: writes into its storage arguments, returns nothing.
define(
    "quantize_values_into", _QUANTIZE_INTO, check_quantize_into_args, lambda *args: None, reference.quantize_values_into
)


def _decode_step_outputs(key_states, value_states, key_window, key_start, key_end, value_window, value_start,
                         value_end, *storage):  # fmt: skip
    m = key_states.shape[2]
    return (
        key_window.narrow(2, key_start, key_end + m - key_start),
        value_window.narrow(2, value_start, value_end + m - value_start),
    )


define("append_decode_step", _DECODE_STEP, check_decode_step_args, _decode_step_outputs, reference.append_decode_step)
for _name, _dense, _axis, _outputs in (
    ("packed_key_scores", "query", "tokens", _scores_output),
    ("packed_value_combine", "probs", "channels", _combine_output),
):
    define(
        _name,
        _PACKED_ATTENTION.format(dense=_dense),
        lambda t, *packed, dense=_dense, axis=_axis: check_attention_args(dense, t, *packed, axis),
        _outputs,
        getattr(reference, _name),
    )
define("decode_attention", _DECODE_ATTENTION, check_decode_args, _decode_output, reference.decode_attention)


def _paged_decode_output(query, key_windows, value_windows, *args):
    return query.new_empty((*query.shape[:3], value_windows.shape[3]))


define(
    "paged_decode_attention",
    _PAGED_DECODE_ATTENTION,
    check_paged_decode_args,
    _paged_decode_output,
    reference.paged_decode_attention,
)
