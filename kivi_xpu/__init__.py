"""kivi-xpu: a 2-bit KIVI KV cache for HuggingFace transformers, with native CPU and SYCL kernels."""

from . import ops  # noqa: F401  (torch.ops.kivi_xpu.* exist as soon as kivi_xpu is imported)
from .algorithm import KiviSettings
from .attention import register as _register_attention
from .attention import use_fused_attention
from .cache import KiviCache
from .integration import enable as _enable_cache_implementation
from .layer import KiviLayer
from .memory import KiviMemoryReport
from .overrides import load_layer_overrides
from .qat import KiviQAT, kivi_qat

_register_attention()  # attn_implementation="kivi" works as soon as kivi_xpu is imported
_enable_cache_implementation()  # so does generate(cache_implementation="kivi", cache_config={...})

__version__ = "0.1.0"

__all__ = [
    "KiviCache",
    "KiviLayer",
    "KiviMemoryReport",
    "KiviQAT",
    "KiviSettings",
    "kivi_qat",
    "load_layer_overrides",
    "use_fused_attention",
    "__version__",
]
