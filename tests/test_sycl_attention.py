"""The fused SYCL decode attention (``kivi_packed_attention`` + the in-order merge of kivi_xpu/ops/sycl.py) against
the pure-PyTorch reference on the awkward problems of attention_cases.py, on the SYCL device serving CPU tensors
(``opencl:cpu`` here: a stand-in for Intel GPUs). Skipped without the SYCL extension, unless KIVI_XPU_REQUIRE_SYCL=1.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from attention_cases import CASES, Case, assert_close, build
from conftest import require_sycl

from kivi_xpu import ops
from kivi_xpu.ops import sycl as sycl_ops
from kivi_xpu.ops.reference import decode_attention as decode_attention_reference


@pytest.fixture(autouse=True)
def _sycl():
    require_sycl()


def as_called(args: dict) -> dict:
    """The op's arguments as the cache passes them: sinks as empty tensors when there are none, softcap 0 for none."""
    for kind, dim in (("key", args["query"].shape[3]), ("value", args["value_tail"].shape[3])):
        if args[f"{kind}_sinks"] is None:
            tail = args[f"{kind}_tail"]
            args = {**args, f"{kind}_sinks": tail.new_zeros(tail.shape[0], tail.shape[1], 0, dim)}
    return {**args, "softcap": args["softcap"] or 0.0}


def fused(**args) -> torch.Tensor:
    """The fused kernel (what XPU tensors get), on the CPU device, after the op's argument check."""
    args = as_called(args)
    ops.OPS["decode_attention"].check(*args.values())
    return sycl_ops.fused_decode_attention(*args.values())


@pytest.mark.parametrize(
    "case",
    CASES,
    ids=lambda c: f"n{c.n}-s{c.sinks}-r{c.ratio}-L{c.length}-{c.mask}" + (f"-rot{c.rotated}" * bool(c.rotated)),
)
@pytest.mark.parametrize("path", ["fused", "op"])
def test_matches_the_reference(case, path):
    """Both SYCL implementations: the fused kernel and what the op runs for CPU tensors (the composed kernels)."""
    args = build(case)
    out = fused(**args) if path == "fused" else ops.call("decode_attention", "sycl", **as_called(args))
    assert out.shape == (case.batch, case.kv_heads * case.ratio, case.length, case.value_dim)
    assert_close(out, decode_attention_reference(**args))
    if case.mask != "none":  # the fully masked row gives zeros, never NaN
        assert torch.equal(out[0, :, -1], torch.zeros_like(out[0, :, -1]))


def test_many_chunks_with_a_ragged_last_one():
    """More packed tokens than one chunk holds, a last chunk shorter than the others, and a masked-out chunk."""
    case = Case(batch=1, kv_heads=1, ratio=3, key_count=1184, value_count=1190, key_tail=20, mask="bool")
    args = build(case)
    chunk = sycl_ops.fused_chunk_tokens(case.key_count, 1, 2)
    assert case.key_count % chunk != 0 and case.key_count > 2 * chunk
    args["mask"][..., 5 + chunk : 5 + 2 * chunk] = False  # the second chunk contributes nothing
    assert_close(fused(**args), decode_attention_reference(**args))


def test_keys_packed_ahead_of_values():
    """The op's contract allows more packed keys than values (the cache never does it): those columns' values are
    exact, their keys packed."""
    case = Case(key_count=96, value_count=40, key_tail=10)
    args = build(case)
    assert_close(fused(**args), decode_attention_reference(**args))


@pytest.mark.parametrize("where", ["tail", "sink", "packed"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_key_makes_the_row_nan(where, bad):
    args = build(Case(sinks=2, length=3, ratio=1, mask="bool"))
    args["query"][..., 0] = 1.0  # every score meets the bad channel with a positive weight: +inf, not -inf
    args["mask"][:] = True
    args["mask"][1, 0, 2, :] = False  # a fully masked row stays zeros even so
    target = {
        "tail": ("key_tail", (0, 1, 3, 0)),
        "sink": ("key_sinks", (0, 1, 1, 0)),
        "packed": ("key_scales", (0, 1, 0, 1)),
    }
    name, index = target[where]
    args[name][index] = bad
    out = fused(**args)
    assert_close(out, decode_attention_reference(**args))
    assert out[0, 1].isnan().all() and not out[0, 0].isnan().any() and not out[1].isnan().any()
    assert torch.equal(out[1, :, 2], torch.zeros_like(out[1, :, 2]))


def test_softcap_and_float_mask_on_a_long_history():
    case = replace(CASES[12], softcap=5.0, mask="float", length=2)
    args = build(case)
    assert_close(fused(**args), decode_attention_reference(**args))


def test_bad_chunk_is_a_clear_error():
    args = build(Case())
    from kivi_xpu.runtime import sycl_runtime_for

    rt = sycl_runtime_for(torch.device("cpu"))
    empty = torch.empty(0)
    with pytest.raises(ValueError, match="`chunk_tokens` must be a positive multiple of 8, got 12"):
        rt.module.packed_attention(
            rt.device, args["query"].float(), args["key_codes"], args["key_scales"], args["key_zeros"],
            args["value_codes"], args["value_scales"], args["value_zeros"], None, False, empty, empty, empty, 64, 32, 2,
            32, 2, 12, 0.0,
        )  # fmt: skip
