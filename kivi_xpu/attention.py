"""Fused KIVI attention for transformers: attention computed straight from the packed history.

``model.set_attn_implementation("kivi")`` (or :func:`use_fused_attention`) makes the model's attention modules
call :func:`kivi_attention_forward`. With a :class:`~kivi_xpu.KiviCache` built from that model's config, each
``KiviLayer.update`` then returns only the full-precision tail (window + new tokens) and hands over a
:class:`DecodeInputs` (the sinks, the packed history in place and the tails) to the attention function, which
scores the packed keys and sums the packed values in place through the ``decode_attention`` op: no dense copy of
the quantized history is ever built. Everything else (prefill, other caches, sliding-window layers, dropout)
goes to transformers' SDPA attention unchanged, so the implementation is safe to set on any model.

The hand-over: the attention function never receives the cache, only the module and the tensors ``update``
returned. ``update`` records a :class:`Pending` step in a thread-local slot (never part of the cache): weak
references to the layer and to the key and value tensors it returned, and, under the fused attention, its
:class:`DecodeInputs` without those tensors. The attention function uses the step only if the key and value it
received are those very objects. The step holds nothing alive: when the returned tensors die unused (a manual
``update``, an exception in between) it shrinks to a tensor-free record, and the next ``update`` replaces it, so
a stale step never breaks an unrelated forward. The one case still refused is a model that changes the keys or
values between ``update`` and attention (the tail alone would be silently wrong).

The same record lets the attention function tell a layer that the model runs the kivi attention: a layer built
without the model's config (``KiviCache()``) or with a copy of it then takes ``module.config`` as its model config
and uses the fused path from its next update on.
"""

from __future__ import annotations

import functools
import threading
import weakref
from typing import NamedTuple

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .ops import kernel
from .ops.checks import KindOperands, decode_args
from .ops.reference import dense_attention, masked_scores, softmax_rows
from .storage import dequantized

ATTENTION_NAME = "kivi"


class DecodeInputs(NamedTuple):
    """What one layer's ``update`` hands to the attention call that follows it: keys, values and the name of
    the backend whose kernels read the packed codes. (A named tuple: built three times per layer and step.)"""

    keys: KindOperands  # sinks, packed codes/scales/zeros (whole buffers), count, group, bits, tail
    values: KindOperands
    backend: str

    def with_tails(self, key_tail: torch.Tensor | None, value_tail: torch.Tensor | None) -> DecodeInputs:
        """The same inputs with other tails (``None`` while the step waits in the slot: see :func:`hand_over`)."""
        return DecodeInputs(self.keys.with_tail(key_tail), self.values.with_tail(value_tail), self.backend)


def dense_kind(inputs: KindOperands, kind: str, backend: str) -> torch.Tensor:
    """Dense ``[B, Hkv, S + count + T, D]`` of one kind: exact sinks + dequantized history (a temporary, rotated back
    when stored rotated) + exact tail, in the tail's dtype on the tail's device. ``kind`` is "keys" or "values"."""
    parts = [inputs.sinks] if inputs.sinks.shape[2] else []
    if inputs.count:
        operands = (inputs.codes, inputs.scales, inputs.zeros, inputs.count, inputs.group, inputs.bits)
        parts.append(dequantized(kind, backend, *operands, inputs.rotation, inputs.tail.dtype, inputs.tail.device))
    parts.append(inputs.tail)
    # Always a new tensor: the tail may be a view of the layer's window, which the next append overwrites.
    return torch.cat(parts, dim=2) if len(parts) > 1 else parts[0].clone()


def dense_states(inputs: DecodeInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense ``[B, Hkv, n, D]`` keys and values of a hand-over (for attention that cannot read packed codes)."""
    return dense_kind(inputs.keys, "keys", inputs.backend), dense_kind(inputs.values, "values", inputs.backend)


def runs_kivi_attention(config) -> bool:
    """Whether a model config selects this attention (``config._attn_implementation == "kivi"``). Read where
    transformers 5 stores it, past the config class's ``__getattribute__`` hooks (~2 us through them, and every
    layer reads it at every step); a config without that attribute is read the documented way."""
    try:
        return object.__getattribute__(config, "_attn_implementation_internal") == ATTENTION_NAME
    except AttributeError:
        return getattr(config, "_attn_implementation", None) == ATTENTION_NAME


class Pending(NamedTuple):
    """The last ``update`` of a :class:`~kivi_xpu.KiviLayer` on this thread, waiting for its attention call.

    ``layer``, ``key`` and ``value`` are weak references (to the layer and to the tensors ``update`` returned);
    ``fused``: whether ``key``/``value`` are only the exact tails of a fused step, whose rest is ``inputs`` (the
    hand-over with its tails left out; dropped, ``None``, once ``key`` dies unused); ``tail_shape`` the shape of
    ``key`` (kept to recognise a model that replaced the tensors)."""

    layer: weakref.ref
    key: weakref.ref
    value: weakref.ref
    fused: bool
    inputs: DecodeInputs | None
    tail_shape: torch.Size


class _Slot(threading.local):
    pending: Pending | None = None


_slot = _Slot()


def _release(slot: _Slot, key_ref: weakref.ref) -> None:
    """Weak-reference callback: the key tensor of the pending step died before its attention call; drop the
    tensors the step would have handed over (the record of its shape stays until the next update)."""
    pending = slot.pending
    if pending is not None and pending.key is key_ref:
        slot.pending = pending._replace(inputs=None)


_release_this_slot = functools.partial(_release, _slot)


def hand_over(layer, key: torch.Tensor, value: torch.Tensor, inputs: DecodeInputs | None) -> None:
    """Records what ``layer.update`` returned (``key``, ``value``) and, under the fused attention, the rest of the
    hand-over (``inputs``, whose tails are ``key`` and ``value``, or ``None`` already) for the attention call that
    follows."""
    if inputs is not None and inputs.keys.tail is not None:  # the slot must not keep the returned tensors alive
        inputs = inputs.with_tails(None, None)
    key_ref = weakref.ref(key, _release_this_slot)
    _slot.pending = Pending(weakref.ref(layer), key_ref, weakref.ref(value), inputs is not None, inputs, key.shape)


def pending_step() -> Pending | None:
    """The step waiting in this thread's slot (for tests and debugging)."""
    return _slot.pending


def take_over(module, key: torch.Tensor, value: torch.Tensor) -> DecodeInputs | None:
    """The fused inputs the preceding ``update`` handed over for ``key``/``value`` (``None`` if there are none,
    including a stale step of another forward); clears the slot. Gives the updating layer ``module.config``."""
    pending, _slot.pending = _slot.pending, None
    if pending is None:
        return None
    if pending.key() is key and pending.value() is value:
        layer = pending.layer()
        config = getattr(module, "config", None)
        if layer is not None and config is not None and layer.model_config is not config:
            layer.model_config = config  # the model runs this attention: fuse from the next update on
        if not pending.fused:
            return None
        return pending.inputs.with_tails(key, value)
    if pending.fused and (pending.key() is key or pending.value() is value or key.shape == pending.tail_shape):
        # The model changed the keys or values between `update` and attention: the tail alone would be wrong.
        raise RuntimeError(
            "kivi attention: the keys reaching attention are not those KiviCache.update returned (this model "
            "transforms them in between), so the fused path cannot be used: build the cache with "
            "KiviCache(..., attention='dense') or use another attn_implementation"
        )
    return None  # a stale step (an update whose attention never ran): nothing to do with this call


def decode_attention(
    inputs: DecodeInputs, query: torch.Tensor, attention_mask, scaling: float, softcap: float | None
) -> torch.Tensor:
    """Attention of ``query [B, Hq, L, D]`` over a hand-over through the backend's ``decode_attention`` op.
    Returns ``[B, Hq, L, Dv]`` in query's dtype."""
    op = kernel("decode_attention", inputs.backend)
    softcap = 0.0 if softcap is None else float(softcap)
    return op(query, *decode_args(inputs.keys, inputs.values, attention_mask, scaling, softcap))


def attention_with_weights(query, key, value, attention_mask, scaling: float, softcap: float, dropout: float = 0.0):
    """Exact attention that also returns its weights, for ``output_attentions=True``: ``query [B, Hq, L, D]``, dense
    ``key`` / ``value [B, Hkv, n, D]`` -> (``[B, L, Hq, Dv]``, weights ``[B, Hq, L, n]``), both in query's dtype."""
    repeat = query.shape[1] // key.shape[1]
    keys, values = key.float().repeat_interleave(repeat, 1), value.float().repeat_interleave(repeat, 1)
    scores = (query.float() * scaling) @ keys.transpose(2, 3)
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    weights = softmax_rows(masked_scores(scores, attention_mask))
    if dropout > 0:  # as transformers' eager attention: dropout on the weights (training only; callers pass 0 else)
        weights = torch.nn.functional.dropout(weights, p=dropout, training=True)
    out = (weights @ values).to(query.dtype)
    return out.transpose(1, 2).contiguous(), weights.to(query.dtype)


def kivi_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Transformers attention interface: ``query [B, Hq, L, D]`` -> ``([B, L, Hq, D], None)``, or with
    ``output_attentions=True`` ``([B, L, Hq, D], weights [B, Hq, L, n])``: then exact attention over the dense
    states (the packed history dequantized), as eager attention computes it, instead of the fused kernel."""
    inputs = take_over(module, key, value)
    softcap = kwargs.get("softcap")
    if kwargs.get("output_attentions"):
        if inputs is not None:
            key, value = dense_states(inputs)
        scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
        dropout = dropout if module.training else 0.0
        return attention_with_weights(query, key, value, attention_mask, scaling, softcap or 0.0, dropout)
    if inputs is not None and (dropout > 0 or kwargs.get("sliding_window") is not None):
        key, value = dense_states(inputs)  # the layer returned only its tail: rebuild the dense states
        inputs = None
    if inputs is None and (softcap is None or dropout > 0):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    if inputs is None:  # logit soft-capping (Gemma-2), which SDPA lacks: exact attention with explicit scores
        out = dense_attention(query, key, value, attention_mask, scaling, softcap)
    else:
        out = decode_attention(inputs, query, attention_mask, scaling, softcap)
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Registers ``"kivi"`` with transformers' attention and mask interfaces (idempotent)."""
    AttentionInterface.register(ATTENTION_NAME, kivi_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)


def use_fused_attention(model) -> None:
    """Switches ``model`` to the fused KIVI attention (``model.set_attn_implementation("kivi")``)."""
    register()
    model.set_attn_implementation(ATTENTION_NAME)
