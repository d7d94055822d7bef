import os

import pytest
import torch

from kivi_xpu.backend import select


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def require_backend(name: str):
    """Skips a test of backend ``name`` ("sycl" or "native") when it is unavailable, unless
    KIVI_XPU_REQUIRE_SYCL=1 / KIVI_XPU_REQUIRE_NATIVE=1 (CI), where it fails."""
    try:
        return select(name)
    except RuntimeError as err:
        variable = f"KIVI_XPU_REQUIRE_{name.upper()}"
        if os.environ.get(variable) == "1":
            pytest.fail(f"{variable}=1 but the {name} backend is unavailable: {err}")
        pytest.skip(f"{name} backend unavailable: {err}")


def require_sycl():
    return require_backend("sycl")


@pytest.fixture(params=["reference", "sycl", "native"])
def backend_name(request):
    if request.param != "reference":
        require_backend(request.param)
    return request.param


def _native_isas() -> list[str]:
    try:
        from kivi_xpu import _cpu
    except ImportError:
        return []  # the native tests skip (or fail under KIVI_XPU_REQUIRE_NATIVE=1) through tests/native_module.py
    return _cpu.available_isas()


@pytest.fixture(params=_native_isas())
def isa(request):
    """Runs a native-kernel test on one ISA of this CPU, restoring the process's default afterwards."""
    from kivi_xpu import _cpu as native

    previous = native.isa()
    native.set_isa(request.param)
    yield request.param
    native.set_isa(previous)


@pytest.fixture
def exact_arithmetic():
    """The native decode attention on fp32 arithmetic for the test's duration (``KIVI_XPU_CPU_DOT=fp32``): for tests
    that compare the fused path with dense attention over the dequantized history to fp32 rounding. The default int8
    arithmetic rounds the query and the probabilities to 8 bits; tests/test_native_attention.py compares it with its
    own twin (kivi_xpu/ops/integer_twin.py)."""
    try:
        from kivi_xpu import _cpu as native
    except ImportError:
        yield
        return
    previous = native.dot()
    native.set_dot("fp32")
    yield
    native.set_dot(previous)
