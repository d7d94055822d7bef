"""The attention functions of the fused path and their registration with transformers.

:func:`kivi_attention_forward` (``attn_implementation="kivi"``) and :func:`default_attention_forward` (transformers'
``"sdpa"`` while kivi_xpu is imported) attend a step a KIVI layer handed over (:mod:`.hand_over`) through the
``decode_attention`` op, which scores the packed keys and sums the packed values in place: no dense copy of the
quantized history is ever built. Everything else (prefill, other caches, sliding-window layers, dropout) goes to
transformers' SDPA attention unchanged, so both functions are safe on any model.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from ..codec import dense_states
from ..ops import kernel
from ..ops.operands import DecodeInputs, decode_args
from ..ops.reference import dense_attention, masked_scores, softmax_rows
from .hand_over import take_over
from .path import ATTENTION_NAME


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
