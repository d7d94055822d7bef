"""The ``vllm.general_plugins`` entry point: hooks into vLLM's CPU engine, each active only when the config has
``"kivi"`` in ``--additional-config`` (vLLM loads general plugins in every process, before any config exists).

In the process that reads the arguments:

* ``CpuPlatform.check_and_update_config``: after vLLM's own, checks the version, the model and the settings, plans
  the budget (:func:`configure`) and changes the config accordingly (block size, requests in flight);

in the scheduler's (the engine core), the :class:`~kivi_xpu.vllm.ledger.UnitLedger` of the exact units:

* ``Scheduler.__init__`` makes it; ``Scheduler.schedule`` lends the step's units and sends them with its output;
  ``Scheduler._free_request_blocks`` gives a request's units back as vLLM frees its blocks;
* ``KVCacheManager.allocate_slots`` takes a request's exact units (window, staging) from vLLM's free blocks before
  vLLM checks them for its pages;
* ``KVCacheManager.get_computed_blocks`` cuts vLLM's prefix-cache hit to what the ledger can back;
  ``BlockPool._maybe_evict_cached_block`` tells it which free blocks vLLM lends anew, ``reset_prefix_cache`` that
  nothing kept may serve again;

in each worker:

* ``CpuPlatform.get_attn_backend_cls``: :class:`~kivi_xpu.vllm.backend.KiviAttentionBackend`;
* ``CPUModelRunner._update_states``: hands the step's units to this worker's exact units before each forward.
"""

from __future__ import annotations

import functools
import logging

from .plan import KiviPlan, check_vllm_version, kivi_options

logger = logging.getLogger("vllm.kivi_xpu")  # under vLLM's logger, which has the handlers
BACKEND_PATH = "kivi_xpu.vllm.backend.KiviAttentionBackend"
STEP_UNITS = "kivi_units"  # the SchedulerOutput attribute that carries the ledger's StepUnits to the workers
_registered = False


def register() -> None:
    """Installs the hooks (idempotent: vLLM may load plugins more than once per process)."""
    global _registered
    if _registered:
        return
    _registered = True
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    check_config = CpuPlatform.check_and_update_config.__func__
    backend_cls = CpuPlatform.get_attn_backend_cls.__func__
    update_states = CPUModelRunner._update_states
    _hook_scheduler()

    @functools.wraps(check_config)
    def check_and_update_config(cls, vllm_config) -> None:
        check_config(cls, vllm_config)
        if kivi_options(vllm_config) is not None:
            configure(vllm_config)

    @functools.wraps(backend_cls)
    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None) -> str:
        from vllm.config import get_current_vllm_config

        if kivi_options(get_current_vllm_config()) is None:
            return backend_cls(cls, selected_backend, attn_selector_config, num_heads)
        return BACKEND_PATH

    @functools.wraps(update_states)
    def _update_states(self, scheduler_output):
        from . import state

        state.runner = self
        requests = state.live_requests()
        if requests is not None:
            requests.runner = self
            requests.begin_step(getattr(scheduler_output, STEP_UNITS, None))
        return update_states(self, scheduler_output)

    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)
    CpuPlatform.get_attn_backend_cls = classmethod(get_attn_backend_cls)
    CPUModelRunner._update_states = _update_states


def _hook_scheduler() -> None:
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.scheduler import Scheduler

    from .ledger import UnitLedger
    from .units import BlockUnits

    init, schedule, free_blocks = Scheduler.__init__, Scheduler.schedule, Scheduler._free_request_blocks
    computed_blocks, evict = KVCacheManager.get_computed_blocks, BlockPool._maybe_evict_cached_block
    allocate = KVCacheManager.allocate_slots
    reset = BlockPool.reset_prefix_cache

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if kivi_options(self.vllm_config) is not None:
            from . import state

            plan, pool = state.plan_of(self.vllm_config), self.kv_cache_manager.block_pool
            ledger = UnitLedger(plan, self.cache_config.enable_prefix_caching, BlockUnits(pool, plan.unit_blocks))
            self.kivi_ledger = self.kv_cache_manager.kivi_ledger = self.kv_cache_manager.block_pool.kivi_ledger = ledger

    @functools.wraps(schedule)
    def schedule_step(self, *args, **kwargs):
        output = schedule(self, *args, **kwargs)
        ledger = getattr(self, "kivi_ledger", None)
        if ledger is not None:
            ledger.release(output.finished_req_ids)  # (freed already, save those aborted before they ran)
            scheduled = [(rid, self.requests[rid], count) for rid, count in output.num_scheduled_tokens.items()]
            step = ledger.schedule(scheduled, lambda rid: self.kv_cache_manager.get_block_ids(rid)[0])
            setattr(output, STEP_UNITS, step)
        return output

    @functools.wraps(free_blocks)
    def _free_request_blocks(self, request):
        ledger = getattr(self, "kivi_ledger", None)
        if ledger is not None:  # before vLLM may lend the blocks again: the request's pages are completed first
            ledger.release([request.request_id])
        return free_blocks(self, request)

    @functools.wraps(allocate)
    def allocate_slots(self, request, num_new_tokens, num_new_computed_tokens=0, new_computed_blocks=None, *args,
                       **kwargs):  # fmt: skip
        ledger = getattr(self, "kivi_ledger", None)
        computed = (num_new_computed_tokens, new_computed_blocks)
        if ledger is None:
            return allocate(self, request, num_new_tokens, *computed, *args, **kwargs)
        end = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        hit = new_computed_blocks.get_block_ids()[0] if new_computed_blocks is not None else ()
        if not ledger.reserve(request, end, hit):  # (its hit's free blocks are not carved into units)
            return None
        blocks = allocate(self, request, num_new_tokens, *computed, *args, **kwargs)
        if blocks is None:
            ledger.unreserve(request.request_id)
        return blocks

    @functools.wraps(computed_blocks)
    def get_computed_blocks(self, request):
        blocks, hit, *rest = computed_blocks(self, request)
        ledger = getattr(self, "kivi_ledger", None)
        if ledger is None or not hit:
            return (blocks, hit, *rest)
        usable = ledger.cap_hit(request, blocks.get_block_ids()[0], hit)
        if usable != hit:
            blocks = self.truncate_computed_blocks(blocks, usable) if usable else self.empty_kv_cache_blocks
        return (blocks, usable, *rest)

    @functools.wraps(evict)
    def _maybe_evict_cached_block(self, block):
        ledger = getattr(self, "kivi_ledger", None)
        if ledger is not None:
            ledger.forget_block(block.block_id)
        return evict(self, block)

    @functools.wraps(reset)
    def reset_prefix_cache(self, *args, **kwargs):
        ledger = getattr(self, "kivi_ledger", None)
        if ledger is not None:
            ledger.drop_pins()
        done = reset(self, *args, **kwargs)
        if done and ledger is not None:
            ledger.forget()
        return done

    Scheduler.__init__, Scheduler.schedule = __init__, schedule_step
    Scheduler._free_request_blocks = _free_request_blocks
    KVCacheManager.get_computed_blocks, KVCacheManager.allocate_slots = get_computed_blocks, allocate_slots
    BlockPool._maybe_evict_cached_block, BlockPool.reset_prefix_cache = _maybe_evict_cached_block, reset_prefix_cache


def _refuse_model(vllm_config) -> None:
    model = vllm_config.model_config
    text = model.hf_text_config
    problems = []
    if model.use_mla:
        problems.append("multi-head latent attention (MLA)")
    if getattr(text, "sliding_window", None) is not None or model.get_sliding_window() is not None:
        problems.append("sliding-window layers")
    layer_types = getattr(text, "layer_types", None)
    if layer_types is not None and set(layer_types) - {"full_attention"}:
        problems.append(f"layer types {sorted(set(layer_types) - {'full_attention'})}")
    if model.is_hybrid:
        problems.append("hybrid (mamba / linear-attention) layers")
    if vllm_config.parallel_config.pipeline_parallel_size > 1:
        problems.append("pipeline parallelism")
    if vllm_config.speculative_config is not None:
        problems.append("speculative decoding")
    if vllm_config.cache_config.cache_dtype != "auto":
        problems.append(f"--kv-cache-dtype {vllm_config.cache_config.cache_dtype} (KIVI pages are the KV format)")
    if problems:
        raise ValueError(
            f"KIVI pages in vLLM serve decoder models whose every layer is full attention; {model.model} has "
            f"{', '.join(problems)}: serve it without --additional-config kivi"
        )


def configure(vllm_config) -> KiviPlan:
    """Checks and plans the ``"kivi"`` options of ``vllm_config`` and changes the config to match (idempotent:
    every process that checks the config plans the same)."""
    import vllm

    from . import state

    check_vllm_version(vllm.__version__)
    _refuse_model(vllm_config)
    cache, scheduler = vllm_config.cache_config, vllm_config.scheduler_config
    result = state.plan_of(vllm_config)
    vllm_config.additional_config["kivi"].setdefault(
        state.PLANNED, {"kv_budget": result.kv_budget, "max_requests": result.max_requests}
    )
    cache.block_size = result.block_tokens
    scheduler.max_num_seqs = result.max_requests
    logger.info(result.summary(vllm_config.model_config.max_model_len))
    return result
