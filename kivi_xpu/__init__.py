"""kivi-xpu: a 2-bit KIVI KV cache for HuggingFace transformers, with native CPU and SYCL kernels.

Under a transformers release outside :data:`kivi_xpu.versions.SUPPORTED_TRANSFORMERS` (the vLLM environment, whose
vLLM pins an older one) only the engine-neutral parts load: the ops, the settings and the pages of
:mod:`kivi_xpu.paged` that :mod:`kivi_xpu.vllm` serves; the transformers API then raises, naming the version.
"""

from . import ops  # noqa: F401  (torch.ops.kivi_xpu.* exist as soon as kivi_xpu is imported)
from .algorithm import KiviSettings
from .versions import check_transformers_version, transformers_supported

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

if transformers_supported():
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
else:

    def __getattr__(name: str):
        if name in __all__:
            check_transformers_version()  # raises, naming the installed and the supported versions
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
