"""Installing cannot silently lose the fast path: the build backend asks for the target environment's torch, setup.py
refuses to build without the SYCL runtime, and extensions built for another torch are refused with the fix."""

import importlib.metadata
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

from kivi_xpu import runtime

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "_build_backend"))
import kivi_build_backend as backend  # noqa: E402

SITE = [sysconfig.get_paths()["purelib"]]


def test_build_requires_exactly_the_installed_torch(monkeypatch):
    monkeypatch.delenv(backend.TORCH_REQUIREMENT_ENV, raising=False)
    version = importlib.metadata.version("torch")
    assert backend.installed_torch_version(SITE) == version
    assert backend.torch_requirement() == f"torch=={version}"
    expected = [f"torch=={version}", backend.SYCL_RUNTIME]
    assert backend.get_requires_for_build_wheel() == expected
    assert backend.get_requires_for_build_editable() == expected


def test_build_requires_any_torch_without_one_and_the_override(monkeypatch, tmp_path):
    monkeypatch.delenv(backend.TORCH_REQUIREMENT_ENV, raising=False)
    assert backend.installed_torch_version([str(tmp_path)]) is None
    assert backend.torch_requirement([str(tmp_path)]) == backend.DEFAULT_TORCH
    monkeypatch.setenv(backend.TORCH_REQUIREMENT_ENV, "torch==2.13.0+xpu")
    assert backend.torch_requirement() == "torch==2.13.0+xpu"


def test_setup_refuses_to_build_without_the_sycl_runtime(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "KIVI_XPU_SYCL_ROOT": str(tmp_path), "HOME": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "setup.py", "--name"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode != 0
    assert "kivi_xpu._C (the SYCL backend) cannot be built" in done.stderr
    assert 'pip install "intel-sycl-rt>=2025.3"' in done.stderr


def test_build_mismatch_names_both_versions():
    built = {"TORCH_VERSION": "2.12.0+cpu", "CXX11_ABI": True, "SYCL": True}
    assert runtime.build_mismatch(built, "2.12.0+xpu", True) is None  # same release, another build of it
    assert runtime.build_mismatch(built, "2.13.0+cpu", True) == (
        "it was built against torch 2.12.0+cpu, but torch 2.13.0+cpu is installed"
    )
    assert "_GLIBCXX_USE_CXX11_ABI=1" in runtime.build_mismatch(built, "2.12.0", False)
    assert "_build_info.py is missing" in runtime.build_mismatch(None, "2.12.0", True)


def test_extension_built_for_another_torch_is_refused_with_the_fix(monkeypatch):
    if importlib.util.find_spec("kivi_xpu._cpu") is None:
        pytest.skip("kivi_xpu._cpu is not built")
    monkeypatch.setattr(runtime, "build_info", lambda: {"TORCH_VERSION": "1.0.0", "CXX11_ABI": True, "SYCL": True})
    with pytest.raises(RuntimeError) as raised:
        runtime.load_native_extension()
    message = str(raised.value)
    assert f"built against torch 1.0.0, but torch {torch.__version__} is installed" in message
    assert f"Rebuild it with `{runtime.reinstall_command()}`" in message
    assert runtime.reinstall_command().startswith("pip install --no-deps --force-reinstall")


def test_this_build_matches_the_loaded_torch():
    if importlib.util.find_spec("kivi_xpu._cpu") is None:
        pytest.skip("kivi_xpu._cpu is not built")
    assert runtime.build_info() is not None, "setup.py writes kivi_xpu/_build_info.py"
    assert runtime.build_mismatch(runtime.build_info(), torch.__version__, torch._C._GLIBCXX_USE_CXX11_ABI) is None
