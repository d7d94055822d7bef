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
from .checks import codes_per_byte
from .library import OPS, register_kernel
from .operands import KindOperands, RequestColumns, split_decode_args
from .reference import (
    composed_decode_step,
    group_queries,
    masked_scores,
    softmax_rows,
    store_value_rows,
)

# packed_value_combine splits the token loop into chunks whose partial sums are added afterwards (in order), so that a
# decode step (few kv heads, one query row) still spreads over all cores / EUs. Each chunk is a work-group with a fixed
# start-up cost, so chunks are as long as possible while leaving VALUE_GROUPS_PER_UNIT work-groups per compute unit
# (load balance), and at least VALUE_CHUNK_TOKENS long (longer chunks ran faster on the CPU device:
# docs/measurements.md).
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
    def run(x, group_size, bits, meta_dtype, fit="minmax"):
        rt = _runtime("x", x)
        x = x.contiguous()
        codes, scales, zeros = OPS[op].outputs(x, group_size, bits, meta_dtype, fit)
        if x.numel() > 0:
            getattr(rt.module, op)(rt.device, x, codes, scales, zeros, group_size, bits, fit == "least_squares")
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
def quantize_values_into(x, codes, scales, zeros, offset, group_size, bits, rotation=None, fit="minmax"):
    """The SYCL value quantizer, then copies into the storage rows (no in-place SYCL kernel yet). A rotation is
    applied with torch first: the SYCL quantize kernel reads x as it is, and this path already costs several torch
    calls per token, so one more matmul is no regression."""
    x = rotate(x, rotation)
    parts = _quantize("quantize_values")(x, group_size, bits, scales.dtype, fit)
    store_value_rows(parts, (codes, scales, zeros), offset)


# The windows stay on the model's device, the codes on the SYCL device: torch copies, the SYCL quantizer.
register_kernel("append_decode_step", "sycl")(composed_decode_step(quantize_values_into))


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


# The fused decode attention splits the packed tokens into chunks of at most FUSED_MAX_CHUNK (the kernel's local score
# rows), as long as possible while leaving FUSED_GROUPS_PER_UNIT work-groups per compute unit.
FUSED_MAX_CHUNK = 512
FUSED_MIN_CHUNK = 64
FUSED_GROUPS_PER_UNIT = 4


def fused_chunk_tokens(num_tokens: int, work_rows: int, compute_units: int) -> int:
    """Chunk length (a multiple of 8 in [64, 512]) for ``work_rows`` (batch x kv heads x row blocks) token loops."""
    chunks = max(1, -(-FUSED_GROUPS_PER_UNIT * compute_units // max(work_rows, 1)))
    tokens = -(-num_tokens // chunks)
    return min(FUSED_MAX_CHUNK, max(FUSED_MIN_CHUNK, -(-tokens // 8) * 8))


def _packed_bias(mask: torch.Tensor, device) -> torch.Tensor:
    """A transformers mask's packed columns as the kernel's float32 bias: a bool mask as 0 / -inf (the kernel then
    sets, not adds, -inf: a masked NaN score is ignored as in the dense path), a float mask as it is (added)."""
    if mask.dtype == torch.bool:
        bias = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device).masked_fill_(~mask, float("-inf"))
    else:
        bias = mask.float()
    return bias.to(device)


def _packed_only(kind: KindOperands, name: str, count: int, device) -> list[torch.Tensor]:
    """``kind``'s packed tokens past the first ``count`` (those the other kind holds exactly: values leave the window
    token by token, keys a group at a time), dequantized and rotated back: ``[]`` or ``[B, Hkv, n, D]`` float32."""
    if kind.count == count:
        return []
    if name == "keys":  # channel-major codes: dequantized whole (rare: values normally leave the window first)
        tokens = _dequantize("dequantize_keys")(
            kind.codes, kind.scales, kind.zeros, kind.count, kind.group, kind.bits, torch.float32
        )[:, :, count:]
    else:
        rows = (part[:, :, count : kind.count].contiguous() for part in (kind.codes, kind.scales, kind.zeros))
        tokens = _dequantize("dequantize_values")(*rows, kind.count - count, kind.group, kind.bits, torch.float32)
    return [unrotate(tokens.to(device), kind.rotation)]


def fused_decode_attention(query, *args):
    """One fused SYCL kernel over the packed history (``kivi_packed_attention``: scores, softmax statistics and the
    weighted value sum per chunk of tokens, nothing materialised per token), merged in order with the exact sinks and
    window (the same split-over-tokens rule as the native CPU kernel). The packed history stays on its (storage)
    device; the exact parts and the result on the query's device. A rotated history is scored with the rotated
    query, and its values' weighted sum is rotated back (:mod:`kivi_xpu.rotation`)."""
    keys, values, mask, scaling, softcap = split_decode_args(args)
    b, hq, length, _ = query.shape
    kv_heads = keys.tail.shape[1]
    q = query.float() * scaling
    sinks = keys.sinks.shape[2]
    # The kernel's tokens: packed in both kinds, whole key groups; the others are exact columns here.
    count = min(keys.count, values.count // keys.group * keys.group)
    columns = sinks + keys.count + keys.tail.shape[2]
    mask = None if mask is None else mask[..., -columns:]

    # The exact columns [sinks | tokens packed in one kind only | window], scored and masked as the dense path does.
    grouped = group_queries(q, kv_heads)
    exact_keys = torch.cat([keys.sinks, *_packed_only(keys, "keys", count, query.device), keys.tail], dim=2).float()
    exact_values = torch.cat(
        [values.sinks, *_packed_only(values, "values", count, query.device), values.tail], dim=2
    ).float()
    scores = (grouped @ exact_keys.transpose(2, 3)).reshape(b, hq, length, -1)
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    # without a mask: causal within the window (the packed columns are never masked then)
    exact_mask = None if mask is None else torch.cat([mask[..., :sinks], mask[..., sinks + count :]], dim=-1)
    scores = masked_scores(scores, exact_mask)
    top = scores.amax(dim=-1, keepdim=True)

    if count:
        storage = keys.codes.device
        rt = _runtime("key_codes", keys.codes)
        q_storage = rotate(q, keys.rotation).to(storage).contiguous()
        rows = hq // kv_heads * length
        chunk = fused_chunk_tokens(count, b * kv_heads * -(-rows // 4), rt.facts.max_compute_units)
        chunks = -(-count // chunk)
        value_dim = values.tail.shape[3]
        chunk_max = torch.empty((b, hq, length, chunks), dtype=torch.float32, device=storage)
        chunk_sum = torch.empty_like(chunk_max)
        chunk_acc = torch.empty((b, hq, length, chunks, value_dim), dtype=torch.float32, device=storage)
        bias = None if mask is None else _packed_bias(mask[..., sinks : sinks + count], storage)
        rt.module.packed_attention(
            rt.device, q_storage, keys.codes, keys.scales, keys.zeros, values.codes, values.scales, values.zeros,
            bias, mask is not None and mask.dtype == torch.bool, chunk_max, chunk_sum, chunk_acc, count, keys.group,
            keys.bits, values.group, values.bits, chunk, float(softcap or 0.0),
        )  # fmt: skip
        chunk_max, chunk_sum, chunk_acc = (t.to(query.device) for t in (chunk_max, chunk_sum, chunk_acc))
        top = torch.maximum(top, chunk_max.amax(dim=-1, keepdim=True))

    # In-order merge: every part rescaled to the row's overall max (a fully masked row has max -inf and gives zeros).
    shift = top.masked_fill(top == float("-inf"), 0.0)
    weights = torch.exp(scores - shift)
    total = weights.sum(dim=-1, keepdim=True)
    out = (group_queries(weights, kv_heads) @ exact_values).reshape(b, hq, length, -1)
    if count:
        factor = torch.exp(chunk_max - shift)  # [B, Hq, L, C]; a chunk masked out entirely: exp(-inf) = 0
        total = total + (factor * chunk_sum).sum(dim=-1, keepdim=True)
        packed = (factor.unsqueeze(-1) * chunk_acc).sum(dim=-2)
        out = out + unrotate(packed, values.rotation)  # (Σ p vQ) Qᵀ
    out = (out / total).masked_fill(top == float("-inf"), 0.0)  # NaN stays NaN
    return out.to(query.dtype)


def composed_decode_attention(query, *args):
    """The two SYCL attention kernels composed (what CPU tensors get, see `decode_attention`): scores of
    ``[sinks | packed keys | key tail]``, one softmax, then ``[sinks | packed values | value tail]`` combined. The
    packed history stays on its (storage) device; the exact parts and the result on the query's device. A rotated
    history is scored with the rotated query, and its values' weighted sum is rotated back (`kivi_xpu.rotation`)."""
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


@register_kernel("decode_attention", "sycl")
def decode_attention(query, *args):
    """XPU tensors: :func:`fused_decode_attention`, one kernel launch per layer. CPU tensors (the OpenCL CPU device, a
    stand-in for Intel GPUs here): :func:`composed_decode_attention`, which measured faster there
    (`benchmarks/bench_sycl_attention.py`, docs/measurements.md). Both are checked against the reference on that
    device."""
    keys = split_decode_args(args)[0]
    fused = keys.codes.device.type != "cpu"
    return (fused_decode_attention if fused else composed_decode_attention)(query, *args)


def _exact_rows(r: RequestColumns, window_rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per request (the columns ``r`` of ``requests``), the window rows of what ``kivi_paged_attention`` leaves to
    the host: the sinks, then the tokens after the packed ones of both kinds. Returns key rows and value rows
    ``[N, E]`` (clamped into the window) and which of the ``E`` columns are tokens."""
    top = torch.maximum(r.key_count, r.value_count)
    exact = r.length - top  # the sinks and the tail after `top`
    columns = torch.arange(int(exact.max()), device=r.length.device).unsqueeze(0)
    in_sinks = columns < r.sinks.unsqueeze(1)
    after = columns - r.sinks.unsqueeze(1)
    keys = torch.where(in_sinks, columns, (r.key_tail_row + top - r.key_count).unsqueeze(1) + after)
    values = torch.where(in_sinks, columns, (r.value_tail_row + top - r.value_count).unsqueeze(1) + after)
    valid = columns < exact.unsqueeze(1)
    return keys.clamp(0, window_rows - 1), values.clamp(0, window_rows - 1), valid


@register_kernel("paged_decode_attention", "sycl")
def paged_decode_attention(query, key_windows, value_windows, key_codes, key_scales, key_zeros, value_codes,
                           value_scales, value_zeros, block_table, requests, key_bits, value_group, value_bits,
                           scaling, key_rotation=None, value_rotation=None):  # fmt: skip
    """Continuous batching's decode rows in one launch per layer (``kivi_paged_attention``): every request's tokens
    that either kind holds packed, read in place from its pages, chunk by chunk; then the sinks and the exact tail of
    every request (gathered from the window slots, one batched product) merged in order with the chunks, as
    :func:`fused_decode_attention` merges (the window values that the kernel summed beside packed ones are not rotated
    back). Same arithmetic as the reference ``paged_decode_attention``."""
    n, hq = query.shape[:2]
    kv_heads, value_dim = key_windows.shape[1], value_windows.shape[3]
    if n == 0:
        return query.new_zeros(0, hq, 1, value_dim)
    q = query.float() * scaling
    r = RequestColumns(*requests.unbind(1))
    slots = r.slot
    key_rows, value_rows, valid = _exact_rows(r, key_windows.shape[2])
    exact_keys = key_windows[slots.unsqueeze(1), :, key_rows].transpose(1, 2).float()  # [N, H, E, D]
    # Rows past a request's tail hold whatever the pool held there (pages' bytes too): zeroed, as 0 * NaN is NaN.
    exact_values = value_windows[slots.unsqueeze(1), :, value_rows].masked_fill(~valid[:, :, None, None], 0.0)
    exact_values = exact_values.transpose(1, 2).float()
    scores = (group_queries(q, kv_heads) @ exact_keys.transpose(2, 3)).reshape(n, hq, 1, -1)
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    top = scores.amax(dim=-1, keepdim=True)

    tokens = key_codes.shape[3] * codes_per_byte(key_bits)
    packed = int(torch.maximum(r.key_count, r.value_count).max())
    if packed:
        rt = _runtime("key_codes", key_codes)
        rows = hq // kv_heads
        chunk = -(-fused_chunk_tokens(packed, n * kv_heads * -(-rows // 4), rt.facts.max_compute_units) // tokens)
        chunk *= tokens
        chunks = -(-packed // chunk)
        chunk_max = torch.empty((n, hq, 1, chunks), dtype=torch.float32, device=query.device)
        chunk_sum = torch.empty_like(chunk_max)
        chunk_acc = torch.empty((n, hq, 1, chunks, value_dim), dtype=torch.float32, device=query.device)
        chunk_exact_acc = torch.empty_like(chunk_acc)
        rt.module.paged_attention(
            rt.device, rotate(q, key_rotation).contiguous(), q.contiguous(), key_windows, value_windows, key_codes,
            key_scales, key_zeros, value_codes, value_scales, value_zeros, block_table.contiguous(),
            requests.contiguous(), chunk_max, chunk_sum, chunk_acc, chunk_exact_acc, key_bits, value_group,
            value_bits, chunk,
        )  # fmt: skip
        top = torch.maximum(top, chunk_max.amax(dim=-1, keepdim=True))

    # In-order merge, every part rescaled to the row's overall max (as fused_decode_attention).
    shift = top.masked_fill(top == float("-inf"), 0.0)
    weights = torch.exp(scores - shift)
    total = weights.sum(dim=-1, keepdim=True)
    out = (group_queries(weights, kv_heads) @ exact_values).reshape(n, hq, 1, -1)
    if packed:
        factor = torch.exp(chunk_max - shift)
        total = total + (factor * chunk_sum).sum(dim=-1, keepdim=True)
        out = out + unrotate((factor.unsqueeze(-1) * chunk_acc).sum(dim=-2), value_rotation)
        out = out + (factor.unsqueeze(-1) * chunk_exact_acc).sum(dim=-2)
    out = (out / total).masked_fill(top == float("-inf"), 0.0)
    return out.to(query.dtype)
