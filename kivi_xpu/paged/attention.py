"""``"kivi_paged"``: the attention of continuous batching over KIVI pages.

The model calls ``KiviPagedCache.update`` and then this function with the flat batch ``query [1, Hq, sum(q_len), D]``
and the kwargs ``update`` filled: the batch's decode rows and one :class:`~kivi_xpu.paged.store.RequestStep` per other
request. Each request is computed as its own :class:`~kivi_xpu.KiviCache` would: a prompt chunk, however the scheduler
split the prompt, by transformers' SDPA over the exact states of the prompt so far, causal (KiviCache's prefill
attends the exact prompt); the decode rows of all requests by one ``paged_decode_attention`` call, each row over its
sinks, the pages of its block table read in place and its exact tail (the arithmetic of ``decode_attention``, the
fused path of ``attn_implementation="kivi"``); a multi-token append after the prompt by SDPA over the dense states,
the pages dequantized (KiviCache's path for it).
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from ..codec import dense_states
from ..ops import kernel
from ..ops.operands import DecodeInputs, decode_args
from .cache import STEP_KEY

ATTENTION_NAME = "kivi_paged"


def _chunk_mask(past: int, length: int, device) -> torch.Tensor:
    """Causal bool mask ``[1, 1, length, past + length]`` of a chunk of ``length`` queries after ``past`` tokens."""
    rows = torch.arange(length, device=device).unsqueeze(1) + past
    return (torch.arange(past + length, device=device).unsqueeze(0) <= rows)[None, None]


def kivi_paged_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                                 scaling: float | None = None, **kwargs):  # fmt: skip
    """transformers attention interface over the steps of ``kwargs["kivi_paged_step"]``: ``query [1, Hq, M, D]``
    -> ``([1, M, Hq, Dv], None)``."""
    step_of_layer = kwargs.get(STEP_KEY)
    if step_of_layer is None:
        raise RuntimeError(
            "attn_implementation 'kivi_paged' runs only under continuous batching with KIVI pages "
            "(kivi_xpu.paged.init_continuous_batching); use 'kivi' or 'sdpa' with model.generate"
        )
    if kwargs.get("softcap") is not None or kwargs.get("sliding_window") is not None:
        raise ValueError("KIVI pages do not support logit soft-capping or sliding-window layers")
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    op = kernel("decode_attention", step_of_layer.backend)
    out = torch.empty(1, query.shape[2], query.shape[1], value.shape[-1], dtype=query.dtype, device=query.device)
    decode = step_of_layer.decode
    if decode is not None:  # every decode row of the batch in one call, each over its own pages
        rows = query[0, :, decode.q_index].transpose(0, 1).unsqueeze(2)  # [N, Hq, 1, D]
        paged = kernel("paged_decode_attention", step_of_layer.backend)
        result = paged(rows, *decode.args, scaling, *step_of_layer.rotations)
        out[0, decode.q_index] = result[:, :, 0]
    for step in step_of_layer.requests:
        rows = query[:, :, step.q_start : step.q_start + step.q_len]
        if step.prompt:  # the exact prompt so far; these rows are its last q_len tokens
            past = step.keys.shape[2] - step.q_len
            mask = _chunk_mask(past, step.q_len, query.device) if past else None
            result, _ = sdpa_attention_forward(
                module, rows, step.keys, step.values, mask, scaling=scaling, is_causal=not past
            )
        elif step.q_len == 1:  # a decode row before the sinks are full
            result = op(rows, *decode_args(step.keys, step.values, None, scaling, 0.0)).transpose(1, 2)
        else:  # a multi-token append after the prompt: SDPA over the dense states (the history dequantized)
            past = step.keys.sinks.shape[2] + step.keys.count + step.keys.tail.shape[2] - step.q_len
            keys, values = dense_states(DecodeInputs(step.keys, step.values, step_of_layer.backend))
            mask = _chunk_mask(past, step.q_len, query.device)
            result, _ = sdpa_attention_forward(module, rows, keys, values, mask, scaling=scaling, is_causal=False)
        out[:, step.q_start : step.q_start + step.q_len] = result
    return out, None


def register() -> None:
    """Registers ``"kivi_paged"`` with transformers' attention and mask interfaces (idempotent)."""
    AttentionInterface.register(ATTENTION_NAME, kivi_paged_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
