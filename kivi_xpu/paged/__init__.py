"""Continuous batching on 2-bit KIVI pages, inside transformers' own continuous-batching engine.

* :func:`generate_batch` — ``model.generate_batch`` with KIVI pages, in one call;
* :func:`init_continuous_batching` — the manager for a server (``start``, ``add_request``, ``request_id_iter``, ...);
* :func:`install` — ``model.init_continuous_batching`` (``transformers serve --continuous-batching``) on KIVI pages;
* :class:`KiviPagedCache` — the cache (:mod:`.cache`): one pool (:mod:`.budget`) of 2-bit pages (:mod:`.pages`) and
  exact units (:mod:`.windows`), written per layer by :mod:`.store`; prompts reused by :mod:`.prefixes`;
* ``"kivi_paged"`` — the attention that reads them (:mod:`.attention`).
"""

from .cache import KiviPagedCache
from .manager import (
    SUPPORTED_TRANSFORMERS,
    KiviBatchingManager,
    check_transformers_version,
    generate_batch,
    init_continuous_batching,
    install,
)

__all__ = [
    "SUPPORTED_TRANSFORMERS",
    "KiviBatchingManager",
    "KiviPagedCache",
    "check_transformers_version",
    "generate_batch",
    "init_continuous_batching",
    "install",
]
