"""kivi-xpu: a 2-bit KIVI KV cache for HuggingFace transformers, with SYCL kernels."""

from .algorithm import KiviSettings
from .cache import KiviCache, KiviLayer, KiviMemoryReport

__version__ = "0.1.0"

__all__ = ["KiviCache", "KiviLayer", "KiviMemoryReport", "KiviSettings", "__version__"]
