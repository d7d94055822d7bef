"""Continuous batching with KIVI pages: transformers' manager with :class:`~kivi_xpu.paged.cache.KiviPagedCache`.

transformers builds its ``PagedAttentionCache`` inside ``ContinuousBatchingManager._create_batch_processor`` and
accepts only SDPA, eager and flash attentions; it offers no hook for either. :class:`KiviBatchingManager` is the
narrowest change: the same manager, whose batch processor gets a ``KiviPagedCache`` and whose model runs the
``"kivi_paged"`` attention. Everything else (scheduler, request lifecycle, chunked prefill, streaming, cancellation)
is transformers'. These are private parts of transformers, so the versions they were written against are pinned
(:data:`SUPPORTED_TRANSFORMERS`) and any other is refused with a clear error.
"""

from __future__ import annotations

import functools
import logging
import threading

import torch
import transformers
from transformers import GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig
from transformers.generation.continuous_batching import continuous_api
from transformers.generation.continuous_batching.cache import group_layers_by_attn_type
from transformers.generation.continuous_batching.cache_allocators import FULL_ATTENTION
from transformers.generation.continuous_batching.continuous_api import ContinuousBatchingManager
from transformers.generation.continuous_batching.utils import find_head_dim

from ..backend import select
from ..cache import KiviCache
from .attention import ATTENTION_NAME, register
from .budget import PageBudget
from .cache import DEFAULT_MAX_BATCH_TOKENS, KiviPagedCache, kv_shards, page_shape

# transformers minor versions whose continuous-batching internals this module was written and tested against.
SUPPORTED_TRANSFORMERS = ("5.24",)
_CACHE_CLASS_LOCK = threading.Lock()
logger = logging.getLogger(__name__)


def check_transformers_version(version: str | None = None) -> None:
    """Raises if the installed transformers (or ``version``) is not one :data:`SUPPORTED_TRANSFORMERS` names."""
    version = transformers.__version__ if version is None else version
    if ".".join(version.split(".")[:2]) not in SUPPORTED_TRANSFORMERS:
        raise RuntimeError(
            f"continuous batching with KIVI pages supports transformers {', '.join(SUPPORTED_TRANSFORMERS)}.x, "
            f"found {version}: it replaces private parts of transformers' continuous batching, which change between "
            f"versions. Install transformers=={SUPPORTED_TRANSFORMERS[-1]}.* or use KiviCache with model.generate"
        )


class KiviBatchingManager(ContinuousBatchingManager):
    """transformers' ``ContinuousBatchingManager`` over KIVI pages (see the module docstring). Build it with
    :func:`init_continuous_batching`."""

    def __init__(self, model, generation_config, continuous_batching_config, workload_hints=None, *, cache_options,
                 budget: PageBudget):  # fmt: skip
        self.salts: dict[str, str] = {}  # request id -> tenant salt (read by the cache's prefix matching)
        self._cache_options, self.budget = dict(cache_options, salts=self.salts), budget
        self.max_batch_tokens = continuous_batching_config.max_batch_tokens or DEFAULT_MAX_BATCH_TOKENS
        _exact_scheduling(continuous_batching_config)
        super().__init__(model, generation_config, continuous_batching_config, workload_hints)
        helper = self.distributed_helper
        if helper.tp_size > 1:  # each rank plans the pool of its KV-head shard, with the same options as the others
            config, options = model.config.get_text_config(), self._cache_options
            shards = kv_shards(config, helper)
            _check_same_on_every_rank(helper, {k: v for k, v in options.items() if k != "salts"})
            self.budget = PageBudget.plan(page_shape(config, shards), options["settings"], model.dtype,
                                          options["kv_memory"], options["max_requests"])  # fmt: skip
        logger.info(self.budget.summary(generation_config.max_new_tokens or 0, self.max_batch_tokens))

    def switch_to_cb_friendly_attn(self, model, auto_switch_to_flash: bool = True) -> None:
        """The model runs the ``"kivi_paged"`` attention while the manager runs (restored by ``stop``)."""
        register()
        current = model.config._attn_implementation
        if current != ATTENTION_NAME:
            model.set_attn_implementation(ATTENTION_NAME)
            self._original_attn_impl = current

    def _create_batch_processor(self):
        # transformers constructs `PagedAttentionCache` by its module-global name: substitute ours for this call.
        with _CACHE_CLASS_LOCK:
            original = continuous_api.PagedAttentionCache
            continuous_api.PagedAttentionCache = functools.partial(KiviPagedCache, **self._cache_options)
            try:
                processor = super()._create_batch_processor()
            finally:
                continuous_api.PagedAttentionCache = original
        processor.cache.scheduler = processor.scheduler  # a prefix hit is admitted with the waiting request's state
        return processor

    def add_request(self, input_ids: list[int], request_id: str | None = None, max_new_tokens: int | None = None,
                    *, cache_salt: str | None = None, **kwargs) -> str | None:  # fmt: skip
        """transformers' ``add_request``; a request that the whole budget cannot serve exactly is refused at once
        (:meth:`check_request`) instead of waiting forever. ``cache_salt`` (as vLLM's): requests share cached
        prefixes only with requests of the same salt (``None``: the unsalted tenant)."""
        self.check_request(len(input_ids), max_new_tokens)
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise ValueError(f"`cache_salt` must be a string or None, got {type(cache_salt).__name__}")
        if cache_salt is not None and self.distributed_helper.tp_size > 1:
            raise ValueError("`cache_salt` is not supported under tensor parallelism: the other ranks would not see it")
        if cache_salt is not None and request_id is None:
            raise ValueError("a request with a `cache_salt` needs its `request_id`")
        if cache_salt is not None:
            self.salts[request_id] = cache_salt
        return super().add_request(input_ids, request_id, max_new_tokens, **kwargs)

    def check_request(self, prompt_tokens: int, max_new_tokens: int | None = None) -> None:
        """:class:`~kivi_xpu.paged.budget.RequestTooLong` (a ``ValueError`` naming the longest prompt served) for a
        request of ``prompt_tokens`` + ``max_new_tokens`` (default: the generation config's) that the whole budget
        cannot serve exactly; ``ValueError`` without a ``max_new_tokens``."""
        new = self.generation_config.max_new_tokens if max_new_tokens is None else max_new_tokens
        if new is None:
            raise ValueError("KIVI pages reserve each request's whole length at admission: give `max_new_tokens`")
        self.budget.check_request(prompt_tokens, new, self.max_batch_tokens)

    @property
    def cache(self) -> KiviPagedCache | None:
        """The running cache (``None`` before the first start)."""
        processor = self.batch_processor
        return None if processor is None else processor.cache


def _check_same_on_every_rank(helper, options: dict) -> None:
    """Raises on every rank, before any work, when the ranks of a tensor-parallel group were given different options
    (their pools would differ, and so would their admissions)."""
    every = [None] * helper.tp_size
    torch.distributed.all_gather_object(every, repr(sorted(options.items())), group=helper.cpu_comm_group)
    if len(set(every)) > 1:
        listed = "; ".join(f"rank {rank}: {value}" for rank, value in enumerate(every))
        raise ValueError(f"the ranks of a tensor-parallel group must get the same KIVI pages options: {listed}")


def _exact_scheduling(config: ContinuousBatchingConfig) -> None:
    """Refuses what would make a request's answer differ from its own ``generate`` with ``KiviCache``: CPU
    offloading (a restored request would lose its exact window). Asynchronous batching is refused too (the cache names
    a forward's requests in the order transformers prepared them, which a batch prepared ahead would change). Prefix
    sharing stays as configured: on KIVI pages it reuses exact prompt states (:mod:`.prefixes`). Admission reserves all
    a request holds, so the scheduler's safety margin is not needed either."""
    if config.cpu_offload_space:
        raise ValueError(
            f"`cpu_offload_space` ({config.cpu_offload_space}) must be 0 with KIVI pages: admission reserves all a "
            "request will hold, so no request is ever offloaded or re-prefilled"
        )
    if config.use_async_batching:
        raise ValueError("`use_async_batching` must be off with KIVI pages: each forward names its requests in order")
    config.use_async_batching = False
    if config.safety_margin is None:
        config.safety_margin = 0.0


def paged_layer_settings(model, kivi_settings: dict) -> tuple:
    """The settings of each full-attention layer of ``model``, in order, resolved for its dtype
    (:func:`config_layer_settings` of its config)."""
    return config_layer_settings(model.config, model.dtype, kivi_settings)


def config_layer_settings(config, dtype, kivi_settings: dict) -> tuple:
    """The settings of each full-attention layer of a model of ``config`` in ``dtype``, in order: those the same
    layer of ``KiviCache(config, **kivi_settings)`` has (its ``layer_overrides`` and defaults applied), so that a
    request is stored as its own ``KiviCache`` would store it."""
    cache = KiviCache(config, **kivi_settings)
    text = config.get_text_config()
    layers = group_layers_by_attn_type(text).get(FULL_ATTENTION, [])
    head_dim = find_head_dim(text)
    return tuple(cache.layer_settings(layer, head_dim).for_model_dtype(dtype) for layer in layers)


def _cache_options(model, kv_memory, max_requests, backend, kivi_settings: dict) -> tuple[dict, PageBudget]:
    """The checked keyword arguments of :class:`~kivi_xpu.paged.cache.KiviPagedCache` for ``model``, and the budget
    they plan (planned here, so that a bad budget fails at once rather than in the generation thread)."""
    check_transformers_version()
    if not isinstance(kv_memory, int) or isinstance(kv_memory, bool) or kv_memory <= 0:
        raise ValueError(f"`kv_memory` must be a positive number of bytes, got {kv_memory!r}")
    if max_requests is not None and (not isinstance(max_requests, int) or max_requests < 1):
        raise ValueError(f"`max_requests` must be None or a positive integer, got {max_requests!r}")
    settings = paged_layer_settings(model, kivi_settings)
    budget = PageBudget.plan(page_shape(model.config.get_text_config()), settings, model.dtype, kv_memory, max_requests)
    backend = select(backend, None).for_device(model.device).name  # KiviCache's device rule, for the model's device
    return dict(kv_memory=kv_memory, settings=settings, backend=backend, max_requests=max_requests), budget


def init_continuous_batching(
    model,
    generation_config: GenerationConfig | None = None,
    continuous_batching_config: ContinuousBatchingConfig | None = None,
    *,
    kv_memory: int,
    max_requests: int | None = None,
    backend: str | None = None,
    **kivi_settings,
) -> KiviBatchingManager:
    """A continuous-batching manager for ``model`` whose KV cache is KIVI pages (``model.init_continuous_batching``
    with the cache replaced). Then ``manager.start()``, ``add_request``, ``request_id_iter``, ``cancel_request``,
    ``stop()`` as in transformers.

    Args:
        kv_memory: bytes of KV storage (pages and the requests' exact windows); more requests wait in the queue.
        max_requests: the most requests in flight; default: as many as ``kv_memory`` holds (admission reserves each
            request's pages, window and, while its prompt is split, its exact prompt).
        backend: the kernels (``native``, ``sycl``, ``reference``; default as :class:`~kivi_xpu.KiviCache`: those of
            the model's device, :meth:`kivi_xpu.backend.Selection.for_device`).
        **kivi_settings: :class:`~kivi_xpu.KiviSettings` fields (``bits``, ``group_size``, ``residual_length``,
            ``sink_tokens``, ``rotation``, ``preset``, ...) and ``layer_overrides``, as for
            :class:`~kivi_xpu.KiviCache`: each layer gets the settings that layer of ``KiviCache(model.config,
            **kivi_settings)`` has (its shipped calibration by default; the pages need the same sinks and ``R`` in
            every layer).
    """
    generation_config = model.generation_config if generation_config is None else generation_config
    if generation_config.eos_token_id is None:
        generation_config.eos_token_id = -1
    if getattr(generation_config, "num_return_sequences", None) not in (None, 1):
        raise ValueError("KIVI pages serve one sequence per request: `num_return_sequences` must be 1")
    options, budget = _cache_options(model, kv_memory, max_requests, backend, kivi_settings)
    config = continuous_batching_config or ContinuousBatchingConfig()
    return KiviBatchingManager(model, generation_config, config, cache_options=options, budget=budget)


def install(model, *, kv_memory: int, max_requests: int | None = None, backend: str | None = None,
            prefix_reuse: bool = True, **kivi_settings) -> PageBudget:  # fmt: skip
    """Makes ``model.init_continuous_batching`` (what ``transformers serve --continuous-batching`` and other callers of
    transformers' API use) return a manager on KIVI pages with these options (see :func:`init_continuous_batching`;
    ``prefix_reuse=False`` turns reuse off whatever the caller's ``ContinuousBatchingConfig`` says). The options are
    checked now; returns the budget they plan (:meth:`PageBudget.summary` for the log)."""
    _, budget = _cache_options(model, kv_memory, max_requests, backend, kivi_settings)  # bad options fail here

    def init_on_pages(generation_config=None, continuous_batching_config=None, workload_hints=None):
        config = continuous_batching_config or ContinuousBatchingConfig()
        if not prefix_reuse:
            config.allow_block_sharing = False
        return init_continuous_batching(
            model, generation_config, config, kv_memory=kv_memory, max_requests=max_requests, backend=backend,
            **kivi_settings,
        )  # fmt: skip

    model.init_continuous_batching = init_on_pages
    return budget


def generate_batch(
    model,
    inputs: list[list[int]],
    generation_config: GenerationConfig | None = None,
    continuous_batching_config: ContinuousBatchingConfig | None = None,
    *,
    kv_memory: int,
    max_requests: int | None = None,
    backend: str | None = None,
    progress_bar: bool = False,
    **kwargs,
) -> dict:
    """``model.generate_batch`` (transformers' continuous batching of ``inputs``, lists of token ids) on KIVI pages:
    returns ``{request_id: GenerationOutput}`` in input order, every request answered. ``kwargs``:
    ``max_new_tokens`` and the :class:`~kivi_xpu.KiviSettings` fields; the other arguments as
    :func:`init_continuous_batching`.

    Raises before any work when an input is one the budget cannot serve (:class:`~kivi_xpu.paged.budget.RequestTooLong`
    naming the input and the longest prompt served), and after it when the generation thread failed (the error it
    raised, which transformers only logs) or a request came back failed or missing: never empty answers in silence."""
    max_new_tokens = kwargs.pop("max_new_tokens", None)
    manager = init_continuous_batching(
        model, generation_config, continuous_batching_config, kv_memory=kv_memory, max_requests=max_requests,
        backend=backend, **kwargs,
    )  # fmt: skip
    for index, prompt in enumerate(inputs):
        try:
            manager.check_request(len(prompt), max_new_tokens)
        except ValueError as error:
            raise type(error)(f"inputs[{index}]: {error}") from None
    previous = model.__dict__.get("_cached_continuous_batching_manager")
    model._cached_continuous_batching_manager = manager  # transformers' entry points use a cached manager
    try:
        results = model.generate_batch(
            inputs, generation_config=manager.generation_config, max_new_tokens=max_new_tokens,
            progress_bar=progress_bar, warmup=False,
        )  # fmt: skip
    finally:
        if previous is None:
            model.__dict__.pop("_cached_continuous_batching_manager", None)
        else:
            model._cached_continuous_batching_manager = previous
    _raise_lost_work(manager, results, len(inputs))
    return results


def _raise_lost_work(manager: KiviBatchingManager, results: dict, expected: int) -> None:
    """Raises what transformers' ``generate_batch`` only logs: the generation thread's fatal error, failed requests,
    missing answers."""
    fatal = manager.background_thread_status.fatal_error
    if fatal is not None:
        raise RuntimeError(f"continuous batching on KIVI pages failed in its generation thread: {fatal}") from fatal
    failed = {request_id: result.error for request_id, result in results.items() if result.error is not None}
    if failed:
        raise RuntimeError(f"continuous batching on KIVI pages: requests failed: {failed}")
    if len(results) != expected:
        raise RuntimeError(f"continuous batching on KIVI pages answered {len(results)} of {expected} requests")
