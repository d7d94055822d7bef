"""SYCL implementations of the ops (kernels in ``csrc/``, host code ``kivi_xpu._C``).

The SYCL device follows the tensors' device (:func:`kivi_xpu.runtime.sycl_runtime_for`): CPU tensors run on the host
SYCL device (the OpenCL CPU device), ``xpu`` tensors on the Level Zero GPU of the same index. Arguments arrive
checked (:mod:`.declarations`); outputs are allocated by each op's shape rule and filled by ``kivi_xpu._C``, which
waits for each kernel to finish.
"""

from __future__ import annotations

import torch

from ..rotation import rotate, unrotate
from ..runtime import SyclRuntime, sycl_runtime_for
from .checks import codes_per_byte, split_decode_args
from .library import OPS, register_kernel
from .reference import group_queries, masked_scores, softmax_rows, store_value_rows

# packed_value_combine splits the token loop into chunks whose partial sums are added afterwards (in order), so that a
# decode step (few kv heads, one query row) still spreads over all cores / EUs. Each chunk is a work-group with a fixed
# start-up cost, so chunks are as long as possible while leaving VALUE_GROUPS_PER_UNIT work-groups per compute unit
# (load balance), and at least VALUE_CHUNK_TOKENS long (on the 2-core CPU device 1024-token chunks ran ~1.5x faster
# than 256-token ones).
VALUE_CHUNK_TOKENS = 256
VALUE_GROUPS_PER_UNIT = 4


def value_chunk_tokens(num_tokens: int, kv_heads: int, compute_units: int) -> int:
    """Chunk length for ``kv_heads`` (batch x kv heads) independent token loops of ``num_tokens`` tokens."""
    chunks = max(1, -(-VALUE_GROUPS_PER_UNIT * compute_units // max(kv_heads, 1)))
    return max(VALUE_CHUNK_TOKENS, -(-num_tokens // chunks))


def _runtime(name: str, tensor: torch.Tensor) -> SyclRuntime:
    """The SYCL device serving ``tensor`` (the op's first argument, called ``name``), which must be able to read it
    (the extension re-checks every pointer precisely)."""
    if tensor.device.type not in ("cpu", "xpu"):
        raise ValueError(f"`{name}` is on {tensor.device}, which no SYCL device can access (expected cpu or xpu)")
    rt = sycl_runtime_for(tensor.device)
    if tensor.device.type == "cpu" and not rt.facts.usm_system_allocations:
        raise ValueError(
            f"`{name}` is a CPU tensor but SYCL device {rt.device} ({rt.facts.name}) cannot access host memory"
        )
    return rt


def _quantize(op: str):
    def run(x, group_size, bits, meta_dtype):
        rt = _runtime("x", x)
        x = x.contiguous()
        codes, scales, zeros = OPS[op].outputs(x, group_size, bits, meta_dtype)
        if x.numel() > 0:
            getattr(rt.module, op)(rt.device, x, codes, scales, zeros, group_size, bits)
        return codes, scales, zeros

    return run


def _dequantize(op: str):
    def run(codes, scales, zeros, num_tokens, group_size, bits, out_dtype):
        rt = _runtime("codes", codes)
        out = OPS[op].outputs(codes, scales, zeros, num_tokens, group_size, bits, out_dtype)
        if out.numel() > 0:
            getattr(rt.module, op)(rt.device, codes, scales, zeros, out, num_tokens, group_size, bits)
        return out

    return run


for _kind in ("keys", "values"):
    register_kernel(f"quantize_{_kind}", "sycl")(_quantize(f"quantize_{_kind}"))
    register_kernel(f"dequantize_{_kind}", "sycl")(_dequantize(f"dequantize_{_kind}"))


@register_kernel("quantize_values_into", "sycl")
def quantize_values_into(x, codes, scales, zeros, offset, group_size, bits, rotation=None):
    """The SYCL value quantizer, then copies into the storage rows (no in-place SYCL kernel yet). A rotation is
    applied with torch first: the SYCL quantize kernel reads x as it is, and this path already costs several torch
    calls per token, so one more matmul is no regression."""
    x = rotate(x, rotation)
    parts = _quantize("quantize_values")(x, group_size, bits, scales.dtype)
    store_value_rows(parts, (codes, scales, zeros), offset)


@register_kernel("packed_key_scores", "sycl")
def packed_key_scores(query, codes, scales, zeros, num_tokens, group_size, bits):
    rt = _runtime("query", query)
    query = query.contiguous()
    out = OPS["packed_key_scores"].outputs(query, codes, scales, zeros, num_tokens, group_size, bits)
    if out.numel() > 0:
        rt.module.packed_key_scores(rt.device, query, codes, scales, zeros, out, num_tokens, group_size, bits)
    return out


@register_kernel("packed_value_combine", "sycl")
def packed_value_combine(probs, codes, scales, zeros, num_tokens, group_size, bits):
    rt = _runtime("probs", probs)
    probs = probs.contiguous()
    b, hq, length, _ = probs.shape
    head_dim = codes.shape[3] * codes_per_byte(bits)
    if num_tokens == 0 or probs.numel() == 0:
        return torch.zeros((b, hq, length, head_dim), dtype=torch.float32, device=probs.device)
    chunk_tokens = value_chunk_tokens(num_tokens, b * codes.shape[1], rt.facts.max_compute_units)
    chunks = -(-num_tokens // chunk_tokens)
    partial = torch.empty((b, hq, length, chunks, head_dim), dtype=torch.float32, device=probs.device)
    rt.module.packed_value_combine(
        rt.device, probs, codes, scales, zeros, partial, num_tokens, group_size, bits, chunk_tokens
    )
    # Chunk sums in order (deterministic).
    return partial.view(b, hq, length, head_dim) if chunks == 1 else partial.sum(dim=3)


@register_kernel("decode_attention", "sycl")
def decode_attention(query, *args):
    """The two SYCL attention kernels composed: scores of ``[sinks | packed keys | key tail]``, one softmax, then
    ``[sinks | packed values | value tail]`` combined. The packed history stays on its (storage) device; the exact
    parts and the result on the query's device. A rotated history is scored with the rotated query, and its values'
    weighted sum is rotated back (:mod:`kivi_xpu.rotation`)."""
    keys, values, mask, scaling, softcap = split_decode_args(args)
    b, hq, length, _ = query.shape
    kv_heads = keys.tail.shape[1]
    q = query.float() * scaling
    grouped = group_queries(q, kv_heads)

    def exact_scores(k):
        return (grouped @ k.float().transpose(2, 3)).reshape(b, hq, length, -1)

    def exact_sum(p, v):
        return (group_queries(p, kv_heads) @ v.float()).reshape(b, hq, length, -1)

    sinks = keys.sinks.shape[2]
    parts = [exact_scores(keys.sinks)] if sinks else []
    if keys.count:
        q_storage = rotate(q, keys.rotation).to(keys.codes.device)  # q·k = (qQ)·(kQ): score the rotated codes
        history = packed_key_scores(q_storage, keys.codes, keys.scales, keys.zeros, keys.count, keys.group, keys.bits)
        parts.append(history.to(query.device))
    parts.append(exact_scores(keys.tail))
    scores = torch.cat(parts, dim=-1)
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    probs = softmax_rows(masked_scores(scores, mask))
    history_end = sinks + values.count
    out = exact_sum(probs[..., history_end:], values.tail)
    if sinks:
        out += exact_sum(probs[..., :sinks], values.sinks)
    if values.count:
        p = probs[..., sinks:history_end].contiguous().to(values.codes.device)
        combined = packed_value_combine(
            p, values.codes, values.scales, values.zeros, values.count, values.group, values.bits
        )
        out += unrotate(combined.to(query.device), values.rotation)  # (Σ p vQ) Qᵀ
    return out.to(query.dtype)
