"""Continuous batching on 2-bit KIVI pages: one engine-neutral core, one adapter per engine.

The core (imports no engine): :mod:`.pages` (the page and block layouts), :mod:`.budget` (what a pool holds and a
request needs), :mod:`.windows` (exact units: sinks, windows, staged prompts), :mod:`.store` (what a layer's forward
writes), :mod:`.attend` (what its attention reads), :mod:`.prefixes` (prompt reuse by content).

The transformers adapter (inside transformers' own continuous-batching engine; transformers 5.24):

* :func:`generate_batch` — ``model.generate_batch`` with KIVI pages, in one call;
* :func:`init_continuous_batching` — the manager for a server (``start``, ``add_request``, ``request_id_iter``, ...);
* :func:`install` — ``model.init_continuous_batching`` (``transformers serve --continuous-batching``) on KIVI pages;
* :class:`KiviPagedCache` (:mod:`.cache`, :mod:`.allocator`, :mod:`.holdings`) and ``"kivi_paged"``, the attention
  that reads its pages (:mod:`.attention`).

The vLLM adapter is :mod:`kivi_xpu.vllm`. The names above load transformers' engine on first use, so that the core
imports under any transformers (vLLM pins its own).
"""

import importlib

_ADAPTER = {
    "KiviPagedCache": ".cache",
    "SUPPORTED_TRANSFORMERS": ".manager",
    "KiviBatchingManager": ".manager",
    "check_transformers_version": ".manager",
    "generate_batch": ".manager",
    "init_continuous_batching": ".manager",
    "install": ".manager",
}

__all__ = sorted(_ADAPTER)


def __getattr__(name: str):
    if name not in _ADAPTER:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_ADAPTER[name], __name__), name)
