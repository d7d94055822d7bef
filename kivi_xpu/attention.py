"""Fused KIVI attention for transformers: attention computed straight from the packed history.

``model.set_attn_implementation("kivi")`` (or :func:`use_fused_attention`) makes the model's attention modules
call :func:`kivi_attention_forward`. With a :class:`~kivi_xpu.KiviCache` built from that model's config, each
``KiviLayer.update`` then returns only the full-precision tail (window + new tokens) and hands the layer over
to the attention function, which scores the packed keys and sums the packed values in place: no dense copy of
the quantized history is ever built. Everything else (prefill, other caches, sliding-window layers, dropout)
goes to transformers' SDPA attention unchanged, so the implementation is safe to set on any model.

The hand-over: the attention function never receives the cache, only the module and the tensors ``update``
returned. ``update`` records ``(layer, keys it returned)`` in a thread-local slot; the attention function takes
the slot and uses it only if the key tensor it received is that very object.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .ops.reference import group_queries, masked_scores, softmax_rows

ATTENTION_NAME = "kivi"


@dataclass
class FusedStep:
    """What one layer's ``update`` hands to the attention call that follows it."""

    layer: object  # the KiviLayer
    keys_tail: torch.Tensor  # [B, Hkv, n - sinks - quantized_keys, D], full precision
    values_tail: torch.Tensor  # [B, Hkv, n - sinks - quantized_values, D]
    quantized_keys: int  # packed tokens attention reads (the count before this step's flush)
    quantized_values: int
    keys_sinks: torch.Tensor | None = None  # [B, Hkv, sinks, D], the first tokens kept exact (None: no sinks)
    values_sinks: torch.Tensor | None = None


_slot = threading.local()


def hand_over(step: FusedStep) -> None:
    _slot.step = step


def take_over(key: torch.Tensor) -> FusedStep | None:
    """The step the preceding ``update`` handed over (``None`` if there is none); clears the slot."""
    step = getattr(_slot, "step", None)
    _slot.step = None
    if step is not None and step.keys_tail is not key:
        # The model changed the keys between `update` and attention: the tail alone would be silently wrong.
        raise RuntimeError(
            "kivi attention: the keys reaching attention are not those KiviCache.update returned (this model "
            "transforms them in between), so the fused path cannot be used: build the cache with "
            "KiviCache(..., attention='dense') or use another attn_implementation"
        )
    return step


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
    step = take_over(key)
    softcap = kwargs.get("softcap")
    if step is not None and (dropout > 0 or kwargs.get("sliding_window") is not None):
        key, value = step.layer.dense_states(step)  # the layer returned only its tail: rebuild the dense states
        step = None
    if step is None and (softcap is None or dropout > 0):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    if step is None:  # logit soft-capping (Gemma-2), which SDPA lacks: exact attention with explicit scores
        out = attend_tail_and_history(query, scaling, attention_mask, None, key, value, None, 0, softcap=softcap)
    else:
        out = step.layer.fused_attention(step, query, attention_mask, scaling, softcap)
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Registers ``"kivi"`` with transformers' attention and mask interfaces (idempotent)."""
    AttentionInterface.register(ATTENTION_NAME, kivi_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)


def use_fused_attention(model) -> None:
    """Switches ``model`` to the fused KIVI attention (``model.set_attn_implementation("kivi")``)."""
    register()
    model.set_attn_implementation(ATTENTION_NAME)


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
    probs = softmax_rows(scores)  # fully masked rows (padding queries) give zeros; NaN elsewhere propagates
    history_end = sinks + quantized_values
    out = exact_sum(probs[..., history_end:], values_tail)
    if sinks:
        out += exact_sum(probs[..., :sinks], values_sinks)
    if quantized_values:
        out += value_sum_history(probs[..., sinks:history_end].contiguous())
    return out.to(query.dtype)
