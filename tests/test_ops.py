"""The torch.library registration of the ops, the info command, and CI's backend guarantee."""

import json
import os
import subprocess
import sys

import pytest
import torch

from kivi_xpu.ops import library, reference
from kivi_xpu.ops.library import OPS


def sample_args(op, bits=2, dtype=torch.float32):
    x = torch.randn(2, 3, 64, 64, dtype=dtype)
    if op.startswith("quantize"):
        return (x, 32, bits, torch.float16)
    quantize = reference.quantize_keys if op.endswith("keys") else reference.quantize_values
    codes, scales, zeros = quantize(x, 32, bits, torch.float16)
    return (codes, scales, zeros, 32, 32, bits, torch.bfloat16)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("bits", (2, 8))
def test_opcheck(op, bits):
    torch.library.opcheck(getattr(torch.ops.kivi_xpu, op), sample_args(op, bits))


@pytest.mark.parametrize("op", OPS)
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
    kernels = library._cpu_kernels()
    if os.environ.get("KIVI_XPU_REQUIRE_SYCL") == "1":
        assert kernels is not reference, "CI requires the SYCL kernels behind torch.ops.kivi_xpu on CPU tensors"


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
        [sys.executable, "-m", "kivi_xpu", "info", "--backend", "auto", "--device", "level_zero:gpu:7"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 1 and "matches no SYCL device" in result.stdout
