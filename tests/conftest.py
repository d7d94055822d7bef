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
