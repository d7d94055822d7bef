"""The one place kivi-xpu patches transformers: ``generate(cache_implementation="kivi", cache_config={...})`` and
the record of a model's default attention.

transformers 5.x has no registry of cache implementations: ``GenerationConfig.validate`` checks the name against
a fixed tuple and ``GenerationMixin._prepare_cache_for_generation`` builds the cache with an if/elif chain. Nor
does it keep whether a model's attention was chosen by the user: it stores only the resolved name (``None`` becomes
``"sdpa"``). :func:`enable` (called by ``import kivi_xpu``; idempotent) therefore

* adds ``"kivi"`` to the names ``GenerationConfig`` accepts;
* wraps ``_prepare_cache_for_generation`` so that, for ``cache_implementation="kivi"`` only, it builds
  ``KiviCache(config=<the model's decoder config>, **cache_config)``; every other cache implementation goes to
  transformers' own code unchanged;
* wraps ``PreTrainedModel._check_and_adjust_attn_implementation`` so that a model built with no
  ``attn_implementation`` resolves to :data:`kivi_xpu.attention.DEFAULT_SDPA` (``"sdpa"``, as an object of its own),
  and ``set_attn_implementation`` so that any later choice, ``"sdpa"`` included, replaces it: a ``KiviCache`` then
  takes the fused attention exactly when the user chose none (:func:`kivi_xpu.attention.attention_path`).

It refuses to patch a transformers version outside :data:`SUPPORTED_TRANSFORMERS` (the range declared in
``pyproject.toml``), because the patched places are private and may change.
"""

from __future__ import annotations

import copy
import functools
import inspect
import weakref

from transformers.generation import configuration_utils
from transformers.generation.utils import GenerationMixin
from transformers.modeling_utils import PreTrainedModel

from .attention import DEFAULT_SDPA, attention_name
from .cache import KiviCache
from .overrides import meta_dtype_named
from .versions import SUPPORTED_TRANSFORMERS, check_transformers_version

CACHE_IMPLEMENTATION = "kivi"

# `meta_dtype` may be given as a string so that a GenerationConfig holding it stays JSON-serialisable
# (kivi_xpu.overrides.meta_dtype_named).


@functools.cache
def cache_config_keys() -> tuple[str, ...]:
    """The keys ``cache_config`` accepts with ``cache_implementation="kivi"``: KiviCache's keyword arguments."""
    parameters = inspect.signature(KiviCache.__init__).parameters
    return tuple(name for name in parameters if name not in ("self", "config"))


def cache_kwargs(cache_config) -> dict:
    """The ``KiviCache`` keyword arguments of a ``cache_config`` (``None``: none), ``meta_dtype`` names turned into
    dtypes; ``TypeError`` / ``ValueError`` naming the allowed keys for anything else than a dict of them."""
    if cache_config is None:
        return {}
    if not isinstance(cache_config, dict):
        raise TypeError(
            f"`cache_config` for cache_implementation={CACHE_IMPLEMENTATION!r} must be a dict of KiviCache "
            f"options {list(cache_config_keys())}, got {type(cache_config).__name__}"
        )
    unknown = sorted(set(cache_config) - set(cache_config_keys()))
    if unknown:
        hint = " (the model's config is passed for you)" if "config" in unknown else ""
        raise ValueError(
            f"Unknown key(s) {unknown} in `cache_config` for cache_implementation={CACHE_IMPLEMENTATION!r}{hint}; "
            f"allowed keys: {list(cache_config_keys())}"
        )
    kwargs = _with_meta_dtype(dict(cache_config), "cache_config")  # a copy: generate may reuse the config
    overrides = kwargs.get("layer_overrides")
    if isinstance(overrides, (list, tuple)):
        kwargs["layer_overrides"] = [
            _with_meta_dtype(dict(entry), f"cache_config['layer_overrides'][{index}]")
            if isinstance(entry, dict)
            else entry
            for index, entry in enumerate(overrides)
        ]
    return kwargs


def _with_meta_dtype(options: dict, where: str) -> dict:
    return meta_dtype_named(options, f"`{where}['meta_dtype']`")


def build_cache(model, cache_config: dict | None = None) -> KiviCache:
    """The cache ``generate(cache_implementation="kivi", cache_config=cache_config)`` gives ``model``."""
    name = type(model).__name__
    if getattr(model.config, "is_encoder_decoder", False):
        raise ValueError(
            f"cache_implementation={CACHE_IMPLEMENTATION!r} serves decoder-only models; {name} is an encoder-decoder "
            "model (pass cache=EncoderDecoderCache(KiviCache(config=...), DynamicCache()) yourself to try)"
        )
    if not model._supports_default_dynamic_cache():
        raise ValueError(
            f"cache_implementation={CACHE_IMPLEMENTATION!r} cannot serve {name}: it does not keep a standard "
            "key/value cache (transformers builds a model-specific cache or state for it)"
        )
    return KiviCache(config=model.config.get_text_config(decoder=True), **cache_kwargs(cache_config))


# Where generate keeps its cache and the argument that hands a cache to forward: `cache` since transformers 5.24,
# which deprecated `past_key_values` (removed from forward in 5.40).
CACHE_KEY = "cache"


def cache_argument(cache) -> dict:
    """The keyword argument that hands ``cache`` to a model's ``forward``: ``model(ids, **cache_argument(cache))``."""
    return {CACHE_KEY: cache}


# The caches kivi_xpu itself hands to a generate whose config says cache_implementation="kivi"
# (kivi_xpu.conversations): used as given, where any other cache object is refused.
HANDED_OVER: weakref.WeakSet = weakref.WeakSet()


def _prepare_kivi_cache(original):
    @functools.wraps(original)
    def prepare(self, generation_config, model_kwargs, *args, **kwargs):
        if generation_config.cache_implementation != CACHE_IMPLEMENTATION:
            return original(self, generation_config, model_kwargs, *args, **kwargs)
        cache = model_kwargs.get(CACHE_KEY)
        handed_over = cache is not None and cache in HANDED_OVER
        if handed_over or (generation_config.is_assistant and isinstance(cache, KiviCache)):
            # Assisted decoding calls the assistant's generate again with the KiviCache its first call built; a
            # continued conversation (kivi_xpu.conversations) brings the KiviCache of its earlier turns.
            generation_config = copy.copy(generation_config)
            generation_config.cache_implementation = None
            return original(self, generation_config, model_kwargs, *args, **kwargs)
        if cache is not None:
            raise ValueError(
                f"Passing both cache_implementation={CACHE_IMPLEMENTATION!r} and a cache object is unsupported: "
                "use cache_implementation='kivi' with cache_config={...}, or cache=KiviCache(...)"
            )
        if generation_config.use_cache is False:
            return None  # GenerationConfig.validate already warns that cache_implementation is ignored
        cache = build_cache(self, generation_config.cache_config)
        if generation_config.is_assistant:  # an assistant's cache is rolled back after each verification
            cache.activate_past_recording()
        model_kwargs[CACHE_KEY] = cache
        return None

    prepare.__kivi_xpu_original__ = original
    return prepare


def _default_attention_recorded(original):
    @functools.wraps(original)
    def check(self, attn_implementation, *args, **kwargs):
        resolved = original(self, attn_implementation, *args, **kwargs)
        if resolved == "sdpa" and (attn_implementation is None or attn_implementation is DEFAULT_SDPA):
            return DEFAULT_SDPA  # transformers' default, not the user's choice
        return resolved

    check.__kivi_xpu_original__ = original
    return check


def _explicit_attention_recorded(original):
    @functools.wraps(original)
    def set_attn_implementation(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        for config in _configs(self.config):  # (transformers skips the call when the name does not change)
            if attention_name(config) is DEFAULT_SDPA:
                config._attn_implementation_internal = "sdpa"
        return result

    set_attn_implementation.__kivi_xpu_original__ = original
    return set_attn_implementation


def _configs(config):
    """``config`` and its sub-configs, at any depth."""
    yield config
    for key in getattr(config, "sub_configs", {}):
        sub = getattr(config, key, None)
        if sub is not None:
            yield from _configs(sub)


def is_enabled() -> bool:
    return hasattr(GenerationMixin._prepare_cache_for_generation, "__kivi_xpu_original__")


def enable() -> None:
    """Makes ``cache_implementation="kivi"`` work in ``generate``, ``GenerationConfig`` and pipelines.

    Idempotent; leaves every other cache implementation to transformers. Raises ``RuntimeError`` for an
    unsupported transformers version."""
    check_transformers_version()
    if CACHE_IMPLEMENTATION not in configuration_utils.ALL_CACHE_IMPLEMENTATIONS:
        configuration_utils.DYNAMIC_CACHE_IMPLEMENTATIONS += (CACHE_IMPLEMENTATION,)
        configuration_utils.ALL_CACHE_IMPLEMENTATIONS += (CACHE_IMPLEMENTATION,)
    if not is_enabled():
        GenerationMixin._prepare_cache_for_generation = _prepare_kivi_cache(
            GenerationMixin._prepare_cache_for_generation
        )
    if not hasattr(PreTrainedModel.set_attn_implementation, "__kivi_xpu_original__"):
        PreTrainedModel._check_and_adjust_attn_implementation = _default_attention_recorded(
            PreTrainedModel._check_and_adjust_attn_implementation
        )
        PreTrainedModel.set_attn_implementation = _explicit_attention_recorded(PreTrainedModel.set_attn_implementation)


__all__ = [
    "CACHE_IMPLEMENTATION",
    "SUPPORTED_TRANSFORMERS",
    "build_cache",
    "cache_config_keys",
    "cache_kwargs",
    "check_transformers_version",
    "enable",
    "is_enabled",
]
