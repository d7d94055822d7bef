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
from .ops.reference import group_queries

ATTENTION_NAME = "kivi"


@dataclass(frozen=True)
class KindInputs:
    """One kind (keys or values) of a layer as attention reads it, positions ``[sinks | packed | tail]``."""

    sinks: torch.Tensor  # [B, Hkv, S, D] exact, on the model's device ([B, Hkv, 0, D] without sinks)
    codes: torch.Tensor  # the whole (over-allocated) packed buffers on the storage device, layouts as in
    scales: torch.Tensor  # kivi_xpu.storage.PackedHistory; only the first `count` tokens are valid
    zeros: torch.Tensor
    count: int  # packed tokens to read
    group: int  # group size of the packed codes
    bits: int
    tail: torch.Tensor  # [B, Hkv, T, D] exact, on the model's device (the window and this step's tokens)


@dataclass(frozen=True)
class DecodeInputs:
    """What one layer's ``update`` hands to the attention call that follows it: keys, values and the name of
    the backend whose kernels read the packed codes."""

    keys: KindInputs
    values: KindInputs
    backend: str


def dense_kind(inputs: KindInputs, kind: str, backend: str) -> torch.Tensor:
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
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)


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
    k, v = inputs.keys, inputs.values
    op = kernel("decode_attention", inputs.backend)
    return op(
        query,
        *(k.sinks, k.codes, k.scales, k.zeros, k.count, k.group, k.bits, k.tail),
        *(v.sinks, v.codes, v.scales, v.zeros, v.count, v.group, v.bits, v.tail),
        attention_mask,
        scaling,
        0.0 if softcap is None else float(softcap),
    )


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
        out = attend_tail_and_history(query, scaling, attention_mask, None, key, value, None, 0, softcap=softcap)
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


def masked_scores(scores: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """Applies a transformers mask (bool, True = attend; or additive float) to ``scores [B, Hq, L, n]``; without
    a mask the last ``L`` tokens are the queries themselves and attend causally."""
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


def attend_tail_and_history(
    query: torch.Tensor,
    scaling: float,
    attention_mask: torch.Tensor | None,
    key_scores_history,
    keys_tail: torch.Tensor,
    values_tail: torch.Tensor,
    value_sum_history,
    quantized_values: int,
    keys_sinks: torch.Tensor | None = None,
    values_sinks: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Softmax attention over ``[sinks | history | tail]`` (that order of positions, as the mask's columns) where
    the history is only reachable through two callables:
    ``key_scores_history(q [B, Hq, L, D] fp32) -> [B, Hq, L, Tk]`` and
    ``value_sum_history(p [B, Hq, L, Tv] fp32) -> [B, Hq, L, D]``. ``keys_sinks`` / ``values_sinks``
    ``[B, Hkv, S, D]`` (optional) and the tails ``[B, Hkv, *, D]`` are exact; without a history both callables
    are ``None``. ``softcap`` caps the scores as ``softcap * tanh(scores / softcap)`` (Gemma-2). Returns
    ``[B, Hq, L, D]`` in query's dtype.

    Keys and values have different quantized counts (KIVI quantizes keys in blocks, values one by one), so the
    probabilities of all ``n`` tokens are formed first (``n`` floats per query row: small) and split per side.
    """
    b, hq, length, _ = query.shape
    kv_heads = keys_tail.shape[1]
    q = query.float() * scaling
    grouped = group_queries(q, kv_heads)

    def exact_scores(keys: torch.Tensor) -> torch.Tensor:
        return (grouped @ keys.float().transpose(2, 3)).reshape(b, hq, length, -1)

    def exact_sum(p: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        return (group_queries(p, kv_heads) @ values.float()).reshape(b, hq, length, -1)

    sinks = 0 if keys_sinks is None else keys_sinks.shape[2]
    parts = [exact_scores(keys_sinks)] if sinks else []
    if key_scores_history is not None:
        parts.append(key_scores_history(q))
    parts.append(exact_scores(keys_tail))
    scores = torch.cat(parts, dim=-1)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = masked_scores(scores, attention_mask)
    # Rows the mask removes entirely (padding queries) attend to nothing: zeros instead of softmax's 0/0. NaN or
    # Inf anywhere else propagates, as in a dense softmax.
    fully_masked = (scores == float("-inf")).all(dim=-1, keepdim=True)
    probs = torch.softmax(scores, dim=-1).masked_fill_(fully_masked, 0.0)
    history_end = sinks + quantized_values
    out = exact_sum(probs[..., history_end:], values_tail)
    if sinks:
        out += exact_sum(probs[..., :sinks], values_sinks)
    if quantized_values:
        out += value_sum_history(probs[..., sinks:history_end].contiguous())
    return out.to(query.dtype)


def composed_decode_attention(
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
    mask: torch.Tensor | None,
    scaling: float,
    softcap: float,
    *,
    backend: str = "reference",
) -> torch.Tensor:
    """The ``decode_attention`` op composed from ``backend``'s ``packed_key_scores`` / ``packed_value_combine``
    kernels and :func:`attend_tail_and_history`.

    ``query [B, Hq, L, D]`` (unscaled) attends to ``[sinks | first count packed | tail]`` of each kind
    (:class:`KindInputs` describes the arguments); ``mask`` is ``None`` or a transformers mask whose last ``n``
    columns are used; ``softcap`` 0.0 means none. The packed codes stay on their (storage) device: the query and
    the probabilities go there and the results come back. Returns ``[B, Hq, L, Dv]`` in query's dtype.
    """
    key_scores_op = kernel("packed_key_scores", backend)
    value_combine_op = kernel("packed_value_combine", backend)

    def key_scores(q: torch.Tensor) -> torch.Tensor:
        q = q.to(key_codes.device)
        return key_scores_op(q, key_codes, key_scales, key_zeros, key_count, key_group, key_bits).to(query.device)

    def value_sum(p: torch.Tensor) -> torch.Tensor:
        p = p.to(value_codes.device)
        out = value_combine_op(p, value_codes, value_scales, value_zeros, value_count, value_group, value_bits)
        return out.to(query.device)

    return attend_tail_and_history(
        query,
        scaling,
        mask,
        key_scores,
        key_tail,
        value_tail,
        value_sum,
        value_count,
        keys_sinks=key_sinks,
        values_sinks=value_sinks,
        softcap=softcap or None,
    )
