"""The environment a result was measured in: library versions, threads and the KIVI kernels' backend."""

from __future__ import annotations

import os
import platform

import torch
import transformers

from .. import __version__
from .options import ToolOptions


def environment(options: ToolOptions) -> dict:
    from ..backend import select

    kivi_backend = None
    if any(name.startswith("kivi") for name in options.caches):
        kivi_backend = select(options.backend, options.device).describe()
    return {
        "kivi_xpu": __version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "kivi_backend": kivi_backend,
    }
