"""Fused KIVI attention for transformers: attention computed straight from the packed history.

``model.set_attn_implementation("kivi")`` (or :func:`use_fused_attention`) makes the model's attention modules
call :func:`kivi_attention_forward`. With a :class:`~kivi_xpu.KiviCache` built from that model's config, each
``KiviLayer.update`` then returns only the full-precision tail (window + new tokens) and hands over a
:class:`DecodeInputs` (the sinks, the packed history in place and the tails) to the attention function, which
scores the packed keys and sums the packed values in place through the ``decode_attention`` op: no dense copy of
the quantized history is ever built. Everything else (prefill, other caches, sliding-window layers, dropout)
goes to transformers' SDPA attention unchanged, so the implementation is safe to set on any model.

The hand-over: the attention function never receives the cache, only the module and the tensors ``update``
returned. ``update`` records its :class:`DecodeInputs` in a thread-local slot (never part of the cache); the
attention function takes the slot and uses it only if the key tensor it received is that very object.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .ops import kernel
from .ops.checks import KindOperands
from .ops.reference import dense_attention

ATTENTION_NAME = "kivi"


@dataclass(frozen=True)
class DecodeInputs:
    """What one layer's ``update`` hands to the attention call that follows it: keys, values and the name of
    the backend whose kernels read the packed codes."""

    keys: KindOperands  # sinks, packed codes/scales/zeros (whole buffers), count, group, bits, tail
    values: KindOperands
    backend: str


def dense_kind(inputs: KindOperands, kind: str, backend: str) -> torch.Tensor:
    """Dense ``[B, Hkv, S + count + T, D]`` of one kind: exact sinks + dequantized history (a temporary) + exact
    tail, in the tail's dtype on the tail's device. ``kind`` is "keys" or "values"."""
    parts = [inputs.sinks] if inputs.sinks.shape[2] else []
    if inputs.count:
        dequantize = kernel(f"dequantize_{kind}", backend)
        history = dequantize(
            inputs.codes, inputs.scales, inputs.zeros, inputs.count, inputs.group, inputs.bits, inputs.tail.dtype
        )
        parts.append(history.to(inputs.tail.device))
    parts.append(inputs.tail)
    # Always a new tensor: the tail may be a view of the layer's window, which the next append overwrites.
    return torch.cat(parts, dim=2) if len(parts) > 1 else parts[0].clone()


def dense_states(inputs: DecodeInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense ``[B, Hkv, n, D]`` keys and values of a hand-over (for attention that cannot read packed codes)."""
    return dense_kind(inputs.keys, "keys", inputs.backend), dense_kind(inputs.values, "values", inputs.backend)


_slot = threading.local()


def hand_over(inputs: DecodeInputs) -> None:
    _slot.inputs = inputs


def take_over(key: torch.Tensor) -> DecodeInputs | None:
    """The inputs the preceding ``update`` handed over (``None`` if there are none); clears the slot."""
    inputs = getattr(_slot, "inputs", None)
    _slot.inputs = None
    if inputs is not None and inputs.keys.tail is not key:
        # The model changed the keys between `update` and attention: the tail alone would be silently wrong.
        raise RuntimeError(
            "kivi attention: the keys reaching attention are not those KiviCache.update returned (this model "
            "transforms them in between), so the fused path cannot be used: build the cache with "
            "KiviCache(..., attention='dense') or use another attn_implementation"
        )
    return inputs


def decode_attention(
    inputs: DecodeInputs, query: torch.Tensor, attention_mask, scaling: float, softcap: float | None
) -> torch.Tensor:
    """Attention of ``query [B, Hq, L, D]`` over a hand-over through the backend's ``decode_attention`` op.
    Returns ``[B, Hq, L, Dv]`` in query's dtype."""
    op = kernel("decode_attention", inputs.backend)
    return op(query, *inputs.keys, *inputs.values, attention_mask, scaling, 0.0 if softcap is None else float(softcap))


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
    """Transformers attention interface: ``query [B, Hq, L, D]`` -> ``([B, L, Hq, D], None)``."""
    inputs = take_over(key)
    softcap = kwargs.get("softcap")
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
