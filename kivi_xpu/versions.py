"""The transformers releases whose generation internals kivi-xpu patches (:mod:`kivi_xpu.integration`), checked
without importing those internals: ``import kivi_xpu`` under another transformers (vLLM pins its own) loads only the
engine-neutral parts, and the transformers API names the version when first used."""

from __future__ import annotations

import transformers
from packaging.version import InvalidVersion, Version

# Keep in sync with the `transformers` requirement in pyproject.toml.
SUPPORTED_TRANSFORMERS = ("5.24", "6")  # [minimum, maximum)


def check_transformers_version(version: str | None = None) -> None:
    """Raises ``RuntimeError`` when ``version`` (default: the installed transformers) is outside the range whose
    generation internals :func:`kivi_xpu.integration.enable` knows, or is not a PEP 440 version.

    Release numbers are compared, so the pre-releases and dev builds of the next major (``6.0.0.dev0``, ``6.0.0rc1``:
    transformers from git main, whose internals may already have changed) are refused although PEP 440 orders them
    below ``6``; those of a supported release (``5.24.0rc1``) are accepted."""
    version = transformers.__version__ if version is None else version
    low, high = SUPPORTED_TRANSFORMERS
    supported = f"transformers >={low},<{high}"
    try:
        release = Version(version).release
    except (InvalidVersion, TypeError):
        raise RuntimeError(
            f"kivi-xpu supports {supported}; the installed transformers reports the version {version!r}, which is "
            "not a PEP 440 version, so kivi-xpu cannot tell whether it is supported. Install a released version "
            f'(pip install "transformers>={low},<{high}").'
        ) from None
    if not Version(low).release <= release < Version(high).release:
        raise RuntimeError(
            f"kivi-xpu supports {supported} (release numbers; pre-releases of {high} are outside); transformers "
            f'{version} is installed. Install a supported version (pip install "transformers>={low},<{high}") or a '
            "kivi-xpu release made for your transformers."
        )


def transformers_supported() -> bool:
    """Whether the installed transformers is one :func:`check_transformers_version` accepts."""
    try:
        check_transformers_version()
    except RuntimeError:
        return False
    return True
