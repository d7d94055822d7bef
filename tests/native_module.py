"""``kivi_xpu._cpu`` for the native kernel tests: ``from native_module import native`` imports it or skips the
importing test module (a missing build fails instead when KIVI_XPU_REQUIRE_NATIVE=1)."""

import os

import pytest

try:
    from kivi_xpu import _cpu as native  # noqa: F401  (what the test modules import from here)
except ImportError as err:
    if os.environ.get("KIVI_XPU_REQUIRE_NATIVE") == "1":
        raise
    pytest.skip(f"kivi_xpu._cpu is not built: {err}", allow_module_level=True)
