"""The attention of one layer over KIVI pages, whatever the engine: each request as its own
:class:`~kivi_xpu.KiviCache` computes it.

An engine's adapter stores the layer's new tokens with :class:`~kivi_xpu.paged.store.PageWriter`, which returns a
:class:`LayerStep`, and calls :func:`attend` with the flat batch of queries and its own SDPA (transformers' for
continuous batching, torch's for vLLM; how each repeats KV heads is its own):

* the decode rows of all requests: one ``paged_decode_attention`` call, each row over its sinks, the pages of its
  block table read in place and its exact tail (the arithmetic of ``decode_attention``, the fused path of
  ``attn_implementation="kivi"``);
* a prompt chunk, however the scheduler split the prompt: SDPA over the exact states of the prompt so far, causal
  (KiviCache's prefill attends the exact prompt);
* a decode row before the sinks are full: ``decode_attention`` over its operands;
* a multi-token append after the prompt: SDPA over the dense states, the pages dequantized (KiviCache's path).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ..codec import dense_states
from ..ops import kernel
from ..ops.operands import DecodeInputs, decode_args
from .store import DecodeRows, RequestStep

# sdpa(rows [1, Hq, m, D], keys [1, H, n, D], values [1, H, n, Dv], mask bool [1, 1, m, n] | None, is_causal)
#   -> [1, m, Hq, Dv]
Sdpa = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, bool], torch.Tensor]


class LayerStep(NamedTuple):
    """What a layer's store leaves for its attention: the backend whose kernels read the pages, the batch's decode
    rows (or ``None``) and one :class:`~kivi_xpu.paged.store.RequestStep` per other request."""

    backend: str
    decode: DecodeRows | None
    requests: list[RequestStep]
    rotations: tuple  # (key rotation, value rotation): None or Q [D, D] float32


def chunk_mask(past: int, length: int, device) -> torch.Tensor:
    """Causal bool mask ``[1, 1, length, past + length]`` of a chunk of ``length`` queries after ``past`` tokens."""
    rows = torch.arange(length, device=device).unsqueeze(1) + past
    return (torch.arange(past + length, device=device).unsqueeze(0) <= rows)[None, None]


def chunk_attention(rows: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """The attention of a chunk after ``past = n - m`` positions, as under :func:`chunk_mask`: ``rows [1, Hq, m, D]``
    over ``keys`` / ``values [1, H, n, D]`` (``Hq`` a multiple of ``H``) -> ``[1, Hq, m, Dv]``. On CPU, as two
    flash attentions merged by their log-sum-exp: the past unmasked, the chunk causal (an SDPA with the mask computes
    every block of the rectangle: about twice the time for a chunk as long as its past)."""
    m, n = rows.shape[2], keys.shape[2]
    past, repeat = n - m, rows.shape[1] // keys.shape[1]
    if rows.device.type != "cpu":
        return F.scaled_dot_product_attention(rows, keys, values, attn_mask=chunk_mask(past, m, rows.device),
                                              scale=scale, enable_gqa=True)  # fmt: skip
    if repeat > 1:
        keys, values = keys.repeat_interleave(repeat, 1), values.repeat_interleave(repeat, 1)
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    chunk, chunk_lse = flash(rows, keys[:, :, past:], values[:, :, past:], is_causal=True, scale=scale)
    if not past:
        return chunk
    before, before_lse = flash(rows, keys[:, :, :past], values[:, :, :past], scale=scale)
    total = torch.logaddexp(before_lse, chunk_lse)
    merged = before.float() * (before_lse - total).exp_().unsqueeze(-1)
    merged += chunk.float() * (chunk_lse - total).exp_().unsqueeze(-1)
    return merged.to(rows.dtype)


def attend(step: LayerStep, query: torch.Tensor, scaling: float, sdpa: Sdpa, value_dim: int) -> torch.Tensor:
    """The layer's attention of the flat batch ``query [1, Hq, M, D]`` -> ``[1, M, Hq, value_dim]``."""
    out = torch.empty(1, query.shape[2], query.shape[1], value_dim, dtype=query.dtype, device=query.device)
    decode = step.decode
    if decode is not None:  # every decode row of the batch in one call, each over its own pages
        rows = query[0, :, decode.q_index].transpose(0, 1).unsqueeze(2)  # [N, Hq, 1, D]
        paged = kernel("paged_decode_attention", step.backend)
        out[0, decode.q_index] = paged(rows, *decode.args, scaling, *step.rotations)[:, :, 0]
    for request in step.requests:
        rows = query[:, :, request.q_start : request.q_start + request.q_len]
        if request.prompt:  # the exact prompt so far; these rows are its last q_len tokens
            past = request.keys.shape[2] - request.q_len
            mask = chunk_mask(past, request.q_len, query.device) if past else None
            result = sdpa(rows, request.keys, request.values, mask, not past)
        elif request.q_len == 1:  # a decode row before the sinks are full
            op = kernel("decode_attention", step.backend)
            result = op(rows, *decode_args(request.keys, request.values, None, scaling, 0.0)).transpose(1, 2)
        else:  # a multi-token append after the prompt: SDPA over the dense states (the history dequantized)
            keys_held = request.keys
            past = keys_held.sinks.shape[2] + keys_held.count + keys_held.tail.shape[2] - request.q_len
            keys, values = dense_states(DecodeInputs(request.keys, request.values, step.backend))
            result = sdpa(rows, keys, values, chunk_mask(past, request.q_len, query.device), False)
        out[:, request.q_start : request.q_start + request.q_len] = result
    return out
