"""Pure-PyTorch twin of the native fused decode attention (``kivi_xpu._cpu.decode_attention``): the ground truth
its tests compare against. It dequantizes the packed history densely and runs a plain masked softmax.

A layer holds ``n`` positions: ``[sinks | packed history | exact tail]``. Keys and values are packed to different
counts (keys in whole groups of tokens, values token by token), so each side has its own split of the same ``n``.

NaN rule: a NaN or +-Inf reaching a row's softmax propagates exactly as in a dense softmax (the row becomes NaN);
only a row whose every score is ``-inf`` after the mask (a padding query) gives zeros.
"""

from __future__ import annotations

import torch

from .reference import dequantize_keys, dequantize_values, group_queries


def _exact(t: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    if t is None:
        return like.new_zeros(like.shape[0], like.shape[1], 0, like.shape[3], dtype=torch.float32)
    return t.float()


def _masked(scores: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """The last ``n`` columns of a bool (True = attend) or additive float ``mask``; without one, ``L == 1``
    attends everything and ``L > 1`` is causal with the queries being the last ``L`` positions."""
    length, n = scores.shape[-2:]
    if mask is not None:
        mask = mask[..., mask.shape[-1] - n :]
        if mask.dtype == torch.bool:
            return scores.masked_fill(~mask, float("-inf"))
        return scores + mask.float()
    if length == 1:
        return scores
    causal = torch.ones(length, n, dtype=torch.bool, device=scores.device).tril(n - length)
    return scores.masked_fill(~causal, float("-inf"))


def decode_attention_reference(
    query: torch.Tensor,
    key_sinks: torch.Tensor | None,
    key_codes: torch.Tensor,
    key_scales: torch.Tensor,
    key_zeros: torch.Tensor,
    key_count: int,
    key_group: int,
    key_bits: int,
    key_tail: torch.Tensor,
    value_sinks: torch.Tensor | None,
    value_codes: torch.Tensor,
    value_scales: torch.Tensor,
    value_zeros: torch.Tensor,
    value_count: int,
    value_group: int,
    value_bits: int,
    value_tail: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float,
    softcap: float | None,
) -> torch.Tensor:
    """Softmax attention of ``query [B, Hq, L, D]`` over a KIVI layer.

    Args:
        key_sinks, value_sinks: ``[B, Hkv, S, D]`` exact first tokens (or ``None``: no sinks).
        key_codes, key_scales, key_zeros: packed per-channel keys (``quantize_keys`` layout, possibly
            over-allocated), of which the first ``key_count`` tokens are positions ``[S, S + key_count)``.
        key_tail: ``[B, Hkv, Tk, D]`` exact keys at ``[S + key_count, n)``.
        value_*: the same for per-token values (``quantize_values`` layout), ``[B, Hkv, Tv, Dv]`` tail.
        mask: ``[B or 1, 1 or Hq, L, >= n]`` bool (True = attend) or additive float, last ``n`` columns used.
        scaling: multiplies the scores; softcap: ``softcap * tanh(scores / softcap)`` before the mask (0/None: off).
    Returns:
        ``[B, Hq, L, Dv]`` in query's dtype.
    """
    b, hq, length, _ = query.shape
    kv_heads = key_tail.shape[1]
    keys = torch.cat(
        [
            _exact(key_sinks, key_tail),
            dequantize_keys(key_codes, key_scales, key_zeros, key_count, key_group, key_bits),
            key_tail.float(),
        ],
        dim=2,
    )
    values = torch.cat(
        [
            _exact(value_sinks, value_tail),
            dequantize_values(value_codes, value_scales, value_zeros, value_count, value_group, value_bits),
            value_tail.float(),
        ],
        dim=2,
    )
    if keys.shape[2] != values.shape[2]:
        raise ValueError(f"keys cover {keys.shape[2]} positions but values cover {values.shape[2]}")
    q = group_queries(query.float() * scaling, kv_heads)
    scores = (q @ keys.transpose(2, 3)).reshape(b, hq, length, -1)
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    scores = _masked(scores, mask)
    probs = torch.softmax(scores, dim=-1)
    out = (group_queries(probs, kv_heads) @ values).reshape(b, hq, length, -1)
    fully_masked = (scores == float("-inf")).all(dim=-1, keepdim=True)
    return out.masked_fill(fully_masked, 0.0).to(query.dtype)
