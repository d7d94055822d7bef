"""The persistent SYCL kernel cache, checked before the SYCL runtime may read it.

The SYCL runtime's persistent cache (``SYCL_CACHE_PERSISTENT`` / ``SYCL_CACHE_DIR``) loads whatever it finds: a few
flipped bytes in a cached binary abort every later process (``LLVM ERROR: Relocation type not implemented yet!``,
SIGABRT, which no Python code can catch), others make the build fail with garbage in its log. So kivi-xpu runs the
runtime on a directory of its own and lets it read only files kivi-xpu has checksummed:

* the directory is ``<cache_root()>/sycl/<key>``, the key a hash of the SYCL and OpenCL runtime versions, so files
  written by another runtime are never read (inside it, the SYCL runtime keys entries by device, kernel source and
  build options);
* ``manifest.json`` holds the sha256 of every file the runtime wrote; :func:`record` adds them after each kernel
  build (kernels compile one variant at a time, when first needed); ``variants.json`` lists the variants built into
  the cache (``"<device filter> <template-id>"``, what ``kivi-xpu info`` reports), forgotten whenever an entry is
  removed;
* :func:`prepare`, before the runtime loads, checks every file against the manifest. An entry (a leaf directory) with
  a changed file is removed and rebuilt, with one warning; an entry the manifest does not list (written by a process
  that stopped before recording) is removed silently; an entry being written (``*.lock``) is left alone, the runtime
  skips it;
* a directory that cannot be created or written, or is owned by another user, is not used: one warning, and the
  kernels compile in every process.

Who sets ``SYCL_CACHE_PERSISTENT`` or ``SYCL_CACHE_DIR`` owns that cache: kivi-xpu then leaves it alone.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.metadata
import json
import os
import shutil
import tempfile
import warnings
from pathlib import Path

from .validation import environment_variable

MANIFEST = "manifest.json"
VARIANTS = "variants.json"
LOCK = ".kivi_xpu.lock"
# Files the runtime rewrites on every cache hit (eviction bookkeeping) or while writing: never executed, not checked.
_UNCHECKED_SUFFIXES = ("_access_time.txt", ".lock")


def cache_root() -> Path:
    """Root of kivi-xpu's caches (kernels, models, texts): ``$KIVI_XPU_CACHE``, else ``$XDG_CACHE_HOME/kivi_xpu``,
    else ``~/.cache/kivi_xpu``. Without a usable home directory (``HOME`` empty or relative, where ``~`` would mean
    ``/.cache`` or the working directory), ``<tempdir>/kivi_xpu-<uid>``. Empty variables count as unset."""
    explicit = environment_variable("KIVI_XPU_CACHE")
    if explicit is not None:
        return Path(explicit)
    xdg = environment_variable("XDG_CACHE_HOME")
    if xdg is not None and os.path.isabs(xdg):  # the XDG spec says to ignore relative paths
        return Path(xdg) / "kivi_xpu"
    home = os.environ.get("HOME")
    if home is None:
        home = os.path.expanduser("~")  # the password database
    if not os.path.isabs(home) or home == "/":
        return Path(tempfile.gettempdir()) / f"kivi_xpu-{os.getuid()}"
    return Path(home) / ".cache" / "kivi_xpu"


def cache_key() -> str:
    """Names the runtime that wrote a cache: the SYCL and OpenCL runtime versions, hashed."""
    versions = []
    for distribution in ("intel-sycl-rt", "intel-opencl-rt"):
        try:
            versions.append(f"{distribution}={importlib.metadata.version(distribution)}")
        except importlib.metadata.PackageNotFoundError:
            versions.append(f"{distribution}=none")
    return hashlib.sha256(";".join(versions).encode()).hexdigest()[:16]


def default_directory() -> Path:
    return cache_root() / "sycl" / cache_key()


def _warn(message: str) -> None:
    warnings.warn(f"kivi_xpu: {message}", RuntimeWarning, stacklevel=4)


def _checked_files(directory: Path) -> dict[str, Path]:
    """Files the runtime may read, by path relative to ``directory`` (the manifest and bookkeeping left out)."""
    files = {}
    for path in directory.rglob("*"):
        if path.is_file() and path.parent != directory and not path.name.endswith(_UNCHECKED_SUFFIXES):
            files[path.relative_to(directory).as_posix()] = path
    return files


def _entry(relative: str) -> str:
    """The cache entry (leaf directory) holding a file."""
    return relative.rpartition("/")[0]


def _being_written(directory: Path, entry: str) -> bool:
    return any((directory / entry).glob("*.lock"))


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _read_manifest(directory: Path) -> dict[str, str] | None:
    """The recorded checksums; ``{}`` without a manifest, None for one that is unreadable (itself corrupted)."""
    path = directory / MANIFEST
    if not path.exists():
        return {}
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    ok = isinstance(manifest, dict) and all(isinstance(v, str) for v in manifest.values())
    return manifest if ok else None


def _write_json(directory: Path, name: str, value) -> None:
    partial = directory / f"{name}.{os.getpid()}.partial"
    partial.write_text(json.dumps(value, indent=0, sort_keys=True))
    partial.replace(directory / name)  # atomic: a reader sees the old file or the new one


def _write_manifest(directory: Path, manifest: dict[str, str]) -> None:
    _write_json(directory, MANIFEST, manifest)


def cached_variants(directory: Path) -> list[str]:
    """The kernel variants recorded as built into ``directory`` (``"<device filter> <template-id>"``), sorted."""
    try:
        names = json.loads((directory / VARIANTS).read_text())
    except (OSError, ValueError):
        return []
    return sorted(n for n in names if isinstance(n, str)) if isinstance(names, list) else []


@contextlib.contextmanager
def _locked(directory: Path):
    """Serialises kivi-xpu processes checking or recording the same directory."""
    with open(directory / LOCK, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _usable(directory: Path) -> str | None:
    """Why ``directory`` cannot hold the cache, or None: it must be creatable, writable and owned by this user
    (kivi-xpu executes what it holds)."""
    try:
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        if directory.stat().st_uid != os.geteuid():
            return "it is owned by another user"
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as error:
        return f"{type(error).__name__}: {error}"
    return None


def verify(directory: Path) -> list[str]:
    """Removes every entry of ``directory`` that kivi-xpu cannot vouch for; returns the files found corrupted
    (changed since recorded, or all of them when the manifest itself is unreadable)."""
    with _locked(directory):
        manifest = _read_manifest(directory)
        corrupted, untrusted = [], set()
        for relative, path in _checked_files(directory).items():
            entry = _entry(relative)
            if entry in untrusted or _being_written(directory, entry):
                continue
            if manifest is None or (relative in manifest and manifest[relative] != _sha256(path)):
                corrupted.append(relative)
                untrusted.add(entry)
            elif relative not in manifest:
                untrusted.add(entry)
        for entry in untrusted:
            shutil.rmtree(directory / entry, ignore_errors=True)
        if untrusted or manifest is None:
            kept = {} if manifest is None else manifest
            _write_manifest(directory, {k: v for k, v in kept.items() if _entry(k) not in untrusted})
            _write_json(directory, VARIANTS, [])  # which variant an entry held is not known: list them again
    return corrupted


def record(directory: Path, variants: list[str] = ()) -> None:
    """Adds the files the runtime wrote since :func:`verify` to the manifest (entries still being written are left
    for a later process) and drops the ones the runtime removed; adds ``variants`` (just built) to ``variants.json``."""
    with _locked(directory):
        listed = cached_variants(directory)
        if set(variants) - set(listed):
            _write_json(directory, VARIANTS, sorted(set(listed) | set(variants)))
        manifest = _read_manifest(directory) or {}
        present = _checked_files(directory)
        updated = {k: v for k, v in manifest.items() if k in present}
        for relative, path in present.items():
            if relative not in updated and not _being_written(directory, _entry(relative)):
                updated[relative] = _sha256(path)
        if updated != manifest:
            _write_manifest(directory, updated)


def prepare(environ=os.environ) -> Path | None:
    """Points the SYCL runtime at kivi-xpu's verified cache (sets ``SYCL_CACHE_PERSISTENT`` and ``SYCL_CACHE_DIR``)
    unless the user set either; returns the directory to :func:`record` into, or None when kivi-xpu does not manage
    the cache. Warns once when a corrupted entry was removed or the directory is unusable."""
    if "SYCL_CACHE_PERSISTENT" in environ or "SYCL_CACHE_DIR" in environ:
        return None
    directory = default_directory()
    problem = _usable(directory)
    if problem is None:
        try:
            corrupted = verify(directory)
        except OSError as error:
            problem = f"checking it failed ({type(error).__name__}: {error})"
    if problem is not None:
        _warn(
            f"the SYCL kernel cache {directory} cannot be used ({problem}): the kernels compile in every process "
            "(seconds each); set KIVI_XPU_CACHE to a writable directory of yours"
        )
        return None
    if corrupted:
        _warn(
            f"the SYCL kernel cache {directory} held {len(corrupted)} corrupted file(s) (e.g. {corrupted[0]}), which "
            "kivi-xpu removed instead of executing them: the kernels compile again"
        )
    environ["SYCL_CACHE_PERSISTENT"] = "1"
    environ["SYCL_CACHE_DIR"] = str(directory)
    return directory
