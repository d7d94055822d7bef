"""Pure-PyTorch twin of the native decode attention's integer arithmetic (``KIVI_XPU_CPU_DOT=int8``, the default
on AVX2 and AVX-512; csrc/cpu/decode_int8.h): the same 8-bit rounding of the query and of the probabilities, in the
same groups and blocks, with the same fallbacks to fp32. Tests compare the kernel with it on fuzzed shapes, and it
states exactly what the integer path computes; :func:`kivi_xpu.ops.reference.decode_attention` stays the fp32
ground truth (what the ``fp32`` arithmetic and the baseline ISA compute).

Packed keys, group ``g`` of ``G`` tokens, query row ``r`` (scaled, and rotated when the keys are)::

    qs = q_r * s_g                       (channel-wise, fp32)
    m  = max |qs|;  qi = round(qs * (127 / m));  a = m / 127          (qi = 0 where m == 0; round half to even)
    score_t = a * sum_d qi_d c_td + sum_d q_rd z_gd

Packed values, per kernel chunk (tokens ``[k * chunk, (k + 1) * chunk)`` past the sinks, ``chunk`` as
:func:`chunk_tokens`) in blocks of ``B`` tokens from the chunk's start (32 for 2-bit codes, 16 for 4-bit), per row
``r`` and channel group ``g``::

    w_t = p_rt * s_tg;  m = max_t w_t;  wi_t = round(w_t * (255 / m));  b = m / 255
    out_rd += b * sum_{t in block} wi_t c_td + sum_t p_rt z_tg

where ``p`` are the softmax probabilities (the kernel's are relative to its chunk's maximum; the factors are the same
up to fp32 rounding because ``round(w * 255 / m)`` does not change when every ``w`` of a block is scaled alike).
Fallbacks to the fp32 products, for a set of (up to 4) query rows the kernel handles together: a key group where
one of their ``q * s`` is not finite; a value chunk where one of their weights ``p * s`` is not finite. The integer
path serves 2- and 4-bit codes whose key groups hold a multiple of ``64 / bits`` tokens with ``head_dim % 4 == 0``,
and value groups a multiple of ``64 / bits`` channels; other settings take the fp32 path."""

from __future__ import annotations

import torch

from ..rotation import unrotate
from .library import takes_arguments_of
from .operands import split_decode_args
from .reference import group_queries, masked_scores, softmax_rows, unpack

KEY_FACTOR_MAX = 127  # signed query factors
VALUE_FACTOR_MAX = 255  # unsigned probability factors
ROWS_PER_PASS = 4  # query rows of one kv head the kernel handles together


def integer_keys(bits: int, group: int, head_dim: int) -> bool:
    """Whether the integer path scores packed keys of these settings (decode_int8.h ``integer_keys``)."""
    return bits in (2, 4) and head_dim % 4 == 0 and group % (64 // bits) == 0


def integer_values(bits: int, group: int) -> bool:
    """Whether the integer path combines packed values of these settings (decode_int8.h ``integer_values``)."""
    return bits in (2, 4) and group % (64 // bits) == 0


def value_block(bits: int) -> int:
    """Tokens per block of probability factors (their int16 sums stay exact)."""
    return 32 if bits == 2 else 16


# The native kernel's split of the positions past the sinks (csrc/cpu/decode_problem.cpp, chunk_tokens).
MIN_CHUNK, MAX_CHUNK, MIN_TASKS = 256, 4096, 12


def chunk_tokens(tokens: int, key_group: int, heads: int) -> int:
    """Tokens per chunk of the native kernel for ``tokens`` positions past the sinks of ``heads`` (batch x kv heads)
    histories: at least MIN_TASKS chunks in all, each 256-4096 positions, rounded up to whole key groups."""
    if heads <= 0:  # an empty batch: no chunk is read
        return key_group
    per_head = max(1, -(-MIN_TASKS // heads))
    chunk = min(max(-(-tokens // per_head), MIN_CHUNK), MAX_CHUNK)
    return key_group * max(1, -(-chunk // key_group))


def _by_row_sets(ok: torch.Tensor) -> torch.Tensor:
    """``ok [B, H, rows, ...]`` -> the same shape, each row's entry ANDed over its set of ROWS_PER_PASS rows (the
    kernel decides each fallback once per set of rows it processes together)."""
    out = ok.clone()
    for r0 in range(0, ok.shape[2], ROWS_PER_PASS):
        out[:, :, r0 : r0 + ROWS_PER_PASS] = ok[:, :, r0 : r0 + ROWS_PER_PASS].all(dim=2, keepdim=True)
    return out


def _round_factors(x: torch.Tensor, peak: torch.Tensor, top: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``round(x * (top / peak))`` and ``peak / top``, with factors 0 where ``peak`` is 0."""
    inv = torch.where(peak > 0, top / torch.where(peak > 0, peak, 1.0), 0.0)
    return torch.round(x * inv.unsqueeze(-2)), peak / top


def packed_key_scores(q, codes, scales, zeros, count: int, group: int, bits: int) -> torch.Tensor:
    """Scores of ``q [B, Hkv, rows, D]`` (fp32) against the first ``count`` packed keys -> ``[B, Hkv, rows, count]``,
    on the integer path where the settings allow it."""
    b, h, rows, dim = q.shape
    groups = count // group
    c = unpack(codes[..., : count // (8 // bits)], 3, bits).float().reshape(b, h, dim, groups, group)
    s = scales[..., :groups].float()
    bias = torch.einsum("bhrd,bhdg->bhrg", q, zeros[..., :groups].float())
    qs = q.unsqueeze(-1) * s.unsqueeze(2)  # [B, H, rows, D, groups]
    exact = torch.einsum("bhrdg,bhdgt->bhrgt", qs, c) + bias.unsqueeze(-1)
    if not integer_keys(bits, group, dim):
        return exact.reshape(b, h, rows, count)
    peak = qs.abs().amax(dim=3)  # [B, H, rows, groups]
    qi, a = _round_factors(qs, peak, KEY_FACTOR_MAX)
    integer = a.unsqueeze(-1) * torch.einsum("bhrdg,bhdgt->bhrgt", qi, c) + bias.unsqueeze(-1)
    finite = _by_row_sets(torch.isfinite(qs).all(dim=3))  # [B, H, rows, groups]
    return torch.where(finite.unsqueeze(-1), integer, exact).reshape(b, h, rows, count)


def packed_value_sum(p, codes, scales, zeros, count: int, group: int, bits: int, chunk: int) -> torch.Tensor:
    """``p [B, Hkv, rows, count] @ dequantized values`` -> ``[B, Hkv, rows, Dv]``, on the integer path where the
    settings allow it (blocks as the kernel's, in its chunks of ``chunk`` tokens)."""
    c = unpack(codes[:, :, :count], 3, bits).float()  # [B, H, count, Dv]
    s = scales[:, :, :count].float()  # [B, H, count, groups]
    zero_part = torch.einsum("bhrt,bhtg->bhrg", p, zeros[:, :, :count].float()).repeat_interleave(group, dim=-1)
    exact = torch.einsum("bhrt,bhtd->bhrd", p, c * s.repeat_interleave(group, dim=-1))
    if not integer_values(bits, group):
        return exact + zero_part
    block = value_block(bits)
    total = torch.zeros_like(exact)
    for c0 in range(0, count, chunk):
        c1 = min(c0 + chunk, count)
        w = p[..., c0:c1].unsqueeze(-1) * s[:, :, None, c0:c1]  # [B, H, rows, T, groups]
        finite = _by_row_sets(torch.isfinite(w).flatten(3).all(dim=3)).unsqueeze(-1)  # [B, H, rows, 1]
        integer = torch.zeros_like(exact)
        for t0 in range(c0, c1, block):
            t1 = min(t0 + block, c1)
            wb = w[..., t0 - c0 : t1 - c0, :]
            wi, b = _round_factors(wb, wb.amax(dim=3), VALUE_FACTOR_MAX)
            sums = torch.einsum("bhrtd,bhtd->bhrd", wi.repeat_interleave(group, dim=-1), c[:, :, t0:t1])
            integer += b.repeat_interleave(group, dim=-1) * sums
        chunk_exact = torch.einsum(
            "bhrt,bhtd->bhrd", p[..., c0:c1], (c * s.repeat_interleave(group, dim=-1))[:, :, c0:c1]
        )
        total += torch.where(finite, integer, chunk_exact)
    return total + zero_part


@takes_arguments_of("decode_attention")
def decode_attention(query, *args) -> torch.Tensor:
    """The arguments and result of :func:`kivi_xpu.ops.reference.decode_attention`, computed as the native kernel's
    integer path does (see the module docstring)."""
    keys, values, mask, scaling, softcap = split_decode_args(args)
    b, hq, length, _ = query.shape
    kv_heads = keys.tail.shape[1]
    q = group_queries(query.float() * scaling, kv_heads)
    packed_q = q if keys.rotation is None else q @ keys.rotation.float()
    parts = [] if keys.sinks is None else [q @ keys.sinks.float().transpose(2, 3)]
    if keys.count:
        parts.append(packed_key_scores(packed_q, *keys[1:7]))  # codes, scales, zeros, count, group, bits
    parts.append(q @ keys.tail.float().transpose(2, 3))
    scores = torch.cat(parts, dim=-1).reshape(b, hq, length, -1)
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    p = group_queries(softmax_rows(masked_scores(scores, mask)), kv_heads)
    sinks = 0 if keys.sinks is None else keys.sinks.shape[2]
    out = p[..., sinks + values.count :] @ values.tail.float()
    if sinks:
        out = out + p[..., :sinks] @ values.sinks.float()
    if values.count:
        chunk = chunk_tokens(p.shape[-1] - sinks, keys.group, b * kv_heads)
        history = p[..., sinks : sinks + values.count]
        packed = packed_value_sum(history, *values[1:7], chunk)  # as the keys
        out = out + unrotate(packed, values.rotation)
    return out.reshape(b, hq, length, -1).to(query.dtype)
