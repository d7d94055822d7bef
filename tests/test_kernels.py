"""SYCL kernels (kivi_xpu._C through kivi_xpu.ops.sycl) against the pure-PyTorch reference.

Codes and metadata must be bit-identical to the reference (the kernels are built with precise fp32 division and
round half to even); dequantized values too (no fma contraction). Skipped only when the extension or a SYCL device
is genuinely missing, and then FAILS instead if ``KIVI_XPU_REQUIRE_SYCL=1`` (CI).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from kivi_xpu import backend, runtime
from kivi_xpu.ops import for_backend, use_backend
from kivi_xpu.ops import reference as ref

BITS = (2, 4, 8)
FITS = ("minmax", "least_squares")
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
REQUIRED = os.environ.get("KIVI_XPU_REQUIRE_SYCL") == "1"


@pytest.fixture(scope="module")
def kernels():
    try:
        rt = runtime.host_sycl_runtime()
    except (RuntimeError, ImportError) as error:
        if REQUIRED:
            pytest.fail(f"KIVI_XPU_REQUIRE_SYCL=1 but the SYCL kernels are unavailable: {error}")
        pytest.skip(f"SYCL kernels unavailable: {error}")
    sycl = for_backend("sycl")  # the checked ops on the SYCL backend, plus the raw extension for direct calls
    sycl._C, sycl.device = rt.module, rt.device
    return sycl


def assert_identical(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Same shape, dtype and values, NaN where the reference has NaN."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, what
    torch.testing.assert_close(actual, expected, rtol=0, atol=0, equal_nan=True, msg=lambda m: f"{what}: {m}")


def make_input(shape, dtype, kind: str = "normal") -> torch.Tensor:
    if kind == "normal":
        # Channel-wise spread like real keys: some channels carry outliers.
        x = torch.randn(shape) * torch.empty(shape[-1]).uniform_(0.1, 8.0)
    elif kind == "ties":
        # Half-integer grid: many (x - zero) / scale land exactly on k + 0.5, exercising round-half-to-even.
        x = torch.randint(0, 16, shape).float() * 0.5
    else:
        raise ValueError(kind)
    return x.to(dtype)


def check_quantize(kernels, op: str, x: torch.Tensor, group_size: int, bits: int, meta_dtype, fits=FITS) -> None:
    for fit in fits:
        expected = getattr(ref, op)(x, group_size, bits, meta_dtype, fit)
        actual = getattr(kernels, op)(x, group_size, bits, meta_dtype, fit)
        for name, a, e in zip(("codes", "scales", "zeros"), actual, expected, strict=True):
            assert_identical(a, e, f"{op} {name} fit={fit}")


def check_dequantize(kernels, op: str, codes, scales, zeros, num_tokens, group_size, bits, out_dtype) -> None:
    args = (codes, scales, zeros, num_tokens, group_size, bits, out_dtype)
    assert_identical(getattr(kernels, op)(*args), getattr(ref, op)(*args), op)


# ---- correctness against the reference --------------------------------------------------------------------------

# (96, 48, 12) and (64, 32, 8) move 2-bit codes byte by byte (G/P not a multiple of 4), the others as 32-bit words.
KEY_SHAPES = [
    (32, 64, 32),
    (64, 128, 32),
    (96, 80, 16),
    (1024 + 32, 128, 32),
    (128, 64, 64),
    (256, 128, 128),
    (96, 48, 12),
    (64, 32, 8),
]


@pytest.mark.parametrize("tokens,head_dim,group_size", KEY_SHAPES)
@pytest.mark.parametrize("bits", BITS)
def test_keys_match_reference_shapes(kernels, tokens, head_dim, group_size, bits):
    x = make_input((2, 3, tokens, head_dim), torch.float32)
    check_quantize(kernels, "quantize_keys", x, group_size, bits, torch.float16)
    codes, scales, zeros = ref.quantize_keys(x, group_size, bits)
    check_dequantize(kernels, "dequantize_keys", codes, scales, zeros, tokens, group_size, bits, torch.float32)


VALUE_SHAPES = [(1, 64, 32), (31, 80, 16), (33, 128, 32), (129, 128, 64), (1025, 128, 128)]


@pytest.mark.parametrize("tokens,head_dim,group_size", VALUE_SHAPES)
@pytest.mark.parametrize("bits", BITS)
def test_values_match_reference_shapes(kernels, tokens, head_dim, group_size, bits):
    x = make_input((2, 3, tokens, head_dim), torch.float32)
    check_quantize(kernels, "quantize_values", x, group_size, bits, torch.float16)
    codes, scales, zeros = ref.quantize_values(x, group_size, bits)
    check_dequantize(kernels, "dequantize_values", codes, scales, zeros, tokens, group_size, bits, torch.float32)


@pytest.mark.parametrize("x_dtype", DTYPES)
@pytest.mark.parametrize("meta_dtype", DTYPES)
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("kind", ["normal", "ties"])
def test_every_dtype_combination(kernels, x_dtype, meta_dtype, bits, kind):
    x = make_input((2, 2, 64, 80), x_dtype, kind)
    layouts = (("quantize_keys", "dequantize_keys", 32), ("quantize_values", "dequantize_values", 16))
    for quantize, dequantize, group_size in layouts:
        check_quantize(kernels, quantize, x, group_size, bits, meta_dtype)
        codes, scales, zeros = getattr(ref, quantize)(x, group_size, bits, meta_dtype)
        for out_dtype in DTYPES:
            check_dequantize(kernels, dequantize, codes, scales, zeros, 64, group_size, bits, out_dtype)


@pytest.mark.parametrize("bits", BITS)
def test_round_half_to_even_at_exact_ties(kernels, bits):
    """Inputs whose (x - zero) / scale is exactly k + 0.5: rint (half to even) and round (half away) differ."""
    x = make_input((2, 2, 64, 80), torch.float32, "ties")
    groups = x.reshape(2, 2, 2, 32, 80)
    low, high = groups.amin(3, keepdim=True), groups.amax(3, keepdim=True)
    ratio = (groups - low) / ((high - low) / ((1 << bits) - 1))
    assert ((ratio - ratio.floor()) == 0.5).sum() > 100  # the case under test really occurs
    check_quantize(kernels, "quantize_keys", x, 32, bits, torch.float32)


def test_known_value_packs_to_228(kernels):
    x = torch.tensor([1.0, 2.0, 3.0, 4.0])
    codes, scales, zeros = kernels.quantize_values(x.view(1, 1, 1, 4), 4, 2)
    assert codes.item() == 228 and scales.item() == 1.0 and zeros.item() == 1.0
    assert torch.equal(kernels.dequantize_values(codes, scales, zeros, 1, 4, 2), x.view(1, 1, 1, 4))
    codes, scales, zeros = kernels.quantize_keys(x.view(1, 1, 4, 1), 4, 2)
    assert codes.item() == 228 and scales.item() == 1.0 and zeros.item() == 1.0
    assert torch.equal(kernels.dequantize_keys(codes, scales, zeros, 4, 4, 2), x.view(1, 1, 4, 1))


def special_values_input() -> torch.Tensor:
    """[1, 2, 64, 32]: constant groups, NaN / +-Inf groups, a fully NaN group, fp16-overflowing and tiny groups."""
    x = torch.randn(1, 2, 64, 32)
    x[0, 0, :32, 0] = 3.25  # constant group (keys)
    x[0, 0, 5, 1] = float("nan")
    x[0, 0, 40, 2] = float("inf")
    x[0, 0, 41, 3] = float("-inf")
    x[0, 1, :32, 4] = float("nan")  # whole group NaN
    x[0, 1, 32:, 5] = torch.linspace(-7e4, 7e4, 32)  # overflows float16 scale/zero
    x[0, 1, :32, 6] = torch.linspace(0, 1e-6, 32)  # float16 subnormal / zero scale
    x[0, 1, 7, :] = 0.0  # constant token (values)
    return x


@pytest.mark.parametrize("meta_dtype", DTYPES)
@pytest.mark.parametrize("bits", BITS)
def test_special_values(kernels, meta_dtype, bits):
    x = special_values_input()
    for quantize, dequantize in (("quantize_keys", "dequantize_keys"), ("quantize_values", "dequantize_values")):
        check_quantize(kernels, quantize, x, 32, bits, meta_dtype)
        codes, scales, zeros = getattr(kernels, quantize)(x, 32, bits, meta_dtype)
        check_dequantize(kernels, dequantize, codes, scales, zeros, 64, 32, bits, torch.float32)
    codes, scales, _ = kernels.quantize_keys(x, 32, bits, meta_dtype)
    assert scales[0, 1, 4, 0].isnan() and scales[0, 0, 0, 0] == 0  # whole-NaN group, constant group (channel-major)


@pytest.mark.parametrize("bits", BITS)
def test_dequantize_from_overallocated_buffers(kernels, bits):
    capacity, num_tokens, group_size = 256, 96, 32
    x = make_input((2, 3, capacity, 64), torch.float32)
    for quantize, dequantize in (("quantize_keys", "dequantize_keys"), ("quantize_values", "dequantize_values")):
        codes, scales, zeros = getattr(ref, quantize)(x, group_size, bits, torch.bfloat16)
        for out_dtype in DTYPES:
            check_dequantize(kernels, dequantize, codes, scales, zeros, num_tokens, group_size, bits, out_dtype)
            check_dequantize(kernels, dequantize, codes, scales, zeros, 0, group_size, bits, out_dtype)


@pytest.mark.parametrize("bits", BITS)
def test_key_codes_at_an_unaligned_address(kernels, bits):
    """Codes whose base is not 4-byte aligned (a contiguous view at an odd offset) take the byte-wise path."""
    x = make_input((2, 3, 128, 64), torch.float32)
    codes, scales, zeros = ref.quantize_keys(x, 32, bits)
    storage = torch.empty(codes.numel() + 1, dtype=torch.uint8)
    shifted = storage[1:].view(codes.shape)
    shifted.copy_(codes)
    assert shifted.is_contiguous() and shifted.data_ptr() % 4 != 0
    check_dequantize(kernels, "dequantize_keys", shifted, scales, zeros, 96, 32, bits, torch.float32)
    k = kernels.packed_key_scores(torch.randn(2, 3, 1, 64), shifted, scales, zeros, 96, 32, bits)
    assert k.shape == (2, 3, 1, 96)


def test_empty_inputs_return_empty_outputs(kernels):
    for shape in ((2, 3, 0, 64), (0, 3, 32, 64)):
        x = torch.empty(shape)
        for op in ("quantize_keys", "quantize_values"):
            for a, e in zip(getattr(kernels, op)(x, 32, 2), getattr(ref, op)(x, 32, 2), strict=True):
                assert a.shape == e.shape and a.dtype == e.dtype


def test_registered_ops_run_on_the_host_device(kernels):
    x = make_input((1, 2, 64, 64), torch.float16)
    with use_backend("sycl"):
        got = torch.ops.kivi_xpu.quantize_keys(x, 32, 2, torch.float16)
    for a, e in zip(got, ref.quantize_keys(x, 32, 2), strict=True):
        assert_identical(a, e, "torch.ops.kivi_xpu.quantize_keys")
    assert runtime.sycl_runtime_for(x.device).device == kernels.device


# ---- fused attention ops (tests/test_attention.py covers shapes and GQA; here dtypes, edges, direct calls) --------


def attention_inputs(batch, kv_heads, gqa, length, tokens, head_dim, group_size, bits, meta_dtype, spare=0):
    keys = make_input((batch, kv_heads, tokens + spare, head_dim), torch.float32)
    values = make_input((batch, kv_heads, tokens + spare, head_dim), torch.float32)
    key_pack = ref.quantize_keys(keys, group_size, bits, meta_dtype)
    value_pack = ref.quantize_values(values, group_size, bits, meta_dtype)
    query = torch.randn(batch, kv_heads * gqa, length, head_dim)
    probs = torch.softmax(torch.randn(batch, kv_heads * gqa, length, tokens), dim=-1)
    return query, key_pack, probs, value_pack


def check_attention(kernels, query, key_pack, probs, value_pack, tokens, group_size, bits):
    got = kernels.packed_key_scores(query, *key_pack, tokens, group_size, bits)
    expected = ref.packed_key_scores(query, *key_pack, tokens, group_size, bits)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)
    got = kernels.packed_value_combine(probs, *value_pack, tokens, group_size, bits)
    expected = ref.packed_value_combine(probs, *value_pack, tokens, group_size, bits)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("meta_dtype", DTYPES)
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("gqa, length", [(1, 1), (3, 1), (2, 3), (5, 1), (3, 4)])  # 1..15 rows per kv head
def test_packed_attention_every_meta_dtype(kernels, meta_dtype, bits, gqa, length):
    inputs = attention_inputs(2, 2, gqa, length, 320, 64, 32, bits, meta_dtype, spare=64)
    check_attention(kernels, *inputs, 320, 32, bits)


@pytest.mark.parametrize("tokens, head_dim, group_size", [(96, 48, 12), (64, 32, 8), (2048 + 64, 128, 64), (16, 8, 4)])
@pytest.mark.parametrize("bits", BITS)
def test_packed_attention_group_layouts(kernels, tokens, head_dim, group_size, bits):
    """Groups narrower / wider than a work-group, non-power-of-two groups, several value chunks."""
    inputs = attention_inputs(1, 3, 3, 1, tokens, head_dim, group_size, bits, torch.float16, spare=group_size)
    check_attention(kernels, *inputs, tokens, group_size, bits)


def test_packed_attention_nan_groups_propagate(kernels):
    query, key_pack, probs, value_pack = attention_inputs(1, 1, 1, 1, 64, 32, 32, 2, torch.float16)
    key_pack[1][0, 0, 3, 1] = float("nan")  # channel 3, tokens 32..63
    value_pack[1][0, 0, 5, 0] = float("nan")  # token 5, channels 0..31
    scores = kernels.packed_key_scores(query, *key_pack, 64, 32, 2)
    assert scores[..., 32:].isnan().all() and not scores[..., :32].isnan().any()
    assert kernels.packed_value_combine(probs, *value_pack, 64, 32, 2).isnan().all()


def test_packed_attention_empty_inputs(kernels):
    query, key_pack, probs, value_pack = attention_inputs(1, 2, 2, 1, 64, 32, 32, 2, torch.float16)
    scores = kernels.packed_key_scores(query, *key_pack, 0, 32, 2)
    assert scores.shape == (1, 4, 1, 0)
    out = kernels.packed_value_combine(probs[..., :0], *value_pack, 0, 32, 2)
    assert out.shape == (1, 4, 1, 32) and not out.any()
    empty_keys = ref.quantize_keys(torch.empty(0, 2, 64, 32), 32, 2)
    assert kernels.packed_key_scores(torch.empty(0, 4, 1, 32), *empty_keys, 64, 32, 2).shape == (0, 4, 1, 64)
    empty_values = ref.quantize_values(torch.empty(0, 2, 64, 32), 32, 2)
    assert kernels.packed_value_combine(torch.empty(0, 4, 1, 64), *empty_values, 64, 32, 2).shape == (0, 4, 1, 32)


def test_packed_attention_registered_ops(kernels):
    query, key_pack, probs, value_pack = attention_inputs(1, 2, 3, 1, 64, 32, 32, 2, torch.float16)
    with use_backend("sycl"):
        scores = torch.ops.kivi_xpu.packed_key_scores(query, *key_pack, 64, 32, 2)
        combined = torch.ops.kivi_xpu.packed_value_combine(probs, *value_pack, 64, 32, 2)
    torch.testing.assert_close(scores, kernels.packed_key_scores(query, *key_pack, 64, 32, 2))
    torch.testing.assert_close(combined, kernels.packed_value_combine(probs, *value_pack, 64, 32, 2))


def test_packed_attention_direct_calls_are_checked(kernels):
    C, device = kernels._C, kernels.device
    query, (kc, ks, kz), probs, (vc, vs, vz) = attention_inputs(1, 2, 2, 1, 64, 32, 32, 2, torch.float16)
    scores, partial = torch.empty(1, 4, 1, 64), torch.empty(1, 4, 1, 1, 32)
    C.packed_key_scores(device, query, kc, ks, kz, scores, 64, 32, 2)  # the valid calls, for contrast
    C.packed_value_combine(device, probs, vc, vs, vz, partial, 64, 32, 2, 256)
    bad_calls = [
        (
            TypeError,
            "`query` must be float32",
            lambda: C.packed_key_scores(device, query.half(), kc, ks, kz, scores, 64, 32, 2),
        ),
        (ValueError, "`query` shape", lambda: C.packed_key_scores(device, query[:, :3], kc, ks, kz, scores, 64, 32, 2)),
        (
            ValueError,
            "head_dim",
            lambda: C.packed_key_scores(device, query[..., :16].contiguous(), kc, ks, kz, scores, 64, 32, 2),
        ),
        (ValueError, "`num_tokens`", lambda: C.packed_key_scores(device, query, kc, ks, kz, scores, 96, 32, 2)),
        (ValueError, "`num_tokens`", lambda: C.packed_key_scores(device, query, kc, ks, kz, scores, 48, 32, 2)),
        (
            ValueError,
            "`out` must have shape",
            lambda: C.packed_key_scores(device, query, kc, ks, kz, torch.empty(1, 4, 1, 32), 64, 32, 2),
        ),
        (
            ValueError,
            "`query` must be contiguous",
            lambda: C.packed_key_scores(
                device, torch.randn(1, 4, 32, 2).transpose(2, 3), kc, ks, kz, scores, 64, 32, 2
            ),
        ),
        (
            TypeError,
            "`scales` and `zeros`",
            lambda: C.packed_key_scores(device, query, kc, ks, kz.float(), scores, 64, 32, 2),
        ),
        (
            ValueError,
            "`probs` last dim",
            lambda: C.packed_value_combine(device, probs[..., :32].contiguous(), vc, vs, vz, partial, 64, 32, 2, 256),
        ),
        (
            ValueError,
            "`num_tokens`",
            lambda: C.packed_value_combine(device, torch.rand(1, 4, 1, 80), vc, vs, vz, partial, 80, 32, 2, 256),
        ),
        (
            ValueError,
            "`partial` must have rank 5",
            lambda: C.packed_value_combine(device, probs, vc, vs, vz, scores, 64, 32, 2, 256),
        ),
        (
            ValueError,
            "`out` must have shape",
            lambda: C.packed_value_combine(device, probs, vc, vs, vz, partial, 64, 32, 2, 32),
        ),
        (
            ValueError,
            "`chunk_tokens`",
            lambda: C.packed_value_combine(device, probs, vc, vs, vz, partial, 64, 32, 2, 0),
        ),
        (ValueError, "`bits`", lambda: C.packed_value_combine(device, probs, vc, vs, vz, partial, 64, 32, 3, 256)),
    ]
    for error, message, call in bad_calls:
        with pytest.raises(error, match=message):
            call()


# ---- bad input: Python exceptions naming the argument, never a crash --------------------------------------------


def test_bad_quantize_arguments(kernels):
    x = torch.randn(1, 2, 64, 64)
    with pytest.raises(TypeError, match="`x`"):
        kernels.quantize_keys(x.to(torch.int32), 32, 2)
    with pytest.raises(ValueError, match="`x`"):
        kernels.quantize_keys(x[0], 32, 2)
    with pytest.raises(ValueError, match="`group_size`"):
        kernels.quantize_keys(x, 48, 2)
    with pytest.raises(ValueError, match="`group_size`"):
        kernels.quantize_values(x, 6, 2)
    with pytest.raises(ValueError, match="`bits`"):
        kernels.quantize_values(x, 32, 3)
    with pytest.raises(ValueError, match="`x`"):
        kernels.quantize_keys(torch.empty(1, 2, 64, 64, device="meta"), 32, 2)


def test_bad_dequantize_arguments(kernels):
    codes, scales, zeros = kernels.quantize_keys(torch.randn(1, 2, 64, 64), 32, 2)
    with pytest.raises(ValueError, match="`codes` must be contiguous"):
        kernels.dequantize_keys(codes.transpose(2, 3), scales, zeros, 64, 32, 2)
    with pytest.raises(ValueError, match="`scales` and `zeros`"):
        kernels.dequantize_keys(codes, scales, zeros[:, :, :1], 64, 32, 2)
    with pytest.raises(ValueError, match="`num_tokens`"):
        kernels.dequantize_keys(codes, scales, zeros, 96, 32, 2)
    with pytest.raises(ValueError, match="`scales`"):
        kernels.dequantize_values(codes, scales, zeros, 64, 16, 2)  # key metadata [.., D, T/G] is not [.., T, D/G]
    with pytest.raises(TypeError, match="`codes`"):
        kernels.dequantize_keys(codes.float(), scales, zeros, 64, 32, 2)


def test_extension_checks_direct_calls(kernels):
    """The C++ side re-checks everything, so a direct call with bad tensors raises too."""
    C, device = kernels._C, kernels.device
    x = torch.randn(1, 2, 64, 64)
    codes = torch.empty(1, 2, 64, 16, dtype=torch.uint8)  # channel-major keys [B, H, D, T/P]
    scales, zeros = torch.empty(1, 2, 64, 2, dtype=torch.float16), torch.empty(1, 2, 64, 2, dtype=torch.float16)
    C.quantize_keys(device, x, codes, scales, zeros, 32, 2, False)  # the valid call, for contrast
    out = torch.empty(1, 2, 64, 64)
    q_keys, dq_keys, dq_values = C.quantize_keys, C.dequantize_keys, C.dequantize_values
    bad_calls = [
        (
            ValueError,
            "`codes` must have shape",
            lambda: C.quantize_keys(device, x, codes[:, :1], scales, zeros, 32, 2, False),
        ),
        (
            ValueError,
            "`x` must be contiguous",
            lambda: q_keys(device, x.transpose(2, 3), codes, scales, zeros, 32, 2, False),
        ),
        (TypeError, "`x`", lambda: C.quantize_keys(device, x.double(), codes, scales, zeros, 32, 2, False)),
        (
            TypeError,
            "`scales` and `zeros`",
            lambda: C.quantize_keys(device, x, codes, scales, zeros.float(), 32, 2, False),
        ),
        (ValueError, "`bits`", lambda: C.quantize_keys(device, x, codes, scales, zeros, 32, 5, False)),
        (ValueError, "`group_size`", lambda: C.quantize_values(device, x, codes, scales, zeros, 0, 2, False)),
        (ValueError, "`num_tokens`", lambda: C.dequantize_keys(device, codes, scales, zeros, out, 128, 32, 2)),
        (ValueError, "`num_tokens`", lambda: C.dequantize_keys(device, codes, scales, zeros, out, -32, 32, 2)),
        (ValueError, "`out` must have shape", lambda: dq_keys(device, codes, scales, zeros, out[:1, :1], 64, 32, 2)),
        (TypeError, "`codes` must be uint8", lambda: dq_values(device, codes.char(), scales, zeros, out, 64, 32, 2)),
        (
            ValueError,
            "not initialised",
            lambda: C.quantize_keys("level_zero:gpu:9", x, codes, scales, zeros, 32, 2, False),
        ),
    ]
    for error, message, call in bad_calls:
        with pytest.raises(error, match=message):
            call()


def test_unknown_device_filter_names_the_argument(kernels):
    with pytest.raises(ValueError, match="`device`='level_zero:gpu:7'.*available: .*" + kernels.device):
        runtime.sycl_runtime("level_zero:gpu:7")
    with pytest.raises(ValueError, match="`filter`: no SYCL device matches 'opencl:gpu:5'"):
        kernels._C.init("opencl:gpu:5")


def test_backend_selection(kernels, monkeypatch):
    monkeypatch.setenv(backend.BACKEND_ENV, "reference")
    assert backend.select().name == "reference"
    monkeypatch.setenv(backend.BACKEND_ENV, "sycl")
    selection = backend.select()
    assert selection.name == "sycl" and selection.sycl_device == kernels.device
    monkeypatch.setenv(backend.BACKEND_ENV, "gpu-please")
    with pytest.raises(ValueError, match=backend.BACKEND_ENV):
        backend.select()
    monkeypatch.setenv(backend.BACKEND_ENV, "auto")
    monkeypatch.setenv(backend.DEVICE_ENV, "opencl:accelerator:3")
    with pytest.raises(ValueError, match=backend.DEVICE_ENV):
        backend.select()
    monkeypatch.delenv(backend.DEVICE_ENV)
    facts = backend.info("sycl")
    assert facts["kernels_compiled"] and facts["device"] == kernels.device and facts["compile_seconds"] >= 0
    assert backend.PROBE_VARIANT in facts["compiled_variants"]


def test_clean_interpreter_exit(kernels):
    """Kernels and queues live until exit: the interpreter must still exit with status 0."""
    script = (
        "import torch, kivi_xpu.ops as ops\n"
        "s = ops.for_backend('sycl')\n"
        "c, sc, z = s.quantize_keys(torch.randn(1, 1, 32, 8), 32, 2)\n"
        "assert s.dequantize_keys(c, sc, z, 32, 32, 2).shape == (1, 1, 32, 8)\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
