"""kivi_xpu._cpu quantize / dequantize against the pure-PyTorch reference, bit for bit, on every ISA of this CPU.

Skipped when the extension is not built, unless KIVI_XPU_REQUIRE_NATIVE=1 (then a missing build fails).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from native_module import native
from rotated_values import assert_rotated_storage_close, random_orthogonal

from kivi_xpu.ops import reference
from kivi_xpu.rotation import rotation_matrix

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
BITS = (2, 4, 8)
FITS = ("minmax", "least_squares")
# (batch, heads, tokens, head_dim, key group, value group): awkward sizes reach every tail path (channels that are
# not a whole vector, groups that are not whole 32-bit words or whole vectors, empty tensors).
SHAPES = (
    (1, 1, 32, 32, 32, 32),
    (2, 3, 96, 64, 32, 32),
    (3, 5, 64, 96, 16, 16),
    (1, 3, 0, 128, 32, 64),
    (2, 1, 48, 40, 24, 8),
    (1, 5, 128, 128, 128, 128),
)


def bits_of(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of a tensor (NaN payloads and signed zeros included), for exact comparison."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def assert_identical(actual, expected, what: str) -> None:
    """Same bits (signed zeros included), except that any NaN matches any NaN: torch itself encodes a NaN
    differently depending on the code path (bf16 0x7FC0 from a scalar, 0xFFFF from a converted tensor)."""
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    differ = bits_of(actual) != bits_of(expected)
    if actual.is_floating_point():
        differ &= ~(actual.isnan() & expected.isnan())
    mismatch = differ.nonzero()
    assert mismatch.numel() == 0, (
        f"{what}: {mismatch.shape[0]} elements differ, first at {mismatch[0].tolist()}: "
        f"{actual[tuple(mismatch[0])].item()} != {expected[tuple(mismatch[0])].item()}"
    )


def awkward_input(shape, dtype, group: int, axis: int) -> torch.Tensor:
    """Random data plus the edge cases of the reference: NaN / Inf groups, constant groups, values beyond fp16's
    range, tiny (subnormal-scale) groups and ties of the rounding."""
    x = torch.randn(shape) * 4
    if x.numel() == 0:
        return x.to(dtype)
    flat = x.movedim(axis, -1)  # view: groups lie along the last dim of `flat`
    groups = flat.unflatten(-1, (-1, group))
    n = groups[..., 0].numel()
    pick = torch.randperm(n)
    g = groups.reshape(-1, group)
    if n >= 8:
        g[pick[0], group // 2] = float("nan")
        g[pick[1], 0] = float("inf")
        g[pick[2], group - 1] = float("-inf")
        g[pick[3]] = 1.2345
        g[pick[4]] = 70000.0 * torch.rand(group)  # scale / zero past fp16's 65504: NaN group in fp16 meta
        g[pick[5]] = 1e-6 * torch.randn(group)  # scale underflows fp16: constant-group rule
        g[pick[6]] = torch.arange(group, dtype=torch.float32) * 0.5  # exact halves: round-half-to-even ties
        g[pick[7]] = -65504.0 + torch.rand(group)
    return groups.reshape(flat.shape).movedim(-1, axis).contiguous().to(dtype)


@pytest.mark.parametrize("fit", FITS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_quantize_matches_reference(isa, shape, fit):
    b, h, t, d, key_group, value_group = shape
    for bits in BITS:
        for dtype in DTYPES:
            for meta_dtype in DTYPES:
                case = f"[{isa}] bits={bits} x={dtype} meta={meta_dtype} fit={fit}"
                x = awkward_input((b, h, t, d), dtype, key_group, axis=2)
                ours = native.quantize_keys(x, key_group, bits, meta_dtype, fit)
                theirs = reference.quantize_keys(x, key_group, bits, meta_dtype, fit)
                for name, a, e in zip(("codes", "scales", "zeros"), ours, theirs, strict=True):
                    assert_identical(a, e, f"quantize_keys {name} {case}")
                x = awkward_input((b, h, t, d), dtype, value_group, axis=3)
                ours = native.quantize_values(x, value_group, bits, meta_dtype, fit)
                theirs = reference.quantize_values(x, value_group, bits, meta_dtype, fit)
                for name, a, e in zip(("codes", "scales", "zeros"), ours, theirs, strict=True):
                    assert_identical(a, e, f"quantize_values {name} {case}")


def random_meta(shape, dtype) -> torch.Tensor:
    """Scales / zeros with NaN, Inf and zero entries mixed in (dequantize must follow them exactly)."""
    meta = torch.randn(shape) * 100
    if meta.numel() >= 4:
        meta.view(-1)[:4] = torch.tensor([float("nan"), float("inf"), 0.0, -0.0])
        meta = meta.view(-1)[torch.randperm(meta.numel())].view(shape)
    return meta.to(dtype)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_dequantize_matches_reference_on_over_allocated_buffers(isa, shape):
    b, h, t, d, key_group, value_group = shape
    spare = 2 * key_group  # capacity beyond num_tokens (over-allocated storage)
    for bits in BITS:
        per = 8 // bits
        for meta_dtype in DTYPES:
            codes = torch.randint(0, 256, (b, h, d, (t + spare) // per), dtype=torch.uint8)
            scales = random_meta((b, h, d, (t + spare) // key_group), meta_dtype)
            zeros = random_meta(scales.shape, meta_dtype)
            values = torch.randint(0, 256, (b, h, t + 3, d // per), dtype=torch.uint8)
            value_scales = random_meta((b, h, t + 3, d // value_group), meta_dtype)
            value_zeros = random_meta(value_scales.shape, meta_dtype)
            for out_dtype in DTYPES:
                case = f"[{isa}] bits={bits} meta={meta_dtype} out={out_dtype}"
                args = (codes, scales, zeros, t, key_group, bits, out_dtype)
                assert_identical(
                    native.dequantize_keys(*args), reference.dequantize_keys(*args), f"dequantize_keys {case}"
                )
                args = (values, value_scales, value_zeros, t, value_group, bits, out_dtype)
                assert_identical(
                    native.dequantize_values(*args), reference.dequantize_values(*args), f"dequantize_values {case}"
                )


def test_round_trip_through_native_ops(isa):
    x = torch.randn(2, 3, 64, 64)
    for bits in BITS:
        keys = native.quantize_keys(x, 32, bits, torch.float16)
        values = native.quantize_values(x, 32, bits, torch.float16)
        assert_identical(
            native.dequantize_keys(*keys, 64, 32, bits, torch.float32),
            reference.dequantize_keys(*reference.quantize_keys(x, 32, bits, torch.float16), 64, 32, bits),
            f"[{isa}] key round trip bits={bits}",
        )
        assert_identical(
            native.dequantize_values(*values, 64, 32, bits, torch.float32),
            reference.dequantize_values(*reference.quantize_values(x, 32, bits, torch.float16), 64, 32, bits),
            f"[{isa}] value round trip bits={bits}",
        )


def test_non_contiguous_input_is_quantized_like_its_contiguous_copy():
    x = torch.randn(2, 64, 3, 32).transpose(1, 2)  # [2, 3, 64, 32], not contiguous
    expected = reference.quantize_keys(x, 32, 2)
    for ours, theirs in zip(native.quantize_keys(x, 32, 2, torch.float16), expected, strict=True):
        assert_identical(ours, theirs, "non-contiguous quantize_keys")


def test_isa_reports_and_forcing():
    available = native.available_isas()
    assert available[-1] == "baseline" and native.isa() in available
    with pytest.raises(ValueError, match="expected one of avx512_vnni, avx512, avx2, baseline"):
        native.set_isa("sse9")


def run_child(code: str, isa: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "KIVI_XPU_CPU_ISA": isa}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("isa_name", native.available_isas())
def test_environment_variable_selects_the_isa(isa_name):
    child = run_child("from kivi_xpu import _cpu; print(_cpu.isa())", isa_name)
    assert child.returncode == 0, child.stderr
    assert child.stdout.strip() == isa_name


def test_environment_variable_rejects_unknown_or_missing_isa():
    code = "import torch; from kivi_xpu import _cpu; _cpu.quantize_values(torch.zeros(1, 1, 1, 32), 32, 2)"
    child = run_child(code, "avx1024")
    assert child.returncode != 0 and "expected one of avx512_vnni, avx512, avx2, baseline" in child.stderr
    missing = {"avx512_vnni", "avx512", "avx2"} - set(native.available_isas())
    for name in missing:
        child = run_child(code, name)
        assert child.returncode != 0 and f"this CPU lacks {name}" in child.stderr


def packed_keys():
    return native.quantize_keys(torch.randn(1, 2, 64, 32), 32, 2, torch.float16)


BAD_QUANTIZE = [
    ((torch.randn(2, 64, 32), 32, 2, torch.float16), ValueError, "rank 4"),
    ((torch.randn(1, 2, 64, 32).to(torch.float64), 32, 2, torch.float16), TypeError, "`x` must be one of"),
    ((torch.randn(1, 2, 64, 32), 32, 3, torch.float16), ValueError, "`bits` must be one of"),
    ((torch.randn(1, 2, 64, 32), 0, 2, torch.float16), ValueError, "`group_size` must be a positive multiple"),
    ((torch.randn(1, 2, 64, 32), 6, 2, torch.float16), ValueError, "`group_size` must be a positive multiple"),
    ((torch.randn(1, 2, 64, 32), 32, 2, torch.int32), TypeError, "`meta_dtype` must be one of"),
    ((torch.randn(1, 2, 48, 32), 32, 2, torch.float16), ValueError, "must divide"),
    ((torch.empty(1, 2, 64, 32, device="meta"), 32, 2, torch.float16), ValueError, "must be a CPU tensor"),
]


@pytest.mark.parametrize("args,error,message", BAD_QUANTIZE)
def test_quantize_rejects_bad_input(args, error, message):
    with pytest.raises(error, match=message):
        native.quantize_keys(*args)


def test_quantize_values_rejects_group_not_dividing_head_dim():
    with pytest.raises(ValueError, match="must divide the head_dim"):
        native.quantize_values(torch.randn(1, 2, 4, 48), 32, 2, torch.float16)


def test_dequantize_rejects_bad_input():
    codes, scales, zeros = packed_keys()
    cases = [
        ((codes.float(), scales, zeros, 64, 32, 2, torch.float32), TypeError, "`codes` must be uint8"),
        ((codes, scales, zeros.float(), 64, 32, 2, torch.float32), TypeError, "must share a dtype"),
        ((codes, scales, zeros[..., :0], 64, 32, 2, torch.float32), ValueError, "same shape"),
        ((codes, scales, zeros, 96, 32, 2, torch.float32), ValueError, "exceeds the stored tokens"),
        ((codes, scales, zeros, 48, 32, 2, torch.float32), ValueError, "multiple of `group_size`"),
        ((codes, scales, zeros, -32, 32, 2, torch.float32), ValueError, "non-negative"),
        ((codes, scales, zeros, 64, 32, 2, torch.int8), TypeError, "`out_dtype` must be one of"),
        ((codes.transpose(2, 3), scales, zeros, 64, 32, 2, torch.float32), ValueError, "contiguous"),
        ((codes[0], scales, zeros, 64, 32, 2, torch.float32), ValueError, "rank 4"),
        ((codes, scales[:1, :1], zeros[:1, :1], 64, 32, 2, torch.float32), ValueError, "batch/heads"),
    ]
    for args, error, message in cases:
        with pytest.raises(error, match=message):
            native.dequantize_keys(*args)
    values = native.quantize_values(torch.randn(1, 2, 4, 64), 32, 2, torch.float16)
    with pytest.raises(ValueError, match="exceeds the stored tokens"):
        native.dequantize_values(*values, 5, 32, 2, torch.float32)
    with pytest.raises(ValueError, match="last dim"):
        native.dequantize_values(*values, 4, 16, 2, torch.float32)


def near_tie_input(shape, group: int, axis: int, bits: int) -> torch.Tensor:
    """fp32 groups (along `axis`) whose first two elements fix min and max, and whose other elements sit on or a few
    ulps beside the half-integers of (x - zero) / scale: where rounding a product with the reciprocal of the scale
    can differ from rounding the reference's exact quotient."""
    groups = (torch.randn(shape) * 3).movedim(axis, -1).unflatten(-1, (-1, group)).contiguous()
    lo, hi = groups[..., :1], groups[..., 1:2].abs() + groups[..., :1].abs() + groups[..., :1]
    scale, qmax = (hi - lo) / (2**bits - 1), 2**bits - 1
    halves = torch.randint(0, qmax, groups[..., 2:].shape) + 0.5
    nudge = 1 + torch.randint(-3, 4, halves.shape) * 2.0**-23
    groups[..., 2:] = torch.minimum(torch.maximum((lo + halves * scale) * nudge, lo), hi)
    groups[..., :1], groups[..., 1:2] = lo, hi
    return groups.flatten(-2).movedim(-1, axis).contiguous()


@pytest.mark.parametrize("fit", FITS)
@pytest.mark.parametrize("bits", BITS)
def test_quantize_near_rounding_ties_matches_reference(isa, bits, fit):
    for axis, group, quantize, name in ((2, 32, "quantize_keys", "keys"), (3, 16, "quantize_values", "values")):
        x = near_tie_input((2, 3, 64, 64), group, axis, bits)
        # The test only means something if a reciprocal product rounds differently from the division somewhere.
        flat = x.movedim(axis, -1).unflatten(-1, (-1, group))
        lo, hi = flat.amin(-1, keepdim=True), flat.amax(-1, keepdim=True)
        scale = (hi - lo) / (2**bits - 1)
        assert (((flat - lo) * (1 / scale)).round() != ((flat - lo) / scale).round()).any()
        ours = getattr(native, quantize)(x, group, bits, torch.float32, fit)
        theirs = getattr(reference, quantize)(x, group, bits, torch.float32, fit)
        for part, a, e in zip(("codes", "scales", "zeros"), ours, theirs, strict=True):
            assert_identical(a, e, f"{quantize} {part} [{isa}] bits={bits} fit={fit} near ties ({name})")


def value_storage(b: int, h: int, capacity: int, d: int, group: int, bits: int, meta_dtype: torch.dtype) -> tuple:
    """Zeroed packed value storage: codes [b, h, capacity, d * bits / 8], scales, zeros [b, h, capacity, d / group]."""
    meta = (b, h, capacity, d // group)
    codes = torch.zeros(b, h, capacity, d * bits // 8, dtype=torch.uint8)
    return codes, torch.zeros(meta, dtype=meta_dtype), torch.zeros(meta, dtype=meta_dtype)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_quantize_values_into_matches_reference(isa, shape):
    b, h, t, d, _, value_group = shape
    for bits in BITS:
        for dtype in DTYPES:
            for meta_dtype in DTYPES:
                x = awkward_input((b, h, t, d), dtype, value_group, axis=3)
                capacity, offset = t + 7, 3
                ours = value_storage(b, h, capacity, d, value_group, bits, meta_dtype)
                theirs = tuple(part.clone() for part in ours)
                for fit in FITS:
                    native.quantize_values_into(x, *ours, offset, value_group, bits, None, fit)
                    reference.quantize_values_into(x, *theirs, offset, value_group, bits, None, fit)
                    for name, a, e in zip(("codes", "scales", "zeros"), ours, theirs, strict=True):
                        what = f"quantize_values_into {name} [{isa}] bits={bits} x={dtype} meta={meta_dtype} fit={fit}"
                        assert_identical(a, e, what)


# (batch, heads, tokens, head_dim, value group): head_dims whose Hadamard blocks are 16, 64, 8 and 32 channels.
ROTATED_SHAPES = ((2, 3, 37, 48, 16), (1, 2, 9, 64, 32), (3, 1, 21, 72, 24), (2, 2, 1, 96, 32), (1, 1, 0, 64, 8))


@pytest.mark.parametrize("shape", ROTATED_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("kind", ("hadamard", "orthogonal"))
def test_quantize_values_into_with_rotation_matches_reference(isa, shape, kind):
    """x @ Q quantized in the kernel (its own fp32 matmul, then the quantizer) against the reference (torch's matmul,
    then the quantizer), for x of every dtype and awkward values (NaN / Inf groups, beyond fp16...)."""
    b, h, t, d, value_group = shape
    rotation = rotation_matrix("hadamard", d) if kind == "hadamard" else random_orthogonal(d)
    for bits in BITS:
        for dtype in DTYPES:
            for meta_dtype in DTYPES:
                x = awkward_input((b, h, t, d), dtype, value_group, axis=3)
                capacity, offset = t + 5, 2
                ours = value_storage(b, h, capacity, d, value_group, bits, meta_dtype)
                theirs = tuple(part.clone() for part in ours)
                native.quantize_values_into(x, *ours, offset, value_group, bits, rotation)
                reference.quantize_values_into(x, *theirs, offset, value_group, bits, rotation)
                what = f"quantize_values_into [{isa}] {kind} bits={bits} x={dtype} meta={meta_dtype}"
                assert_rotated_storage_close(ours, theirs, bits, what, x, rotation, offset)
                if t and bits == 8 and meta_dtype == torch.float32:  # fine enough to tell a rotation from none
                    plain = tuple(part.clone() for part in theirs)
                    reference.quantize_values_into(x, *plain, offset, value_group, bits)
                    assert not torch.equal(plain[0], ours[0]), what


@pytest.mark.parametrize("fit", FITS)
@pytest.mark.parametrize("head_dim", (48, 64))
def test_quantize_values_into_with_an_exact_rotation_is_bit_identical(isa, head_dim, fit):
    """Where x @ Q is exact in float32 whatever the order of the sums (small integers times the Hadamard entries
    1/4 or 1/8), the kernel's codes and metadata equal the reference's bit for bit (rounding ties included); so
    with the least-squares fit too, which a last-bit difference of x @ Q may move by more than the fuzzy comparison
    of the test above allows (a code one step off changes the refit line)."""
    rotation = rotation_matrix("hadamard", head_dim)
    for bits in BITS:
        for dtype in DTYPES:
            x = torch.randint(-16, 17, (2, 3, 19, head_dim)).to(dtype)
            ours = (
                torch.zeros(2, 3, 23, head_dim * bits // 8, dtype=torch.uint8),
                torch.zeros(2, 3, 23, head_dim // 16, dtype=torch.float32),
                torch.zeros(2, 3, 23, head_dim // 16, dtype=torch.float32),
            )
            theirs = tuple(part.clone() for part in ours)
            native.quantize_values_into(x, *ours, 4, 16, bits, rotation, fit)
            reference.quantize_values_into(x, *theirs, 4, 16, bits, rotation, fit)
            for name, a, e in zip(("codes", "scales", "zeros"), ours, theirs, strict=True):
                what = f"quantize_values_into {name} [{isa}] bits={bits} x={dtype} fit={fit} exact rotation"
                assert_identical(a, e, what)


def test_quantize_values_into_rotation_wider_than_the_row_buffers(isa):
    """head_dim 1024 exceeds the kernels' stack rows: the extension rotates with torch, still x @ Q."""
    rotation = rotation_matrix("hadamard", 1024)
    x = torch.randn(1, 2, 3, 1024, dtype=torch.bfloat16)
    ours = (
        torch.zeros(1, 2, 4, 1024 // 4, dtype=torch.uint8),
        torch.zeros(1, 2, 4, 32, dtype=torch.float16),
        torch.zeros(1, 2, 4, 32, dtype=torch.float16),
    )
    theirs = tuple(part.clone() for part in ours)
    native.quantize_values_into(x, *ours, 1, 32, 2, rotation)
    reference.quantize_values_into(x, *theirs, 1, 32, 2, rotation)
    assert_rotated_storage_close(ours, theirs, 2, f"quantize_values_into [{isa}] head_dim 1024", x, rotation, 1)


def test_native_quantize_values_into_rejects_a_bad_rotation():
    x, storage = torch.randn(1, 2, 3, 64), quantized_storage(1, 2, 4, 64)
    for bad in (torch.eye(32), torch.eye(64, dtype=torch.float64), torch.eye(64).view(1, 64, 64)):
        with pytest.raises(ValueError, match="`rotation` must be a float32 \\[64, 64\\] CPU tensor"):
            native.quantize_values_into(x, *storage, 0, 32, 2, bad)


def quantized_storage(batch, heads, capacity, head_dim, bits=2, group=32):
    codes = torch.zeros(batch, heads, capacity, head_dim * bits // 8, dtype=torch.uint8)
    scales = torch.zeros(batch, heads, capacity, head_dim // group, dtype=torch.float16)
    return codes, scales, scales.clone()


# Packed codes placed so that they end exactly where a PROT_NONE page begins: a kernel reading one byte past them
# dies with SIGSEGV (in a child process, so the test reports it instead of crashing).
GUARDED_DEQUANTIZE = """
import ctypes, mmap, torch
from kivi_xpu import _cpu
page = mmap.PAGESIZE
memory = mmap.mmap(-1, 2 * page)
start = ctypes.addressof(ctypes.c_char.from_buffer(memory))
assert ctypes.CDLL(None).mprotect(ctypes.c_void_p(start + page), ctypes.c_size_t(page), 0) == 0
for bits in (2, 4, 8):
    for tokens in (1, 3, 32):
        size = tokens * 64 * bits // 8
        codes = torch.frombuffer(memory, dtype=torch.uint8, count=size, offset=page - size)
        codes.fill_(0x5A)
        meta = torch.ones(1, 1, tokens, 2, dtype=torch.float16)
        out = _cpu.dequantize_values(codes.view(1, 1, tokens, -1), meta, meta, tokens, 32, bits, torch.float32)
        assert out.isfinite().all()
        if tokens == 32:  # the same bytes as the codes of 32 keys of 64 channels
            key_meta = torch.ones(1, 1, 64, 1, dtype=torch.float16)
            _cpu.dequantize_keys(codes.view(1, 1, 64, -1), key_meta, key_meta, 32, 32, bits, torch.float32)
print("ok")
"""


@pytest.mark.parametrize("isa_name", native.available_isas())
def test_dequantize_reads_no_byte_past_the_packed_codes(isa_name):
    child = run_child(GUARDED_DEQUANTIZE, isa_name)
    assert child.returncode == 0 and child.stdout.strip() == "ok", (child.returncode, child.stderr[-2000:])
