import os

import pytest
import torch

from kivi_xpu.backend import select


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def require_sycl():
    """Skips a SYCL test when no SYCL backend is available, unless KIVI_XPU_REQUIRE_SYCL=1 (CI), where it fails."""
    try:
        return select("sycl")
    except RuntimeError as err:
        if os.environ.get("KIVI_XPU_REQUIRE_SYCL") == "1":
            pytest.fail(f"KIVI_XPU_REQUIRE_SYCL=1 but the SYCL backend is unavailable: {err}")
        pytest.skip(f"SYCL backend unavailable: {err}")


@pytest.fixture(params=["reference", "sycl"])
def backend_name(request):
    if request.param == "sycl":
        require_sycl()
    return request.param
