"""The plugin's per-process state: the plan of this process's config (the same in every process: it is computed from
the config that vLLM ships to them), the exact units of this worker, and its model runner."""

from __future__ import annotations

from vllm.config import get_current_vllm_config

from ..paged.budget import PageShape
from .plan import PLANNED, KiviPlan, kivi_options, plan

_plans: dict[int, KiviPlan] = {}
_requests = None
runner = None  # vLLM's model runner in this worker (its `_update_states` hook sets it)


def plan_of(vllm_config) -> KiviPlan:
    """The :class:`~kivi_xpu.vllm.plan.KiviPlan` of ``vllm_config``, one per config object: first from its budget
    and options, then (in the processes vLLM ships the changed config to) from what the start-up hook recorded."""
    cached = _plans.get(id(vllm_config))
    if cached is not None:
        return cached
    options = kivi_options(vllm_config)
    planned = options.pop(PLANNED, None)
    if planned is not None:  # a process after the first: it plans as the first did
        options["max_requests"], kv_budget = planned["max_requests"], planned["kv_budget"]
    else:
        kv_budget = vllm_config.cache_config.kv_cache_memory_bytes
        if kv_budget is None:
            raise ValueError(
                "KIVI pages need an explicit KV budget: pass --kv-cache-memory-bytes (or set VLLM_CPU_KVCACHE_SPACE); "
                "it covers the 2-bit pages and the exact windows alike"
            )
    model, parallel, scheduler = vllm_config.model_config, vllm_config.parallel_config, vllm_config.scheduler_config
    shape = PageShape(model.get_num_kv_heads(parallel), model.get_head_size(), model.get_num_layers(parallel))
    result = plan(options, model.hf_config, shape, model.dtype, kv_budget, scheduler.max_num_seqs,
                  scheduler.max_num_batched_tokens, model.max_model_len)  # fmt: skip
    _plans[id(vllm_config)] = result
    return result


def current_plan() -> KiviPlan:
    """The plan of the config vLLM has set; outside such a context (vLLM asks a backend for its KV spec without
    one), the plan this process made when its layers were built."""
    try:
        return plan_of(get_current_vllm_config())
    except AssertionError:
        if len(_plans) != 1:
            raise RuntimeError(f"KIVI pages: no vLLM config is set and this process has {len(_plans)} plans") from None
        return next(iter(_plans.values()))


def worker_requests(vllm_config):
    """This worker's :class:`~kivi_xpu.vllm.requests.WorkerRequests` (made on first use)."""
    global _requests
    if _requests is None:
        from .requests import WorkerRequests

        _requests = WorkerRequests(plan_of(vllm_config))
    return _requests


def live_requests():
    """This worker's requests' units, or ``None`` before any attention layer was made."""
    return _requests
