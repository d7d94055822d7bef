"""Fused KIVI attention for transformers: attention computed straight from the packed history.

A model runs it under transformers' default attention (no ``attn_implementation`` chosen: :func:`attention_path`
is the rule, :func:`default_attention_forward` the ``"sdpa"`` function while kivi_xpu is imported) and under
``attn_implementation="kivi"`` (:func:`use_fused_attention`, :func:`kivi_attention_forward`). A
:class:`~kivi_xpu.KiviCache` layer then returns from ``update`` only the full-precision tail (window + new tokens)
and hands over a :class:`DecodeInputs` (the sinks, the packed history in place and the tails) to the attention
function, which scores the packed keys and sums the packed values in place through the ``decode_attention`` op: no
dense copy of the quantized history is ever built. Everything else (prefill, other caches, sliding-window layers,
dropout) goes to transformers' SDPA attention unchanged, so both functions are safe on any model.

The hand-over: the attention function never receives the cache, only the module and the tensors ``update``
returned. ``update`` records a :class:`Pending` step in a thread-local slot (never part of the cache): weak
references to the layer and to the key and value tensors it returned, and, under the fused attention, its
:class:`DecodeInputs` without those tensors. The attention function uses the step only if the key and value it
received are those very objects. The step holds nothing alive: when the returned tensors die unused (a manual
``update``, an exception in between) it shrinks to a tensor-free record, and the next ``update`` replaces it, so
a stale step never breaks an unrelated forward. The one case still refused is a model that changes the keys or
values between ``update`` and attention (the tail alone would be silently wrong).

The same record lets the attention function tell a layer that the model's attention reads it through one of these
functions (``attention_seen``) and which config the model runs: a layer built without the model's config
(``KiviCache()``) or with a copy of it then takes ``module.config`` as its model config and uses the fused path from
its next update on.
"""

from __future__ import annotations

import functools
import logging
import threading
import weakref
from typing import NamedTuple

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .ops import kernel
from .ops.operands import KindOperands, decode_args
from .ops.reference import dense_attention, masked_scores, softmax_rows
from .storage import dequantized

ATTENTION_NAME = "kivi"
logger = logging.getLogger("kivi_xpu")


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


# transformers' default attention, "sdpa" resolved because no attn_implementation was given, as a str object of its
# own: models built after `import kivi_xpu` hold this very object (kivi_xpu.integration records it at load), while a
# name the user chose, "sdpa" included, is another object. Under it a KiviCache takes the fused path.
DEFAULT_SDPA = "".join(("sd", "pa"))


def attention_name(config) -> str | None:
    """``config._attn_implementation``, read where transformers 5 stores it, past the config class's
    ``__getattribute__`` hooks, which would add their Python calls to every layer at every step; a config without
    that attribute is read the documented way."""
    try:
        return object.__getattribute__(config, "_attn_implementation_internal")
    except AttributeError:
        return getattr(config, "_attn_implementation", None)


def attention_path(config, seen: bool) -> tuple[bool, str]:
    """(fused, why) for a KIVI layer read by the model of ``config``: fused under ``attn_implementation="kivi"``,
    and under transformers' default attention once the layer's attention call went through the registered ``"sdpa"``
    function (``seen``: a model whose attention bypasses transformers' interface must get dense states); dense under
    any attention the user chose, ``"sdpa"`` included."""
    name = attention_name(config)
    if name == ATTENTION_NAME:
        return True, 'attn_implementation="kivi"'
    if name is DEFAULT_SDPA:
        if seen:
            return True, "the model runs transformers' default attention (no attn_implementation was chosen)"
        return False, "the model's attention has not reached transformers' attention interface yet"
    return False, (
        f"the model's attention is {name!r}, chosen explicitly (or the model was loaded before kivi_xpu was "
        "imported); kivi_xpu.use_fused_attention(model) switches to the fused attention"
    )


def fuses(config, seen: bool) -> bool:
    """``attention_path(config, seen)[0]`` on the hot path (every layer, every step)."""
    name = attention_name(config)
    return name == ATTENTION_NAME or (seen and name is DEFAULT_SDPA)


@functools.cache
def _say_once(message: str) -> None:
    logger.info(message)


def log_attention_path(layer) -> None:
    """Says once per process in the log (logger ``kivi_xpu``, level INFO) which attention and kernels read the
    history of layers like ``layer``."""
    if layer.attention == "dense":
        fused, why = False, 'the cache was built with attention="dense"'
    else:
        fused, why = attention_path(layer.model_config, layer.attention_seen)
    path = "fused KIVI attention over the packed history" if fused else "SDPA over a dequantized copy"
    _say_once(f"kivi_xpu: {path} ({why}); kernels: {layer.backend.describe()}")


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
        if layer is not None and config is not None:
            layer.attention_seen = True  # the model's attention reads this layer through our function
            if layer.model_config is not config:
                layer.model_config = config  # fused from the next update on, if attention_path says so
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


def kivi_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask: torch.Tensor | None, **kwargs) -> tuple[torch.Tensor, None]:  # fmt: skip
    """Transformers attention interface: ``query [B, Hq, L, D]`` -> ``([B, L, Hq, D], None)``, or with
    ``output_attentions=True`` ``([B, L, Hq, D], weights [B, Hq, L, n])``: then exact attention over the dense
    states (the packed history dequantized), as eager attention computes it, instead of the fused kernel. ``kwargs``:
    as transformers passes them (``dropout``, ``scaling``, ``is_causal``, ``softcap``, ``sliding_window``, ...)."""
    return _attend(module, query, key, value, take_over(module, key, value), attention_mask, **kwargs)


def default_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                              attention_mask: torch.Tensor | None, **kwargs) -> tuple[torch.Tensor, None]:  # fmt: skip
    """transformers' ``"sdpa"`` attention while kivi_xpu is imported: a step a KIVI layer handed over for fusing
    (only under the default attention, see :func:`attention_path`) is attended as :func:`kivi_attention_forward`
    does; every other call goes to the ``"sdpa"`` function registered before, untouched (``kwargs`` as given)."""
    inputs = take_over(module, key, value)
    if inputs is None:
        return default_attention_forward.__kivi_xpu_original__(module, query, key, value, attention_mask, **kwargs)
    return _attend(module, query, key, value, inputs, attention_mask, **kwargs)


default_attention_forward.__kivi_xpu_original__ = sdpa_attention_forward


def _attend(module, query, key, value, inputs, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """The kivi attention of one call, given what :func:`take_over` returned (``inputs``)."""
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
    """Registers ``"kivi"`` with transformers' attention and mask interfaces, and :func:`default_attention_forward`
    as ``"sdpa"`` around the function registered there before (idempotent)."""
    AttentionInterface.register(ATTENTION_NAME, kivi_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
    current = AttentionInterface._global_mapping["sdpa"]
    if current is not default_attention_forward:
        default_attention_forward.__kivi_xpu_original__ = current
        AttentionInterface.register("sdpa", default_attention_forward)


def use_fused_attention(model) -> None:
    """Switches ``model`` to the fused KIVI attention (``model.set_attn_implementation("kivi")``)."""
    register()
    model.set_attn_implementation(ATTENTION_NAME)
