"""paged_decode_attention (continuous batching's decode rows over KIVI pages) on awkward batches: requests of
different lengths, sinks and page counts, shuffled blocks in transformers' strided page views, 2/4/8 bits, GQA
1/3/8, rotations, fp32/fp16/bf16. The native kernel must equal native ``decode_attention`` over the same request's
gathered pages (same chunk kernels, same 8-bit factors; only the fp32 sums of the value pages are added page by page,
so the results agree to fp32 rounding, on every ISA and arithmetic); every backend must match its twin."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch
from attention_cases import assert_close
from conftest import require_backend

from kivi_xpu import ops
from kivi_xpu.algorithm import KiviSettings
from kivi_xpu.ops import integer_twin, reference
from kivi_xpu.ops.operands import PAGED_REQUEST_COLUMNS
from kivi_xpu.ops.reference import composed_paged_decode_attention, quantize_keys, quantize_values
from kivi_xpu.paged.pages import LayerPages, PageLayout
from kivi_xpu.rotation import rotation_matrix
from kivi_xpu.runtime import attention_arithmetic


@dataclass(frozen=True)
class PagedCase:
    # per request: (sinks, key_count, value_count, length); key_count a multiple of `tokens`
    requests: tuple = ((4, 64, 70, 90), (0, 0, 0, 5), (1, 32, 31, 40), (4, 256, 290, 300))
    kv_heads: int = 3
    ratio: int = 3
    head_dim: int = 64
    tokens: int = 32  # page tokens
    key_group: int | None = None  # default: one key group per page (tokens)
    value_group: int = 32
    key_bits: int = 2
    value_bits: int = 2
    meta: torch.dtype = torch.float16
    dtype: torch.dtype = torch.float32
    rotated: str = ""


CASES = [
    PagedCase(),
    PagedCase(requests=((4, 0, 3, 9),), ratio=1),  # one request, nothing packed but some values
    PagedCase(key_bits=4, value_bits=8, rotated="kv", ratio=8, kv_heads=1),
    PagedCase(tokens=8, value_group=16, head_dim=48, requests=((2, 80, 85, 95), (0, 8, 7, 17), (3, 16, 20, 30))),
    PagedCase(tokens=64, value_group=64, requests=((4, 1024, 1100, 1150), (4, 64, 64, 200)), rotated="k"),
    PagedCase(dtype=torch.bfloat16, meta=torch.bfloat16, rotated="v", key_bits=4, value_bits=4),
    PagedCase(dtype=torch.float16, meta=torch.float32, requests=((1, 96, 97, 130),) * 3),
    # As continuous batching holds them: keys packed a block at a time, so more keys than values are packed.
    PagedCase(requests=((4, 128, 100, 230), (4, 64, 35, 150), (0, 0, 0, 5)), rotated="kv"),
    PagedCase(tokens=8, value_group=8, dtype=torch.bfloat16, meta=torch.bfloat16, requests=((4, 24, 13, 40),)),
    # Pages of several key groups (per-layer settings: T the least common multiple of the layers' key groups).
    PagedCase(tokens=64, key_group=16, requests=((4, 128, 100, 230), (1, 64, 70, 90), (0, 0, 3, 9)), rotated="k"),
    PagedCase(tokens=64, key_group=32, key_bits=4, ratio=8, kv_heads=1, requests=((4, 192, 200, 250),)),
    PagedCase(tokens=32, key_group=8, dtype=torch.bfloat16, meta=torch.bfloat16, requests=((2, 96, 97, 130),) * 2),
]


def build(case: PagedCase, seed: int = 0) -> dict:
    """Arguments of the op: windows with NaN around each request's rows, pages in a flat byte pool (strided views,
    as transformers' allocator lays them out) at shuffled blocks, and a block table padded with junk ids."""
    gen = torch.Generator().manual_seed(seed)
    h, d, t = case.kv_heads, case.head_dim, case.tokens
    g = case.key_group or t
    settings = KiviSettings(
        key_bits=case.key_bits, value_bits=case.value_bits, key_group_size=g, value_group_size=case.value_group,
        residual_length=t, meta_dtype=case.meta, sink_tokens=0,
    )  # fmt: skip
    layout = PageLayout.for_settings(settings, h, d, t)
    pages_per_request = [-(-max(kc, vc) // t) for _, kc, vc, _ in case.requests]
    blocks = sum(pages_per_request) + 3
    pool = torch.randint(0, 256, (blocks, layout.page_bytes * 2), dtype=torch.uint8, generator=gen)
    pages = LayerPages(pool, layout, layout.page_bytes)  # the second page of each block: a block stride of 2 pages
    order = list(range(blocks))
    random.Random(seed).shuffle(order)
    rows = max(length - min(kc, vc) for _, kc, vc, length in case.requests) + 8
    slots = len(case.requests) + 2
    key_windows = torch.randn(slots, h, rows, d, generator=gen).to(case.dtype)
    value_windows = torch.randn(slots, h, rows, d, generator=gen).to(case.dtype)
    table = torch.full((len(case.requests), max(pages_per_request + [1]) + 1), 10**6, dtype=torch.int64)
    requests = []
    for i, ((sinks, key_count, value_count, length), count) in enumerate(
        zip(case.requests, pages_per_request, strict=True)
    ):
        table[i, :count] = torch.tensor([order.pop() for _ in range(count)], dtype=torch.int64)
        for j in range(count):
            block = int(table[i, j])
            k = quantize_keys(torch.randn(1, h, t, d, generator=gen), g, case.key_bits, case.meta)
            v = quantize_values(torch.randn(1, h, t, d, generator=gen), case.value_group, case.value_bits, case.meta)
            pages.store_keys(torch.tensor([block]), *k)
            for section, part in zip(("value_codes", "value_scales", "value_zeros"), v, strict=True):
                getattr(pages, section)[block] = part[0]
        slot = slots - 1 - i  # not the request's index
        key_row = sinks + 1 + i % 2  # the tails start a little after the sinks
        value_row = sinks + 2 - i % 2
        requests.append((slot, sinks, key_count, key_row, value_count, value_row, length))
    # Rows no request reads are NaN (the pool lends the same bytes to pages and windows): a kernel must not touch them.
    for window, tail_row, count in ((key_windows, 3, 2), (value_windows, 5, 4)):
        junk = torch.ones(window.shape[:3], dtype=torch.bool)
        for row in requests:
            junk[row[0], :, : row[1]] = False
            junk[row[0], :, row[tail_row] : row[tail_row] + row[6] - row[1] - row[count]] = False
        window[junk] = float("nan")
    return dict(
        query=torch.randn(len(case.requests), h * case.ratio, 1, d, generator=gen).to(case.dtype),
        key_windows=key_windows,
        value_windows=value_windows,
        key_codes=pages.key_codes,
        key_scales=pages.key_scales,
        key_zeros=pages.key_zeros,
        value_codes=pages.value_codes,
        value_scales=pages.value_scales,
        value_zeros=pages.value_zeros,
        block_table=table,
        requests=torch.tensor(requests, dtype=torch.int64),
        key_bits=case.key_bits,
        value_group=case.value_group,
        value_bits=case.value_bits,
        scaling=d**-0.5,
        key_rotation=rotation_matrix("hadamard", d) if "k" in case.rotated else None,
        value_rotation=rotation_matrix("hadamard", d) if "v" in case.rotated else None,
    )


def _case_id(case: PagedCase) -> str:
    groups = f"T{case.tokens}G{case.key_group or case.tokens}"
    return f"{groups}-k{case.key_bits}v{case.value_bits}-r{case.ratio}-{str(case.dtype)[6:]}-rot{case.rotated}"


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_native_equals_decode_attention_per_request(isa, case):
    """The paged kernel is decode_attention's chunk kernel reading the pages in place: equal to fp32 rounding (the
    value sums are added once per page instead of once per chunk), with the same int8 factors."""
    from native_module import native

    previous = native.dot()
    for dot in ("int8", "fp32"):
        native.set_dot(dot)
        try:
            args = build(case)
            out = native.paged_decode_attention(**args)
            per_request = composed_paged_decode_attention(native.decode_attention)(**args)
        finally:
            native.set_dot(previous)
        assert out.dtype == case.dtype
        assert out.shape == (len(case.requests), case.kv_heads * case.ratio, 1, case.head_dim)
        assert_close(out, per_request)


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_backends_match_the_twin(backend_name, case):
    args = build(case)
    out = ops.for_backend(backend_name).paged_decode_attention(**args)
    integer = backend_name == "native" and attention_arithmetic(pytest.importorskip("kivi_xpu._cpu")) == "int8"
    twin = composed_paged_decode_attention(integer_twin.decode_attention if integer else reference.decode_attention)
    assert_close(out, twin(**args), integer)


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_sycl_kernel_equals_the_native_op(case):
    """The SYCL paged kernel against the native paged op with fp32 arithmetic on the same pages (both read them in
    place): equal to fp32 rounding."""
    require_backend("sycl")
    from native_module import native

    args = build(case)
    previous = native.dot()
    native.set_dot("fp32")
    try:
        expected = native.paged_decode_attention(**args)
    finally:
        native.set_dot(previous)
    assert_close(ops.for_backend("sycl").paged_decode_attention(**args), expected)


def test_registered_op_and_opcheck():
    args = build(CASES[0])
    torch.library.opcheck(torch.ops.kivi_xpu.paged_decode_attention, tuple(args.values()))
    assert torch.ops.kivi_xpu.paged_decode_attention(*args.values()).shape == (4, 9, 1, 64)


def test_no_requests():
    args = build(CASES[0])
    for name in ("query", "block_table", "requests"):
        args[name] = args[name][:0]
    for backend in ("reference", "native", "sycl"):
        if backend != "reference":
            require_backend(backend)
        assert ops.for_backend(backend).paged_decode_attention(**args).shape == (0, 9, 1, 64)


@pytest.mark.parametrize(
    "column, value, message",
    [
        ("slot", 9, "slot in"),
        ("sinks", -1, "sinks"),
        ("key_count", 33, "multiple of the page size"),
        ("length", 10**4, "window's"),
        ("key_tail_row", 200, "key tail"),
        ("value_count", 10**3, "length >= sinks"),
    ],
)
def test_bad_request_rows_are_refused(column, value, message):
    args = build(CASES[0])
    args["requests"][0, PAGED_REQUEST_COLUMNS.index(column)] = value
    with pytest.raises(ValueError, match=message):
        torch.ops.kivi_xpu.paged_decode_attention(**args)


def test_bad_block_and_shapes_are_refused():
    args = build(CASES[0])
    args["block_table"][3, 2] = -1
    with pytest.raises(ValueError, match=r"`block_table`\[3, 2\] = -1 is not a block"):
        torch.ops.kivi_xpu.paged_decode_attention(**args)
    args = build(CASES[0])
    args["query"] = args["query"].expand(-1, -1, 2, -1)
    with pytest.raises(ValueError, match="one row per request"):
        torch.ops.kivi_xpu.paged_decode_attention(**args)
    args = build(CASES[0])
    args["requests"] = args["requests"].int()
    with pytest.raises(ValueError, match="`requests` must be an int64"):
        torch.ops.kivi_xpu.paged_decode_attention(**args)
    for groups in (3, 64):  # key groups that do not divide the page's 32 tokens, or not in whole code bytes
        args = build(CASES[0])
        args["key_scales"] = args["key_zeros"] = args["key_scales"].new_zeros(*args["key_scales"].shape[:2], groups, 64)
        with pytest.raises(ValueError, match=r"scales/zeros \[blocks, H, T/G, 64\]"):
            torch.ops.kivi_xpu.paged_decode_attention(**args)


def test_native_rechecks_what_it_relies_on():
    """The unchecked native entry (the cache's hot path) still refuses rows outside the slots or blocks."""
    native = pytest.importorskip("kivi_xpu._cpu")
    args = build(CASES[0])
    args["block_table"][0, 0] = 10**6
    with pytest.raises(ValueError, match="is not a block"):
        native.paged_decode_attention(**args)
    args = build(CASES[0])
    args["requests"][1, 0] = -1
    with pytest.raises(ValueError, match="does not fit"):
        native.paged_decode_attention(**args)
    args = build(CASES[0])
    args["key_scales"] = args["key_zeros"] = args["key_scales"].new_zeros(*args["key_scales"].shape[:2], 3, 64)
    with pytest.raises(ValueError, match="T/G"):
        native.paged_decode_attention(**args)
