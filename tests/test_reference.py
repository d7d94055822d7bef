"""The pure-PyTorch reference quantizer: known values, error bounds, edge cases, bad input."""

import pytest
import torch

from kivi_xpu.ops import for_backend
from kivi_xpu.ops import reference as ref

BITS = (2, 4, 8)


def test_known_value_packs_to_228():
    x = torch.tensor([1.0, 2.0, 3.0, 4.0]).view(1, 1, 1, 4)
    codes, scales, zeros = ref.quantize_values(x, group_size=4, bits=2)
    assert codes.item() == 228  # 0 | 1<<2 | 2<<4 | 3<<6
    assert scales.item() == 1.0 and zeros.item() == 1.0
    assert torch.equal(ref.dequantize_values(codes, scales, zeros, 1, 4, 2), x)
    # The same numbers as one channel of four tokens, per-channel keys.
    codes, scales, zeros = ref.quantize_keys(x.view(1, 1, 4, 1), group_size=4, bits=2)
    assert codes.item() == 228 and scales.item() == 1.0 and zeros.item() == 1.0
    assert torch.equal(ref.dequantize_keys(codes, scales, zeros, 4, 4, 2), x.view(1, 1, 4, 1))


@pytest.mark.parametrize("bits", BITS)
def test_pack_unpack_inverse(bits):
    q = torch.randint(0, 1 << bits, (2, 3, 16, 8), dtype=torch.int32)
    for dim in (2, 3):
        packed = ref.pack(q, dim, bits)
        assert packed.dtype == torch.uint8 and packed.shape[dim] == q.shape[dim] * bits // 8
        assert torch.equal(ref.unpack(packed, dim, bits), q)


def _per_element(meta, group_size, kind):
    """Scales/zeros expanded to the ``[B, H, T, D]`` elements they apply to."""
    if kind == "keys":  # [B, H, D, T/G], channel-major
        return meta.float().repeat_interleave(group_size, dim=3).transpose(2, 3)
    return meta.float().repeat_interleave(group_size, dim=3)  # values: [B, H, T, D/G]


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("meta_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_round_trip_error_within_half_a_step(bits, meta_dtype):
    torch.manual_seed(bits)
    x = torch.randn(3, 2, 64, 96) * 3 + 1
    g = 32
    for quant, dequant, kind in (
        (ref.quantize_keys, ref.dequantize_keys, "keys"),
        (ref.quantize_values, ref.dequantize_values, "values"),
    ):
        codes, scales, zeros = quant(x, g, bits, meta_dtype)
        assert scales.dtype == meta_dtype and zeros.dtype == meta_dtype
        y = dequant(codes, scales, zeros, x.shape[2], g, bits, torch.float32)
        err = (y - x).abs()
        step = _per_element(scales, g, kind)
        # Half a step, plus the metadata's own rounding: zero is rounded to meta_dtype (up to half an ulp of
        # |min|) and the 2^b-1 steps each carry the scale's rounding (half an ulp of the scale).
        eps = torch.finfo(meta_dtype).eps
        zero_err = _per_element(zeros, g, kind).abs() * eps
        bound = step / 2 + zero_err + step * ((1 << bits) - 1) * eps + 1e-6
        assert (err <= bound).all(), (err - bound).max()
        if meta_dtype == torch.float32:
            assert (err <= step / 2 * (1 + 1e-4) + 1e-6).all()


def _group_errors(x, bits, meta_dtype, fit):
    """Squared error of each value group (of 32 channels) of ``x`` quantized with ``fit``."""
    c, s, z = ref.quantize_values(x, 32, bits, meta_dtype, fit)
    y = ref.dequantize_values(c, s, z, x.shape[2], 32, bits)
    return ((y - x) ** 2).unflatten(3, (-1, 32)).sum(-1)


@pytest.mark.parametrize("bits", BITS)
def test_least_squares_fit_never_loses_to_minmax_beyond_rounding(bits):
    """The refit line is the best line for the min-max codes and requantizing to the nearest level cannot undo that:
    with float32 metadata no group's error grows beyond float rounding, and on Gaussian groups the mean falls."""
    torch.manual_seed(bits)
    x = torch.randn(2, 3, 64, 96) * torch.empty(96).uniform_(0.1, 4.0) + 0.5
    x[0, 0, 3, :32] = torch.arange(32.0)  # an evenly spread group: min-max already fits it (det > 0, no change)
    x[0, 1, 4, :32] = 2.0  # a constant group: no usable line, the min-max fit stays
    minmax = _group_errors(x, bits, torch.float32, "minmax")
    least = _group_errors(x, bits, torch.float32, "least_squares")
    assert (least <= minmax * (1 + 1e-4) + 1e-6).all()
    assert least.mean() < minmax.mean() * (0.8 if bits == 2 else 0.95)
    assert least[0, 1, 4, 0] == 0  # the constant group stays exact
    c, s, z = ref.quantize_values(x, 32, bits, torch.float32, "least_squares")
    assert s[0, 1, 4, 0] == 0 and z[0, 1, 4, 0] == 2.0


def test_least_squares_fit_keeps_non_finite_groups_nan():
    x = torch.randn(1, 1, 2, 64)
    x[0, 0, 0, 5] = float("nan")
    x[0, 0, 1, 40] = float("inf")
    c, s, z = ref.quantize_values(x, 32, 2, torch.float16, "least_squares")
    y = ref.dequantize_values(c, s, z, 2, 32, 2)
    assert y[0, 0, 0, :32].isnan().all() and y[0, 0, 1, 32:].isnan().all()
    assert torch.isfinite(y[0, 0, 0, 32:]).all() and torch.isfinite(y[0, 0, 1, :32]).all()


def test_error_shrinks_with_bits():
    torch.manual_seed(0)
    x = torch.randn(1, 4, 128, 64)
    errors = {}
    for b in BITS:
        c, s, z = ref.quantize_values(x, 32, b)
        errors[b] = (ref.dequantize_values(c, s, z, 128, 32, b) - x).abs().mean().item()
    assert errors[8] < errors[4] / 8 < errors[2] / 16


@pytest.mark.parametrize("bits", BITS)
def test_constant_groups_reconstruct_exactly(bits):
    x = torch.full((2, 2, 64, 32), 0.375)  # representable in fp16
    x[1] = -2.5
    for quant, dequant in ((ref.quantize_keys, ref.dequantize_keys), (ref.quantize_values, ref.dequantize_values)):
        codes, scales, zeros = quant(x, 32, bits)
        assert (scales == 0).all() and (codes == 0).all()
        y = dequant(codes, scales, zeros, 64, 32, bits)
        assert torch.equal(y, x)


def test_non_finite_group_dequantizes_to_nan_and_leaves_others_alone():
    x = torch.randn(1, 1, 64, 64)
    x[0, 0, 5, 3] = float("nan")
    x[0, 0, 40, 7] = float("inf")
    codes, scales, zeros = ref.quantize_keys(x, 32, 2)
    y = ref.dequantize_keys(codes, scales, zeros, 64, 32, 2)
    assert y[0, 0, :32, 3].isnan().all() and y[0, 0, 32:, 7].isnan().all()
    nan_mask = torch.zeros_like(y, dtype=torch.bool)
    nan_mask[0, 0, :32, 3] = True
    nan_mask[0, 0, 32:, 7] = True
    assert torch.isfinite(y[~nan_mask]).all()
    # fp16 metadata overflow (|x| > 65504) is non-finite too: NaN, never a wrong finite value.
    big = torch.tensor([0.0, 1e6, 2.0, 3.0]).view(1, 1, 1, 4)
    c, s, z = ref.quantize_values(big, 4, 2, torch.float16)
    assert ref.dequantize_values(c, s, z, 1, 4, 2).isnan().all()
    c, s, z = ref.quantize_values(big, 4, 2, torch.float32)
    assert torch.isfinite(ref.dequantize_values(c, s, z, 1, 4, 2)).all()


def test_multi_batch_head_groups_are_independent():
    torch.manual_seed(1)
    x = torch.randn(2, 3, 64, 64)
    codes, scales, zeros = ref.quantize_keys(x, 32, 2)
    for b in range(2):
        for h in range(3):
            c1, s1, z1 = ref.quantize_keys(x[b : b + 1, h : h + 1], 32, 2)
            assert torch.equal(c1, codes[b : b + 1, h : h + 1])
            assert torch.equal(s1, scales[b : b + 1, h : h + 1]) and torch.equal(z1, zeros[b : b + 1, h : h + 1])


def test_dequantize_reads_only_num_tokens_of_larger_buffers():
    x = torch.randn(1, 2, 96, 64)
    codes, scales, zeros = ref.quantize_keys(x, 32, 2)
    full = ref.dequantize_keys(codes, scales, zeros, 96, 32, 2)
    assert torch.equal(ref.dequantize_keys(codes, scales, zeros, 64, 32, 2), full[:, :, :64])
    codes, scales, zeros = ref.quantize_values(x, 32, 2)
    full = ref.dequantize_values(codes, scales, zeros, 96, 32, 2)
    assert torch.equal(ref.dequantize_values(codes, scales, zeros, 5, 32, 2), full[:, :, :5])


# The argument checks run once per call in front of every backend (kivi_xpu.ops.declarations).
checked = for_backend("reference")


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda x: checked.quantize_keys(x, 32, 3), "bits"),
        (lambda x: checked.quantize_keys(x, 30, 2), "group_size"),
        (lambda x: checked.quantize_keys(x[:, :, :40], 32, 2), "group_size"),
        (lambda x: checked.quantize_values(x[..., :48], 32, 2), "group_size"),
        (lambda x: checked.quantize_keys(x.double(), 32, 2), "dtype"),
        (lambda x: checked.quantize_keys(x[0], 32, 2), "rank"),
        (lambda x: checked.quantize_keys(x, 32, 2, torch.int8), "meta_dtype"),
        (lambda x: checked.quantize_keys(x.tolist(), 32, 2), "torch.Tensor"),
        (lambda x: checked.quantize_values(x, 32, 2, torch.float16, "mse"), "fit"),
    ],
)
def test_bad_quantize_input_names_the_argument(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call(torch.randn(1, 2, 64, 64))


def test_bad_dequantize_input_names_the_argument():
    codes, scales, zeros = ref.quantize_keys(torch.randn(1, 2, 64, 64), 32, 2)
    with pytest.raises(ValueError, match="num_tokens"):
        checked.dequantize_keys(codes, scales, zeros, 96, 32, 2)
    with pytest.raises(ValueError, match="num_tokens"):
        checked.dequantize_keys(codes, scales, zeros, 48, 32, 2)
    with pytest.raises(ValueError, match="scales"):
        checked.dequantize_keys(codes, scales[:, :1], zeros[:, :1], 64, 32, 2)
    with pytest.raises(TypeError, match="scales"):
        checked.dequantize_keys(codes, scales.float(), zeros, 64, 32, 2)
    with pytest.raises(ValueError, match="contiguous"):
        checked.dequantize_keys(codes.transpose(2, 3), scales, zeros, 16, 32, 2)
    with pytest.raises(TypeError, match="codes"):
        checked.dequantize_keys(codes.float(), scales, zeros, 64, 32, 2)
    with pytest.raises(ValueError, match="out_dtype"):
        checked.dequantize_keys(codes, scales, zeros, 64, 32, 2, torch.int32)
