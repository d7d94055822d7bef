"""The torch.library registration of the ops, the info command, and CI's backend guarantee."""

import json
import os
import subprocess
import sys

import pytest
import torch
from rotated_values import assert_rotated_storage_close, random_orthogonal

from kivi_xpu import ops
from kivi_xpu.ops import integer_twin, reference
from kivi_xpu.rotation import rotation_matrix

QUANTIZATION_OPS = ("quantize_keys", "quantize_values", "dequantize_keys", "dequantize_values")


def sample_args(op, bits=2, dtype=torch.float32):
    x = torch.randn(2, 3, 64, 64, dtype=dtype)
    if op.startswith("quantize"):
        return (x, 32, bits, torch.float16)
    quantize = reference.quantize_keys if op.endswith("keys") else reference.quantize_values
    codes, scales, zeros = quantize(x, 32, bits, torch.float16)
    return (codes, scales, zeros, 32, 32, bits, torch.bfloat16)


@pytest.mark.parametrize("op", QUANTIZATION_OPS)
@pytest.mark.parametrize("bits", (2, 8))
def test_opcheck(op, bits):
    torch.library.opcheck(getattr(torch.ops.kivi_xpu, op), sample_args(op, bits))


@pytest.mark.parametrize("op", QUANTIZATION_OPS)
def test_registered_op_equals_the_reference(op):
    args = sample_args(op, dtype=torch.float16)
    out = getattr(torch.ops.kivi_xpu, op)(*args)
    expected = getattr(reference, op)(*args)
    for got, want in zip(
        out if isinstance(out, tuple) else (out,), expected if isinstance(expected, tuple) else (expected,), strict=True
    ):
        assert torch.equal(got, want)


def test_fake_tensors_give_shapes_without_computing():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        codes, scales, zeros = torch.ops.kivi_xpu.quantize_keys(torch.empty(1, 2, 128, 64), 32, 2, torch.float16)
        assert codes.shape == (1, 2, 64, 32) and scales.shape == (1, 2, 64, 4) and zeros.dtype == torch.float16
        out = torch.ops.kivi_xpu.dequantize_values(
            torch.empty(1, 2, 50, 16, dtype=torch.uint8),
            torch.empty(1, 2, 50, 2, dtype=torch.float16),
            torch.empty(1, 2, 50, 2, dtype=torch.float16),
            40,
            32,
            2,
            torch.float32,
        )
        assert out.shape == (1, 2, 40, 64)


def test_cpu_ops_use_the_sycl_kernels_in_ci():
    if os.environ.get("KIVI_XPU_REQUIRE_SYCL") == "1":
        assert ops.cpu_backend() != "reference", "CI requires fast kernels behind torch.ops.kivi_xpu on CPU tensors"


def test_info_command_reports_the_backend():
    result = subprocess.run(
        [sys.executable, "-m", "kivi_xpu", "info", "--json"], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    facts = json.loads(result.stdout)
    assert facts["torch"] == torch.__version__
    if os.environ.get("KIVI_XPU_REQUIRE_SYCL") == "1":
        assert facts["backend"] == "sycl" and facts["kernels_compiled"]
        assert any(d["filter"].startswith("opencl:cpu") for d in facts["devices"])


def test_unknown_device_is_a_clear_error():
    result = subprocess.run(
        [sys.executable, "-m", "kivi_xpu", "info", "--backend", "auto", "--sycl-device", "level_zero:gpu:7"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 1 and "matches no SYCL device" in result.stdout


def attention_args(op, gqa=3, length=2, tokens=96, sinks=2, mask=True):
    """Arguments of the attention ops on a small GQA layer (2 kv heads, head_dim 32, 2-bit G32)."""
    keys, values = torch.randn(2, 2, 128, 32), torch.randn(2, 2, 128, 32)
    key_pack = reference.quantize_keys(keys, 32, 2, torch.float16)
    value_pack = reference.quantize_values(values, 32, 2, torch.float16)
    query = torch.randn(2, 2 * gqa, length, 32)
    if op == "packed_key_scores":
        return (query, *key_pack, tokens, 32, 2)
    if op == "packed_value_combine":
        return (torch.softmax(torch.randn(2, 2 * gqa, length, tokens), -1), *value_pack, tokens, 32, 2)
    n = sinks + 64 + 40
    attend = torch.ones(2, 1, length, n, dtype=torch.bool).tril(n - length)
    attend[1, :, :, :3] = False  # left padding of the second sequence
    return (
        query,
        torch.randn(2, 2, sinks, 32),
        *key_pack,
        64,
        32,
        2,
        torch.randn(2, 2, 40, 32),
        torch.randn(2, 2, sinks, 32),
        *value_pack,
        100,
        32,
        2,
        torch.randn(2, 2, 4, 32),
        attend if mask else None,
        0.125,
        0.0,
    )


@pytest.mark.parametrize("op", ("packed_key_scores", "packed_value_combine", "decode_attention"))
def test_opcheck_attention_ops(op):
    torch.library.opcheck(getattr(torch.ops.kivi_xpu, op), attention_args(op))


def skip_unless_available(backend: str) -> None:
    if backend != "reference":
        from kivi_xpu.backend import select

        try:
            select(backend)
        except RuntimeError as error:
            pytest.skip(str(error))


def value_storage(batch, heads, capacity, head_dim, bits=2, group=32, meta_dtype=torch.float16):
    """Empty (NaN-filled metadata) packed value storage ``codes, scales, zeros`` of ``capacity`` tokens."""
    codes = torch.zeros(batch, heads, capacity, head_dim * bits // 8, dtype=torch.uint8)
    scales = torch.full((batch, heads, capacity, head_dim // group), float("nan"), dtype=meta_dtype)
    return codes, scales, scales.clone()


def test_opcheck_quantize_values_into():
    x = torch.randn(2, 3, 5, 64)
    torch.library.opcheck(torch.ops.kivi_xpu.quantize_values_into, (x, *value_storage(2, 3, 11, 64), 4, 32, 2))


@pytest.mark.parametrize("backend", ("reference", "sycl", "native"))
@pytest.mark.parametrize("meta_dtype", (torch.float16, torch.float32))
def test_quantize_values_into_writes_only_its_rows(backend, meta_dtype):
    """Rows [offset, offset + n) of the storage equal quantize_values of the tokens; every other row is untouched."""
    skip_unless_available(backend)
    x = torch.randn(2, 3, 5, 96, dtype=torch.bfloat16)
    storage = value_storage(2, 3, 13, 96, bits=4, meta_dtype=meta_dtype)
    ops.for_backend(backend).quantize_values_into(x, *storage, 6, 32, 4)
    expected = reference.quantize_values(x, 32, 4, meta_dtype)
    for buffer, part in zip(storage, expected, strict=True):
        assert torch.equal(buffer[:, :, 6:11], part)
        outside = torch.cat([buffer[:, :, :6], buffer[:, :, 11:]], dim=2)
        assert (outside == 0).all() if buffer.dtype == torch.uint8 else outside.isnan().all()


def test_quantize_values_into_checks_name_the_argument():
    x = torch.randn(1, 2, 4, 64)
    with pytest.raises(ValueError, match="`offset` \\+ tokens"):
        ops.call("quantize_values_into", "reference", x, *value_storage(1, 2, 6, 64), 3, 32, 2)
    with pytest.raises(ValueError, match="`offset` must be a non-negative integer"):
        ops.call("quantize_values_into", "reference", x, *value_storage(1, 2, 6, 64), -1, 32, 2)
    with pytest.raises(ValueError, match="`codes` must have shape"):
        ops.call("quantize_values_into", "reference", x, *value_storage(1, 3, 6, 64), 0, 32, 2)


def test_opcheck_quantize_values_into_with_a_rotation():
    x = torch.randn(2, 3, 5, 96)
    storage = value_storage(2, 3, 11, 96)
    torch.library.opcheck(
        torch.ops.kivi_xpu.quantize_values_into, (x, *storage, 4, 32, 2, rotation_matrix("hadamard", 96))
    )


@pytest.mark.parametrize("backend", ("reference", "sycl", "native"))
@pytest.mark.parametrize("head_dim", (48, 64, 72, 96))
def test_quantize_values_into_with_a_rotation_matches_the_reference(backend, head_dim):
    """Every backend stores x @ Q (Hadamard over the largest power-of-two block, and a non-symmetric orthogonal Q) as
    the reference does: rotate, then quantize."""
    skip_unless_available(backend)
    group = 8 if head_dim == 72 else 16
    for rotation in (rotation_matrix("hadamard", head_dim), random_orthogonal(head_dim)):
        for dtype, bits, meta_dtype in ((torch.bfloat16, 2, torch.float16), (torch.float32, 4, torch.float32)):
            x = torch.randn(2, 3, 7, head_dim, dtype=dtype) * 3
            x[0, 1, 2, 5] = 40  # an outlier channel: what the rotation is for
            ours = value_storage(2, 3, 12, head_dim, bits=bits, group=group, meta_dtype=meta_dtype)
            theirs = tuple(part.clone() for part in ours)
            ops.for_backend(backend).quantize_values_into(x, *ours, 3, group, bits, rotation=rotation)
            reference.quantize_values_into(x, *theirs, 3, group, bits, rotation)
            what = f"{backend} head_dim={head_dim} x={dtype} bits={bits}"
            assert_rotated_storage_close(ours, theirs, bits, what, x, rotation, 3)


def test_quantize_values_into_rotation_is_checked_by_name():
    x = torch.randn(1, 2, 4, 64)
    for bad, error, message in (
        (torch.eye(32), ValueError, "`rotation` must be a float32 \\[64, 64\\] matrix, got torch.float32 \\(32, 32\\)"),
        (
            torch.eye(64, dtype=torch.float16),
            ValueError,
            "`rotation` must be a float32 \\[64, 64\\] matrix, got torch.float16",
        ),
        (torch.eye(64, device="meta"), ValueError, "`rotation` is on meta but `x` is on cpu"),
        (torch.eye(64).tolist(), TypeError, "`rotation` must be None or a torch.Tensor, got list"),
    ):
        for backend in ("reference", "native", "sycl"):
            with pytest.raises(error, match=message):
                ops.call("quantize_values_into", backend, x, *value_storage(1, 2, 6, 64), 0, 32, 2, bad)
        if isinstance(bad, torch.Tensor):  # torch's dispatcher itself refuses a list for a Tensor? argument
            with pytest.raises(error, match=message):
                torch.ops.kivi_xpu.quantize_values_into(x, *value_storage(1, 2, 6, 64), 0, 32, 2, bad)


def decode_step_args(batch=2, heads=3, key_dim=64, value_dim=96, dtype=torch.float32, tokens=1, leaving=1):
    """``append_decode_step`` arguments: windows of capacity 9 holding rows [2, 6) (keys) and [1, 7) (values, 4
    sinks-free tokens leaving at most), strided new states ([B, m, H, D] transposed, as a model's projections give
    them), value storage of 10 tokens with 3 stored, a Hadamard rotation."""
    key_states = torch.randn(batch, tokens, heads, key_dim, dtype=dtype).transpose(1, 2)
    value_states = torch.randn(batch, tokens, heads, value_dim, dtype=dtype).transpose(1, 2)
    key_window = torch.randn(batch, heads, 9, key_dim, dtype=dtype)
    value_window = torch.randn(batch, heads, 9, value_dim, dtype=dtype)
    storage = value_storage(batch, heads, 10, value_dim)
    rotation = rotation_matrix("hadamard", value_dim)
    return (key_states, value_states, key_window, 2, 6, value_window, 1, 7, *storage, 3, leaving, 32, 2, rotation)


def test_opcheck_append_decode_step():
    # Its outputs are views of its inputs (the schema says so), which functionalization (torch.compile's
    # AOT dispatch) does not support for custom ops; the cache is not compileable anyway (is_compileable = False).
    tests = ("test_schema", "test_autograd_registration", "test_faketensor")
    torch.library.opcheck(torch.ops.kivi_xpu.append_decode_step, decode_step_args(), test_utils=tests)


@pytest.mark.parametrize("backend", ("reference", "sycl", "native"))
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("tokens, leaving", ((1, 0), (1, 1), (2, 2), (2, 0)))
def test_append_decode_step_equals_the_reference(backend, dtype, tokens, leaving):
    """Every backend writes the new rows into the windows and the leaving value rows into the storage exactly as
    the reference does (and nothing else), and returns the tails as views of the windows."""
    skip_unless_available(backend)
    ours = decode_step_args(dtype=dtype, tokens=tokens, leaving=leaving)
    theirs = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in ours)
    key_tail, value_tail = ops.for_backend(backend).append_decode_step(*ours)
    expected = reference.append_decode_step(*theirs)
    for got, want in zip((key_tail, value_tail), expected, strict=True):
        assert torch.equal(got, want)
    assert key_tail.data_ptr() == ours[2][:, :, 2:].data_ptr() and key_tail.shape[2] == 4 + tokens
    assert value_tail.data_ptr() == ours[5][:, :, 1:].data_ptr() and value_tail.shape[2] == 6 + tokens
    for index in (2, 5, 8, 9, 10):  # windows and value storage (NaN where never written), every row
        torch.testing.assert_close(ours[index], theirs[index], rtol=0, atol=0, equal_nan=True, msg=str(index))


def test_append_decode_step_quantizes_the_oldest_window_rows():
    args = decode_step_args(tokens=2, leaving=3)
    value_window, codes, scales, zeros, rotation = args[5], *args[8:11], args[15]
    leaving = value_window[:, :, 1:4].clone()
    reference.append_decode_step(*args)
    expected = value_storage(2, 3, 10, 96)
    reference.quantize_values_into(leaving, *expected, 3, 32, 2, rotation)
    for got, want in zip((codes, scales, zeros), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("backend", ("reference", "native"))
def test_append_decode_step_checks_name_the_argument(backend):
    args = list(decode_step_args())
    for index, bad, message in (
        (4, 9, r"`key_end` \+ new tokens"),
        (3, 7, r"`key_start` \(7\) <= `key_end`"),
        (12, 9, r"`value_leaving` \(9\)"),
        (2, torch.randn(2, 3, 9, 32), "must match `key_window`"),
        (5, torch.randn(2, 3, 9, 96, dtype=torch.float16), "must match `value_window`"),
        (11, 10, r"`offset` \+ tokens"),
    ):
        bad_args = list(args)
        bad_args[index] = bad
        with pytest.raises(ValueError, match=message):
            ops.call("append_decode_step", backend, *bad_args)


def test_the_native_decode_step_rechecks_what_it_relies_on():
    """The unchecked native kernel (what the cache calls) still refuses rows outside its buffers by name."""
    skip_unless_available("native")
    step = ops.kernel("append_decode_step", "native")
    for index, bad, message in ((4, 9, "`key_window` rows"), (12, 9, "`value_leaving`"), (7, 9, "`value_window` rows")):
        bad_args = list(decode_step_args())
        bad_args[index] = bad
        with pytest.raises(ValueError, match=message):
            step(*bad_args)


def test_every_declared_op_is_covered_by_opcheck():
    covered = set(QUANTIZATION_OPS) | {"packed_key_scores", "packed_value_combine", "decode_attention"}
    covered |= {"quantize_values_into", "append_decode_step"}
    covered |= {"paged_decode_attention"}  # tests/test_paged_attention.py
    assert set(ops.OPS) == covered


def native_integer_arithmetic() -> bool:
    """Whether the native decode attention runs its int8 arithmetic (the default on AVX2 / AVX-512)."""
    from kivi_xpu import _cpu
    from kivi_xpu.runtime import attention_arithmetic

    return attention_arithmetic(_cpu) == "int8"


@pytest.mark.parametrize("backend", ("reference", "sycl", "native"))
@pytest.mark.parametrize("rotated", ("none", "keys", "values", "both"))
def test_decode_attention_backends_agree_with_the_reference(backend, rotated):
    skip_unless_available(backend)
    hadamard = rotation_matrix("hadamard", 32)
    rotations = (hadamard if rotated in ("keys", "both") else None, hadamard if rotated in ("values", "both") else None)
    for mask in (True, False):
        args = attention_args("decode_attention", length=1, mask=mask)
        if mask:
            args = (*args[:17], args[17][..., -1:, :], *args[18:])
        got = ops.call("decode_attention", backend, *args, *rotations)
        if backend == "native" and native_integer_arithmetic():  # the kernel's int8 rounding: its own twin
            torch.testing.assert_close(got, integer_twin.decode_attention(*args, *rotations), rtol=2e-3, atol=2e-3)
        else:
            torch.testing.assert_close(got, reference.decode_attention(*args, *rotations), rtol=1e-4, atol=1e-4)


def test_opcheck_decode_attention_with_rotations():
    hadamard = rotation_matrix("hadamard", 32)
    torch.library.opcheck(
        torch.ops.kivi_xpu.decode_attention, (*attention_args("decode_attention"), hadamard, hadamard)
    )


def test_decode_attention_rotation_checks_name_the_argument():
    args = attention_args("decode_attention")
    with pytest.raises(ValueError, match="`key_rotation` must be a float32 \\[32, 32\\]"):
        torch.ops.kivi_xpu.decode_attention(*args, torch.eye(16), None)
    with pytest.raises(ValueError, match="`value_rotation` must be a float32"):
        torch.ops.kivi_xpu.decode_attention(*args, None, torch.eye(32, dtype=torch.float64))
    with pytest.raises(TypeError, match="`key_rotation` must be None or a torch.Tensor"):
        ops.call("decode_attention", "reference", *args, "hadamard", None)


def test_decode_attention_checks_name_the_argument():
    args = list(attention_args("decode_attention"))
    args[16] = torch.randn(2, 2, 5, 32)  # one value token too many
    with pytest.raises(ValueError, match="value_tail"):
        torch.ops.kivi_xpu.decode_attention(*args)
    args = list(attention_args("decode_attention"))
    args[17] = args[17][..., :10]
    with pytest.raises(ValueError, match="`mask` shape"):
        torch.ops.kivi_xpu.decode_attention(*args)


def test_unknown_backend_or_op_is_a_clear_error():
    with pytest.raises(ValueError, match="`backend` must be one of"):
        ops.for_backend("cuda")
    with pytest.raises(ValueError, match="`op` must be one of"):
        ops.kernel("flash", "reference")


def test_direct_kernel_is_the_extension_function_where_the_backend_has_one():
    """A steady run keeps `direct_kernel`'s callable: the native extension's own step (the device rule gives the
    native kernels only layers on the CPU), else the registered kernel (backends without a direct callable)."""
    window = torch.zeros(1, 2, 8, 16)
    assert ops.direct_kernel("append_decode_step", "reference", window) is ops.kernel("append_decode_step", "reference")
    assert ops.direct_kernel("decode_attention", "reference") is ops.kernel("decode_attention", "reference")
    try:
        from kivi_xpu import _cpu
    except ImportError:
        return
    assert ops.direct_kernel("append_decode_step", "native", window) is _cpu.append_decode_step


def test_kind_operands_with_tail_and_with_count_replace_only_their_fields():
    from kivi_xpu.ops.operands import KindOperands

    sinks, codes, scales, zeros, tail, rotation = (torch.zeros(i + 1) for i in range(6))
    operands = KindOperands(sinks, codes, scales, zeros, 64, 32, 2, None)
    stepped = operands.with_count(96, rotation)
    assert type(stepped) is KindOperands
    assert stepped == KindOperands(sinks, codes, scales, zeros, 96, 32, 2, None, rotation)
    assert stepped.with_tail(tail) == KindOperands(sinks, codes, scales, zeros, 96, 32, 2, tail, rotation)
    assert operands.rotation is None and operands.count == 64  # the originals are unchanged
