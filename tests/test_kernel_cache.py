"""The persistent SYCL kernel cache (kivi_xpu.kernel_cache): a corrupted or unknown entry is removed before the SYCL
runtime could execute it, an unusable directory is one warning, and the cache root never lands in ``/.cache``.

The end-to-end tests run fresh processes, because the SYCL runtime reads its cache settings once per process."""

import json
import os
import struct
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import pytest
from conftest import require_backend, require_sycl

from kivi_xpu import kernel_cache

# Quantizes with the SYCL kernels and compares with the reference: the process must survive and be right.
SCRIPT = """
import warnings
warnings.simplefilter("always")
import torch
from kivi_xpu.ops import for_backend, reference
x = torch.randn(2, 3, 64, 64)
codes, scales, zeros = for_backend("sycl").quantize_keys(x, 32, 2, torch.float16)
expected = reference.quantize_keys(x, 32, 2, torch.float16)
assert all(torch.equal(a, b) for a, b in zip((codes, scales, zeros), expected))
print("results: correct")
"""


def child_environment(**variables) -> dict:
    """This environment without the cache settings a test must control, plus ``variables``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SYCL_CACHE") and k != "KIVI_XPU_CACHE"}
    return env | variables


def run(code: str, env: dict) -> subprocess.CompletedProcess:
    cwd = Path(__file__).parent.parent
    env = env | {"PYTHONPATH": os.pathsep.join([str(cwd), env.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600, cwd=cwd)


def corrupt_relocations(path: Path) -> bool:
    """Breaks a cached device binary the way that aborted every later process (SIGABRT, ``LLVM ERROR: Relocation type
    not implemented yet!``): the relocation types of the object inside it. False if it holds no such object."""
    data = bytearray(path.read_bytes())
    inner = data.find(b"\x7fELF", 16 + 64)  # the device object inside the runtime's container
    if inner < 0:
        return False
    header = struct.unpack_from("<Q", data, inner + 0x28)[0]
    size, count = struct.unpack_from("<HH", data, inner + 0x3A)
    found = False
    for index in range(count):
        section = inner + header + index * size
        if struct.unpack_from("<I", data, section + 4)[0] == 4:  # SHT_RELA
            offset = inner + struct.unpack_from("<Q", data, section + 0x18)[0]
            for entry in range(4):
                data[offset + 24 * entry + 8] = 0xEE  # r_info's type byte
            found = True
    path.write_bytes(bytes(data))
    return found


def flip_bytes(path: Path) -> None:
    data = bytearray(path.read_bytes())
    for position in range(len(data) // 2, min(len(data), len(data) // 2 + 64)):
        data[position] ^= 0x5A
    path.write_bytes(bytes(data))


def test_a_corrupted_cache_entry_is_rebuilt_not_executed(tmp_path):
    require_sycl()
    env = child_environment(XDG_CACHE_HOME=str(tmp_path))
    # Two runs: the first compiles from source, the second from the cached IR, which gives the device binaries every
    # later process reads.
    for _ in range(2):
        fill = run(SCRIPT, env)
        assert fill.returncode == 0 and "results: correct" in fill.stdout, fill.stderr
    binaries = list(tmp_path.rglob("*.bin"))
    assert binaries, "the SYCL runtime cached nothing"
    if not [path for path in binaries if corrupt_relocations(path)]:
        for path in binaries:  # another runtime's layout: flipped bytes
            flip_bytes(path)

    after = run(SCRIPT, env)
    assert after.returncode == 0, f"exit {after.returncode}: {after.stderr[-2000:]}"
    assert "results: correct" in after.stdout
    assert after.stderr.count("corrupted file(s)") == 1, after.stderr
    # The rebuilt entries are trusted again: no warning, and the runtime reads them.
    again = run(SCRIPT, env)
    assert again.returncode == 0 and "results: correct" in again.stdout and "kivi_xpu:" not in again.stderr


WARNING_SCRIPT = """
import os, warnings
warnings.simplefilter("always")
from kivi_xpu import runtime
runtime.prepare_environment()
runtime.sycl_devices()
print("persistent:", os.environ.get("SYCL_CACHE_PERSISTENT"), "dir:", os.environ.get("SYCL_CACHE_DIR"))
"""


def unusable_directories(tmp_path: Path) -> list[Path]:
    """Directories that cannot hold the cache: under a regular file (always), read-only (not for root)."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    found = [blocker / "cache"]
    if os.geteuid() != 0:
        read_only = tmp_path / "read-only"
        read_only.mkdir(mode=0o500)
        found.append(read_only)
    return found


def test_an_unusable_cache_directory_warns_once_and_persists_nothing(tmp_path):
    for directory in unusable_directories(tmp_path):
        result = run(WARNING_SCRIPT, child_environment(XDG_CACHE_HOME=str(directory)))
        assert result.returncode == 0, result.stderr
        assert result.stderr.count("cannot be used") == 1, result.stderr
        assert "KIVI_XPU_CACHE" in result.stderr and str(directory) in result.stderr
        assert "persistent: None dir: None" in result.stdout


def test_an_empty_home_puts_the_cache_in_the_temporary_directory_not_in_the_root(tmp_path):
    env = child_environment(HOME="", TMPDIR=str(tmp_path))
    env.pop("XDG_CACHE_HOME", None)
    result = run(WARNING_SCRIPT, env)
    assert result.returncode == 0, result.stderr
    assert "/.cache" not in result.stdout
    assert f"dir: {tmp_path}/kivi_xpu-{os.getuid()}/sycl/" in result.stdout, result.stdout


@pytest.mark.parametrize(
    "variables, expected",
    [
        ({"KIVI_XPU_CACHE": "/x/k", "XDG_CACHE_HOME": "/x/xdg", "HOME": "/x/home"}, "/x/k"),
        ({"KIVI_XPU_CACHE": "", "XDG_CACHE_HOME": "/x/xdg", "HOME": "/x/home"}, "/x/xdg/kivi_xpu"),
        ({"XDG_CACHE_HOME": "", "HOME": "/x/home"}, "/x/home/.cache/kivi_xpu"),
        ({"XDG_CACHE_HOME": "relative", "HOME": "/x/home"}, "/x/home/.cache/kivi_xpu"),  # the XDG spec
        ({"HOME": ""}, f"{tempfile.gettempdir()}/kivi_xpu-{os.getuid()}"),
        ({"HOME": "/"}, f"{tempfile.gettempdir()}/kivi_xpu-{os.getuid()}"),
        ({"HOME": "relative"}, f"{tempfile.gettempdir()}/kivi_xpu-{os.getuid()}"),
    ],
)
def test_cache_root(monkeypatch, variables, expected):
    for name in ("KIVI_XPU_CACHE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    assert str(kernel_cache.cache_root()) == expected


# --- the manifest, on a directory laid out like the runtime's (no SYCL needed) ----------------------------------


def write_entry(directory: Path, entry: str, content: bytes = b"binary") -> Path:
    (directory / entry).mkdir(parents=True, exist_ok=True)
    (directory / entry / "0.bin").write_bytes(content)
    (directory / entry / "0.src").write_bytes(b"source")
    (directory / entry / "0_access_time.txt").write_text("123")
    return directory / entry / "0.bin"


def test_recorded_entries_are_kept_and_changed_or_unknown_ones_removed(tmp_path):
    kept, changed = write_entry(tmp_path, "dev/a/s/o"), write_entry(tmp_path, "dev/b/s/o")
    kernel_cache.record(tmp_path)
    assert kernel_cache.verify(tmp_path) == []
    (kept.parent / "0_access_time.txt").write_text("456")  # the runtime's bookkeeping may change
    changed.write_bytes(b"binarY")
    unknown = write_entry(tmp_path, "dev/c/s/o")  # e.g. written by a process that stopped before recording
    writing = write_entry(tmp_path, "dev/d/s/o")
    (writing.parent / "0.lock").write_text("")  # being written by the runtime right now
    assert kernel_cache.verify(tmp_path) == ["dev/b/s/o/0.bin"]
    assert kept.exists() and writing.exists()
    assert not changed.parent.exists() and not unknown.parent.exists()
    assert set(json.loads((tmp_path / kernel_cache.MANIFEST).read_text())) == {"dev/a/s/o/0.bin", "dev/a/s/o/0.src"}
    (writing.parent / "0.lock").unlink()
    kernel_cache.record(tmp_path)
    assert "dev/d/s/o/0.bin" in json.loads((tmp_path / kernel_cache.MANIFEST).read_text())


def test_an_unreadable_manifest_distrusts_every_entry(tmp_path):
    entry = write_entry(tmp_path, "dev/a/s/o")
    kernel_cache.record(tmp_path)
    (tmp_path / kernel_cache.MANIFEST).write_bytes(b'{"dev/a/s/o/0.bin": \xff')
    assert kernel_cache.verify(tmp_path)[0].startswith("dev/a/s/o/")
    assert not entry.exists() and json.loads((tmp_path / kernel_cache.MANIFEST).read_text()) == {}


def test_a_cache_chosen_by_the_user_is_left_alone(tmp_path, monkeypatch):
    monkeypatch.setenv("KIVI_XPU_CACHE", str(tmp_path))
    environ = {"SYCL_CACHE_DIR": "/somewhere"}
    assert kernel_cache.prepare(environ) is None and environ == {"SYCL_CACHE_DIR": "/somewhere"}
    environ = {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        directory = kernel_cache.prepare(environ)
    assert directory.parent == tmp_path / "sycl"
    assert environ == {"SYCL_CACHE_PERSISTENT": "1", "SYCL_CACHE_DIR": str(directory)}


def test_cached_variants_are_listed_and_forgotten_when_an_entry_goes(tmp_path):
    changed = write_entry(tmp_path, "dev/a/s/o")
    kernel_cache.record(tmp_path, ["opencl:cpu:0 kivi_quantize_keys<F32, F16>"])
    kernel_cache.record(tmp_path, ["opencl:cpu:0 kivi_dequantize_keys<F16, F32>"])
    assert kernel_cache.cached_variants(tmp_path) == [
        "opencl:cpu:0 kivi_dequantize_keys<F16, F32>",
        "opencl:cpu:0 kivi_quantize_keys<F32, F16>",
    ]
    changed.write_bytes(b"binarY")
    assert kernel_cache.verify(tmp_path) == ["dev/a/s/o/0.bin"]
    assert kernel_cache.cached_variants(tmp_path) == []


# A tiny fused generate on the process's backend; prints whether the SYCL runtime was loaded.
GENERATE_SCRIPT = """
import sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
import kivi_xpu
torch.manual_seed(0)
config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=1)
model = LlamaForCausalLM(config).eval()
kivi_xpu.use_fused_attention(model)
cache = kivi_xpu.KiviCache(config=config, residual_length=32)
model.generate(torch.randint(0, 256, (1, 40)), cache=cache, max_new_tokens=30, min_new_tokens=30)
print("backend", cache.backend.name, "sycl loaded:", "kivi_xpu._C" in sys.modules or "dpctl" in sys.modules)
"""


def test_kernels_compile_when_first_needed_once_per_machine(tmp_path):
    require_sycl()
    env = child_environment(KIVI_XPU_CACHE=str(tmp_path), KIVI_XPU_BACKEND="sycl")
    device = "runtime.host_sycl_runtime().device"
    code = SCRIPT + f"from kivi_xpu import runtime\nprint(sorted(runtime.compiled_kernels({device})))"
    first = run(code, env)
    assert first.returncode == 0 and "results: correct" in first.stdout, first.stderr
    # Only the group of the variant launched, one progress line for its build.
    assert "['kivi_quantize_keys<F32, F16>', 'kivi_quantize_values<F32, F16>']" in first.stdout
    assert first.stderr.count("kivi_xpu: compiling SYCL kernel") == 1, first.stderr
    assert "kivi_quantize_keys<F32, F16> (+1) for " in first.stderr
    directory = next((tmp_path / "sycl").iterdir())
    assert [name.split(" ", 1)[1] for name in kernel_cache.cached_variants(directory)] == [
        "kivi_quantize_keys<F32, F16>",
        "kivi_quantize_values<F32, F16>",
    ]
    manifest = (directory / kernel_cache.MANIFEST).read_text()
    second = run(code, env)
    assert second.returncode == 0 and "results: correct" in second.stdout, second.stderr
    assert (directory / kernel_cache.MANIFEST).read_text() == manifest, "a later process must only read the cache"


def test_the_native_backend_never_loads_the_sycl_runtime(tmp_path):
    require_backend("native")
    env = child_environment(KIVI_XPU_CACHE=str(tmp_path), KIVI_XPU_BACKEND="native")
    done = run(GENERATE_SCRIPT, env)
    assert done.returncode == 0, done.stderr
    assert "backend native sycl loaded: False" in done.stdout
    assert not (tmp_path / "sycl").exists()
