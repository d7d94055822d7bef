"""kivi-xpu: a 2-bit KIVI KV cache for HuggingFace transformers, with SYCL kernels."""

# `backend` first: it points the SYCL runtime at its OpenCL CPU device and kernel cache before anything loads it.
from . import backend  # noqa: F401, I001
from .algorithm import KiviSettings
from .cache import KiviCache, KiviLayer, KiviMemoryReport

__version__ = "0.1.0"

__all__ = ["KiviCache", "KiviLayer", "KiviMemoryReport", "KiviSettings", "__version__"]
