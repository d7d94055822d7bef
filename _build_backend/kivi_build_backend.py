"""PEP 517 build backend of kivi-xpu: setuptools, plus the one build requirement it cannot state statically.

The extensions (kivi_xpu._C, kivi_xpu._cpu) link against torch's C++ API, which is only compatible with the torch
release they were compiled against. With build isolation (pip's default) the build environment gets its own torch,
so this backend asks for exactly the torch that is installed where the package is being installed
(``torch==<that version>``, found in the installing interpreter's site-packages without importing it), and for the
SYCL runtime headers (``intel-sycl-rt``). Without torch there, ``torch>=2.5``: the wheel then pins the torch it was
built against (setup.py), so pip installs that same torch next to it. ``$KIVI_XPU_TORCH_REQUIREMENT`` overrides the
requirement (e.g. ``torch==2.13.0+xpu`` for a wheel built for another environment).
"""

from __future__ import annotations

import importlib.metadata
import os
import sysconfig

from setuptools.build_meta import *  # noqa: F403  (every hook setuptools defines; two are replaced below)

TORCH_REQUIREMENT_ENV = "KIVI_XPU_TORCH_REQUIREMENT"
DEFAULT_TORCH = "torch>=2.5"
SYCL_RUNTIME = "intel-sycl-rt>=2025.3"


def installed_torch_version(paths: list[str] | None = None) -> str | None:
    """Version of the torch distribution in ``paths`` (default: the installing interpreter's site-packages, which
    pip's isolated build hides from ``sys.path`` but not from ``sysconfig``), or None."""
    if paths is None:
        paths = list(dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]))
    for distribution in importlib.metadata.distributions(path=paths):
        if (distribution.metadata["Name"] or "").lower() == "torch":
            return distribution.version
    return None


def torch_requirement(paths: list[str] | None = None) -> str:
    """The torch the extensions must be built against (see the module doc)."""
    explicit = os.environ.get(TORCH_REQUIREMENT_ENV, "").strip()
    if explicit:
        return explicit
    version = installed_torch_version(paths)
    return DEFAULT_TORCH if version is None else f"torch=={version}"


def _extra_requirements() -> list[str]:
    return [torch_requirement(), SYCL_RUNTIME]


# setuptools' own hooks run setup.py to find setup_requires (there are none), and setup.py needs torch, which this
# very answer brings: so the hooks answer without running it (pyproject's `requires` already holds setuptools/wheel).
def get_requires_for_build_wheel(config_settings=None):
    return _extra_requirements()


def get_requires_for_build_editable(config_settings=None):
    return _extra_requirements()
