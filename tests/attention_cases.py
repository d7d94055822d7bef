"""Awkward decode-attention problems shared by the kernel suites (native CPU and SYCL), and their closeness rule:
ragged counts at group and window boundaries, GQA 1/3/8, sinks, rotations, 2/4/8 bits, masks, softcap, fp32/fp16/bf16
models, over-allocated packed storage and non-contiguous exact views."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kivi_xpu.ops.reference import quantize_keys, quantize_values
from kivi_xpu.rotation import rotation_matrix


@dataclass(frozen=True)
class Case:
    batch: int = 2
    kv_heads: int = 3
    ratio: int = 3  # query heads per kv head
    length: int = 1  # query rows per head
    head_dim: int = 64
    value_dim: int = 64
    sinks: int = 0
    key_count: int = 64
    key_tail: int = 20
    value_count: int = 70  # the value tail is whatever remains of n
    key_group: int = 32
    value_group: int = 32
    key_bits: int = 2
    value_bits: int = 2
    meta: torch.dtype = torch.float16
    dtype: torch.dtype = torch.float32
    mask: str = "none"  # none | bool | float
    softcap: float | None = None
    rotated: str = ""  # "k", "v" or "kv": the packed keys / values are stored Hadamard-rotated

    @property
    def n(self) -> int:
        return self.sinks + self.key_count + self.key_tail


CASES = [
    Case(),
    Case(key_count=0, value_count=0, key_tail=7),  # no packed history at all
    Case(key_count=32, value_count=31, key_tail=1),  # just around one group boundary
    Case(key_count=96, value_count=97, key_tail=33, sinks=1, key_bits=4, value_bits=8),
    Case(sinks=4, key_count=0, value_count=3, key_tail=5, ratio=1),
    Case(ratio=8, kv_heads=1, length=3, key_count=288, value_count=300, key_tail=40, mask="bool"),
    Case(ratio=1, length=3, sinks=4, key_bits=8, value_bits=4, meta=torch.bfloat16, mask="float"),
    Case(head_dim=48, value_dim=40, key_group=8, value_group=8, key_count=80, value_count=85, key_tail=9),
    Case(head_dim=72, value_dim=96, key_group=24, value_group=48, key_bits=4, key_count=72, value_count=70),
    Case(meta=torch.float32, softcap=3.0, length=3, mask="bool"),
    Case(dtype=torch.float16, sinks=4, key_bits=4, value_bits=2, mask="float"),
    Case(dtype=torch.bfloat16, meta=torch.bfloat16, sinks=1, ratio=8, kv_heads=1, length=3),
    Case(batch=1, kv_heads=3, key_count=2048, value_count=2100, key_tail=180, key_group=64, value_group=64),
    # 4-token key groups: a chunk holds 64 groups, so its key metadata comes in several blocks, the last one ragged
    Case(key_group=4, value_group=16, key_count=300, value_count=301, key_tail=3, meta=torch.bfloat16),
    Case(batch=3, kv_heads=2, ratio=3, length=1, key_count=1024, value_count=1000, key_tail=40, mask="bool"),
    # 48-token key groups over several chunks: the chunks (multiples of 48) cut the 32-token blocks of the value factors
    Case(batch=1, kv_heads=1, key_group=48, key_count=960, value_count=1000, key_tail=40, sinks=4),
    # Llama-3.2-3B's heads (head_dim 128, GQA 3): 4 value groups a token, whole and ragged value blocks, 2 and 4 bits
    Case(head_dim=128, value_dim=128, key_count=320, value_count=333, key_tail=45),
    Case(head_dim=128, value_dim=128, value_bits=4, key_count=128, value_count=150, key_tail=30, meta=torch.bfloat16),
    # value groups a token as the integer factors read them: 8 and 1 in place (2 and 4 bits), 3 and 6 by group
    Case(value_dim=256, key_count=192, value_count=203, key_tail=28, meta=torch.float32),
    Case(value_dim=128, value_group=16, value_bits=4, key_count=96, value_count=117, key_tail=30),
    Case(value_group=64, value_bits=4, key_count=64, value_count=77, key_tail=13, meta=torch.bfloat16),
    Case(value_dim=96, key_count=160, value_count=171, key_tail=12, ratio=1),
    Case(value_dim=96, value_group=16, value_bits=4, key_count=64, value_count=66, key_tail=2, meta=torch.bfloat16),
    # rotated history (the default cache): the packed sums apart from the exact ones, un-rotated after the merge
    Case(rotated="kv", sinks=4, mask="bool", length=3),
    Case(rotated="k", key_count=288, value_count=300, key_tail=40, ratio=8, kv_heads=1),
    Case(rotated="v", batch=1, key_count=2048, value_count=2100, key_tail=180, key_group=64, value_group=64),
    Case(
        rotated="kv",
        head_dim=72,
        value_dim=96,
        key_group=24,
        value_group=48,
        key_bits=4,
        key_count=72,
        value_count=70,
        dtype=torch.bfloat16,
    ),
    Case(rotated="kv", head_dim=48, value_dim=40, key_group=8, value_group=8, key_count=0, value_count=0, key_tail=9),
    Case(rotated="kv", dtype=torch.float16, sinks=1, softcap=3.0, mask="float", value_count=3, key_count=0, key_tail=5),
]


def build(case: Case, seed: int = 0):
    """The op's arguments for ``case``: over-allocated packed storage and narrow (non-contiguous) exact views."""
    gen = torch.Generator().manual_seed(seed)
    b, h, hq, length = case.batch, case.kv_heads, case.kv_heads * case.ratio, case.length
    n, s = case.n, case.sinks
    value_tail = n - s - case.value_count
    assert value_tail >= 0, case

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    def narrow(tokens: int, width: int) -> torch.Tensor:  # a view into a bigger buffer, as the cache keeps them
        return randn(b, h, tokens + 9, width + 8).to(case.dtype)[:, :, 3 : 3 + tokens, 2 : 2 + width]

    capacity = 32 * 24 * ((max(case.key_count, case.value_count) + 32 * 24) // (32 * 24) + 1)
    keys = quantize_keys(randn(b, h, capacity, case.head_dim), case.key_group, case.key_bits, case.meta)
    values = quantize_values(randn(b, h, capacity, case.value_dim), case.value_group, case.value_bits, case.meta)
    mask = None
    if case.mask != "none":
        pad = 5  # columns before this layer's n positions, which the op must ignore
        attend = torch.rand(b, 1, length, pad + n, generator=gen) > 0.3
        attend[..., -1] = True
        attend[0, 0, -1, :] = False  # a fully masked (padding) query row
        mask = attend if case.mask == "bool" else torch.where(attend, 0.0, float("-inf")) + randn(b, 1, length, pad + n)
        if case.mask == "float":
            mask = mask.to(case.dtype)
    return dict(
        query=randn(b, hq, length, case.head_dim).to(case.dtype),
        key_sinks=narrow(s, case.head_dim) if s else None,
        key_codes=keys[0],
        key_scales=keys[1],
        key_zeros=keys[2],
        key_count=case.key_count,
        key_group=case.key_group,
        key_bits=case.key_bits,
        key_tail=narrow(case.key_tail, case.head_dim),
        value_sinks=narrow(s, case.value_dim) if s else None,
        value_codes=values[0],
        value_scales=values[1],
        value_zeros=values[2],
        value_count=case.value_count,
        value_group=case.value_group,
        value_bits=case.value_bits,
        value_tail=narrow(value_tail, case.value_dim),
        mask=mask,
        scaling=case.head_dim**-0.5,
        softcap=case.softcap,
        key_rotation=rotation_matrix("hadamard", case.head_dim) if "k" in case.rotated else None,
        value_rotation=rotation_matrix("hadamard", case.value_dim) if "v" in case.rotated else None,
    )


def assert_close(actual: torch.Tensor, expected: torch.Tensor, integer: bool = False) -> None:
    """Same NaN positions; elsewhere within ~1e-4 of the output scale (fp32) or about one rounding (fp16/bf16).
    ``integer``: against the integer twin, whose 8-bit factors can round the other way where the twin's fp32
    product lands within an ulp of a tie (one factor step: up to ~1e-3 of the scale in a row), so the worst error may
    reach 2e-3 of the scale while the median stays at fp32 rounding."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    assert torch.equal(actual.isnan(), expected.isnan()), "NaN rows differ"
    finite = ~expected.isnan()
    a, e = actual[finite].float(), expected[finite].float()
    scale = max(1.0, e.abs().max().item()) if e.numel() else 1.0
    tolerance = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[expected.dtype] * scale
    worst = (a - e).abs().max().item() if e.numel() else 0.0
    if integer:
        typical = (a - e).abs().median().item() if e.numel() else 0.0
        assert typical <= tolerance / 10, f"median error {typical:.3g} > {tolerance / 10:.3g}"
        tolerance = max(tolerance, 2e-3 * scale)
    assert worst <= tolerance, f"max error {worst:.3g} > {tolerance:.3g}"
