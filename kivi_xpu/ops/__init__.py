"""Quantization ops: the pure-PyTorch reference (:mod:`.reference`), the SYCL kernels' host wrappers
(:mod:`.sycl`), and the choice between them (:func:`select_backend`)."""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch

from . import reference

BACKENDS = ("auto", "sycl", "reference")


@dataclass(frozen=True)
class KernelBackend:
    """Which implementation of the ops a cache uses, and where its packed history lives.

    ``kernels`` is a module exposing ``quantize_keys``, ``quantize_values``, ``dequantize_keys`` and
    ``dequantize_values`` with the signatures of :mod:`kivi_xpu.ops.reference`.
    """

    name: str
    kernels: ModuleType
    sycl_device: str | None = None

    def storage_device(self, model_device: torch.device) -> torch.device:
        """Device of the packed history: the model's device on the reference path."""
        return torch.device(model_device)


def select_backend(backend: str | None = None, device: str | None = None) -> KernelBackend:
    """Resolves the backend for a cache (argument, else ``$KIVI_XPU_BACKEND``, else ``auto``)."""
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"`backend` must be one of {BACKENDS}, got {backend!r}")
    return KernelBackend("reference", reference)
