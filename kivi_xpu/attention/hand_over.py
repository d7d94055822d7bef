"""The hand-over from a KIVI layer's ``update`` to the attention call that follows it.

The attention function never receives the cache, only the module and the tensors ``update`` returned. ``update``
records a :class:`Pending` step in a thread-local slot (never part of the cache): weak references to the layer and to
the key and value tensors it returned, and, under the fused attention, its
:class:`~kivi_xpu.ops.operands.DecodeInputs` without those tensors. The attention function uses the step only if the
key and value it received are those very objects. The step holds nothing alive: when the returned tensors die unused
(a manual ``update``, an exception in between) it shrinks to a tensor-free record, and the next ``update`` replaces
it, so a stale step never breaks an unrelated forward. The one case still refused is a model that changes the keys or
values between ``update`` and attention (the tail alone would be silently wrong).

The same record lets the attention function tell a layer that the model's attention reads it through one of these
functions (``attention_seen``) and which config the model runs: a layer built without the model's config
(``KiviCache()``) or with a copy of it then takes ``module.config`` as its model config and uses the fused path from
its next update on.
"""

from __future__ import annotations

import functools
import threading
import weakref
from typing import NamedTuple

import torch

from ..ops.operands import DecodeInputs


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
