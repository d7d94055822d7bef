"""The KIVI ops, each declared here once: its reference (:mod:`.reference`, whose annotated signature gives the
schema), argument check (:mod:`.checks`, :mod:`.attention_checks`) and shape rule.

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

import functools

import torch

from . import reference
from .attention_checks import check_attention_args, check_decode_args, check_paged_decode_args
from .checks import (
    check_decode_step_args,
    check_dequantize_args,
    check_quantize_args,
    check_quantize_into_args,
    codes_per_byte,
)
from .library import define

# The shape rules: each op's empty output tensor(s), allocated like its inputs (its arguments by name).


def _quantized_outputs(axis: str):
    def outputs(a):
        b, h, t, d = a.x.shape
        per, group = codes_per_byte(a.bits), a.group_size
        if axis == "tokens":  # keys: channel-major
            codes_shape, meta_shape = (b, h, d, t // per), (b, h, d, t // group)
        else:
            codes_shape, meta_shape = (b, h, t, d // per), (b, h, t, d // group)
        codes = a.x.new_empty(codes_shape, dtype=torch.uint8)
        return codes, a.x.new_empty(meta_shape, dtype=a.meta_dtype), a.x.new_empty(meta_shape, dtype=a.meta_dtype)

    return outputs


def _dequantized_output(axis: str):
    def outputs(a):
        codes = a.codes
        head_dim = codes.shape[2] if axis == "tokens" else codes.shape[3] * codes_per_byte(a.bits)
        return codes.new_empty((*codes.shape[:2], a.num_tokens, head_dim), dtype=a.out_dtype)

    return outputs


def _scores_output(a):
    return a.query.new_empty((*a.query.shape[:3], a.num_tokens), dtype=torch.float32)


def _combine_output(a):
    return a.probs.new_empty((*a.probs.shape[:3], a.codes.shape[3] * codes_per_byte(a.bits)), dtype=torch.float32)


def _decode_step_outputs(a):
    m = a.key_states.shape[2]
    return (
        a.key_window.narrow(2, a.key_start, a.key_end + m - a.key_start),
        a.value_window.narrow(2, a.value_start, a.value_end + m - a.value_start),
    )


for _axis, _kind in (("tokens", "keys"), ("channels", "values")):
    define(
        f"quantize_{_kind}",
        getattr(reference, f"quantize_{_kind}"),
        lambda a, axis=_axis: check_quantize_args(a.x, a.group_size, a.bits, a.meta_dtype, axis, a.fit),
        _quantized_outputs(_axis),
    )
    define(
        f"dequantize_{_kind}",
        getattr(reference, f"dequantize_{_kind}"),
        lambda a, axis=_axis: check_dequantize_args(*a, axis),
        _dequantized_output(_axis),
    )
# In place: writes into its storage arguments, returns nothing.
define(
    "quantize_values_into",
    reference.quantize_values_into,
    check_quantize_into_args,
    lambda a: None,
    mutates=("codes", "scales", "zeros"),
)
# In place, and returns the tails as views of the windows.
define(
    "append_decode_step",
    reference.append_decode_step,
    check_decode_step_args,
    _decode_step_outputs,
    mutates=("key_window", "value_window", "value_codes", "value_scales", "value_zeros"),
    views=("key_window", "value_window"),
)
for _name, _axis, _outputs in (
    ("packed_key_scores", "tokens", _scores_output),
    ("packed_value_combine", "channels", _combine_output),
):
    define(_name, getattr(reference, _name), functools.partial(check_attention_args, axis=_axis), _outputs)
define(
    "decode_attention",
    reference.decode_attention,
    check_decode_args,
    lambda a: a.query.new_empty((*a.query.shape[:3], a.value_tail.shape[3])),
)
define(
    "paged_decode_attention",
    reference.paged_decode_attention,
    check_paged_decode_args,
    lambda a: a.query.new_empty((*a.query.shape[:3], a.value_windows.shape[3])),
)
