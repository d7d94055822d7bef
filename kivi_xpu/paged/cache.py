"""``KiviPagedCache``: transformers' continuous-batching cache with each request's history in 2-bit pages.

It replaces transformers' ``PagedAttentionCache`` (same interface, used by the same scheduler, request lifecycle,
chunked prefill and batch preparation). ``kv_memory`` is one pool of sectors (:mod:`.budget`) lent to 2-bit pages
(:mod:`.pages`) and to exact units (:mod:`.windows`: each request's sinks and window, and a split prompt's exact
states). Admission reserves everything a request will hold (:meth:`KiviPagedCache.can_store_request_tokens`), so no
request is ever preempted. The flat batch of a forward is ``[1, H, sum(q_len), D]``; ``update`` splits it per
request (``cu_seq_lens_q`` / ``cu_seq_lens_k``), finds each request's pages from the read or write indices that
transformers computed from its block table, stores the new tokens (:mod:`.store`) and leaves in ``kwargs`` what
attention reads (:class:`LayerStep`), which the ``"kivi_paged"`` attention (:mod:`.attention`) consumes.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from transformers.generation.continuous_batching.cache import PagedAttentionCache, group_layers_by_attn_type
from transformers.generation.continuous_batching.cache_allocators import FULL_ATTENTION, CachePool
from transformers.generation.continuous_batching.utils import find_head_dim, find_num_key_value_heads

from ..algorithm import KiviSettings
from ..codec import KeyCodec, ValueCodec
from .allocator import KiviPageAllocator
from .attend import LayerStep
from .budget import PAGES, UNITS, PageBudget, PageShape, layer_settings
from .holdings import Holdings
from .prefixes import Entry, chain_hash, unit_hashes
from .store import DecodePlan, PageWriter, Request
from .windows import ExactUnits

logger = logging.getLogger(__name__)
LIVE_CACHES: weakref.WeakSet = weakref.WeakSet()  # the caches in this process (the server's usage reads their hits)
_CACHED_TOKENS_KEPT = 4096  # recent hits whose cached token counts stay readable (the server's usage)
STEP_KEY = "kivi_paged_step"  # where update leaves the layer's LayerStep in the attention kwargs
DEFAULT_MAX_BATCH_TOKENS = 1024  # query tokens of one forward when ContinuousBatchingConfig leaves it unset


def page_shape(config, kv_shards: int = 1) -> PageShape:
    """The pool's :class:`~kivi_xpu.paged.budget.PageShape` of a transformers ``config``: its KV heads (one rank's
    ``1 / kv_shards`` of them under tensor parallelism), ``head_dim`` and full-attention layers."""
    layers = group_layers_by_attn_type(config).get(FULL_ATTENTION, [])
    return PageShape(find_num_key_value_heads(config) // kv_shards, find_head_dim(config), len(layers))


def kv_shards(config, distributed_helper) -> int:
    """Into how many shards tensor parallelism cuts the KV heads (1: none): transformers' rule (its plan shards
    ``k_proj`` / ``v_proj``); ``ValueError`` when they do not divide."""
    size = distributed_helper.tp_size
    if size <= 1 or not distributed_helper.are_kv_heads_tp_ed():
        return 1
    heads = find_num_key_value_heads(config)
    if heads % size:
        raise ValueError(
            f"tensor parallelism over {size} ranks needs a number of KV heads divisible by {size}; this model has "
            f"{heads}: run it on a number of ranks that divides {heads}"
        )
    return size


class KiviPagedCache(PagedAttentionCache):
    """Paged KIVI cache for transformers' continuous batching (see the module docstring).

    Args:
        kv_memory: the byte budget of everything this cache stores (pages and exact units); requests beyond it wait
            in transformers' queue.
        settings: the KIVI settings (resolved for the model dtype): every layer's, or one per full-attention layer
            (``KiviCache.layer_settings``: per-layer bits, groups, metadata and rotations; the sinks and ``R``
            alike). A page holds ``T`` tokens, the least common multiple of the layers' key group sizes.
        max_requests: the most requests in flight (``None``: as many as the memory holds).
        backend: the kernels' backend name (``native``, ``sycl`` or ``reference``).
    """

    def __init__(self, config, continuous_batching_config, device, distributed_helper, dtype, *, kv_memory: int,
                 settings: KiviSettings | Sequence[KiviSettings], backend: str, max_requests: int | None = None,
                 salts: dict[str, str] | None = None, **_ignored):  # fmt: skip
        shards = kv_shards(config, distributed_helper)
        groups = group_layers_by_attn_type(config)
        if list(groups) != [FULL_ATTENTION]:
            raise ValueError(
                f"KIVI pages serve models whose layers all use full attention; this one has {sorted(groups)}"
            )
        layers = groups[FULL_ATTENTION]
        every = layer_settings(settings, len(layers))
        self.config, self.dtype, self.device = config, dtype, torch.device(device)
        self.layer_settings = dict(zip(layers, every, strict=True))  # full-attention layer -> its settings
        self.settings, self.backend = every[0], backend  # (for the sinks and R, which every layer shares)
        shape = page_shape(config, shards)  # this rank's heads
        heads, head_dim = shape.heads, shape.head_dim
        self.max_blocks_per_request = 0  # no flash block-table fast path
        self.budget = budget = PageBudget.plan(shape, every, dtype, kv_memory, max_requests)
        allocator = KiviPageAllocator(PAGES, budget.block, layers)
        continuous_batching_config.page_size = budget.block.tokens
        self.cache_allocators = {FULL_ATTENTION: allocator}
        self.layer_to_allocator = dict.fromkeys(layers, allocator)
        self.bytes_per_sector, self.num_sectors = budget.bytes_per_sector, budget.num_sectors
        self.tokens_per_sector = budget.pages_per_sector * allocator.tokens_per_page
        self.max_batch_tokens = continuous_batching_config.max_batch_tokens or DEFAULT_MAX_BATCH_TOKENS
        self.cache_tensor = torch.zeros(self.num_sectors * self.bytes_per_sector, dtype=torch.uint8, device=device)
        # No trash sectors: pages are written and read through this cache only, never at padding indices.
        self.pool = CachePool(self.num_sectors, 2, num_reserved_sectors=0)
        allocator.register_cache_tensor(self.bytes_per_sector, self.cache_tensor.numel(), self.cache_tensor,
                                        self.pool)  # fmt: skip
        self.units = ExactUnits(budget, self.cache_tensor, self.pool, layers, heads, head_dim, dtype)
        # Prefix reuse (:mod:`.prefixes`), on unless ContinuousBatchingConfig(allow_block_sharing=False): transformers'
        # scheduler then asks search_prefix_match for each new request, which admits a hit itself.
        self.allow_block_sharing = self.use_prefix_sharing = bool(continuous_batching_config.allow_block_sharing)
        self.scheduler = None  # set by the manager: a hit's admission reads the waiting request's state
        self.salts = {} if salts is None else salts  # request id -> tenant salt
        self._awaiting: set[str] = set()  # requests waiting for a prefix that another request is prefilling
        self._waiting_hashes: dict[str, list[int]] = {}  # waiting request -> its prompt's unit hashes
        self._batch_ids: list[str] = []  # the next forward's requests, in transformers' order
        self.cached_prompt_tokens: dict[str, int] = {}  # recent hits: request id -> prompt tokens found cached
        LIVE_CACHES.add(self)
        self.num_blocks = allocator.num_blocks
        self.read_cache_limit = None
        self.max_decode_fast_path_length = 0
        self.max_tokens_read = allocator.tokens_per_page * allocator.num_blocks
        self.first_layer, self.last_layer = layers[0], layers[-1]
        self.holdings = Holdings(self.settings, budget, allocator, self.units, self.pool, self.device)
        self._requests: list[Request] = []
        self._decode_plan: DecodePlan | None = None
        self._others: list[Request] = []
        self._writers = {layer: self._writer_for(s, head_dim) for layer, s in self.layer_settings.items()}

    def _writer_for(self, settings: KiviSettings, head_dim: int) -> PageWriter:
        """A layer's :class:`PageWriter`: its codecs and their rotations on this cache's device."""
        codecs = KeyCodec.of(settings, head_dim, self.backend), ValueCodec.of(settings, head_dim, self.backend)
        rotations = tuple(codec.rotation(self.device) for codec in codecs)
        return PageWriter(settings, self.budget.block.tokens, self.units, *codecs, rotations)

    # ------------------------------------------------------------------ memory

    @property
    def kv_bytes(self) -> int:
        """Bytes this cache holds resident: the pool (pages and exact units), within ``kv_memory``."""
        return self.cache_tensor.numel()

    @property
    def free_bytes(self) -> int:
        """Bytes of the pool no one holds: free sectors and the free blocks of lent ones."""
        budget, pool = self.budget, self.pool
        return (pool.num_free_sectors * self.bytes_per_sector
                + pool.count_free_blocks(PAGES) * budget.block.block_bytes
                + pool.count_free_blocks(UNITS) * budget.unit_bytes)  # fmt: skip

    @property
    def cached_bytes(self) -> int:
        """Bytes that only cached prefixes hold (their exact units, and pages no request lists)."""
        budget = self.budget
        return (self.holdings.prefixes.cached_units * budget.unit_bytes
                + len(self.holdings.cached_pages()) * budget.block.block_bytes)  # fmt: skip

    @property
    def held_bytes(self) -> int:
        """Bytes of pages and exact units that requests hold now: the pool less what is free and what is cached
        (``held_bytes + cached_bytes + free_bytes`` is always the pool)."""
        return self.num_sectors * self.bytes_per_sector - self.free_bytes - self.cached_bytes

    def drop_cached_prefixes(self) -> int:
        """Evicts every cached prefix; returns how many."""
        return self.holdings.drop_cached_prefixes()

    @property
    def requests_in_flight(self) -> int:
        return len(self.holdings)

    # ------------------------------------------------------------- lifecycle

    def can_store_request_tokens(self, state, request_len: int, dry_run: bool = False) -> bool:
        """Admission: a request not yet in flight is admitted only when all it will hold fits at once (its pages for
        prompt + ``max_new_tokens``, its window, its exact prompt while staged), evicting cached prefixes if need be;
        its later steps then always fit, so transformers never preempts it. (A request that found a cached prefix
        was admitted by :meth:`search_prefix_match`.)"""
        allocator = self.cache_allocators[FULL_ATTENTION]
        request_id = state.request_id
        if request_id in self.holdings:
            if allocator.needs_new_blocks(request_id, state.current_len(), request_len):
                raise RuntimeError(
                    f"KiviPagedCache: request {request_id} outgrew the {len(allocator.block_table[request_id])} "
                    f"pages reserved at its admission"
                )
            return True
        if request_id in self._awaiting:
            self._awaiting.discard(request_id)
            return False
        if not self._admissible(request_id):
            return False
        if state.current_len() or state.max_new_tokens is None:
            raise RuntimeError(
                f"KiviPagedCache: request {request_id} arrived with {state.current_len()} tokens already processed or "
                f"no max_new_tokens; KIVI pages admit fresh requests of known length only"
            )
        prompt = max(len(state.remaining_prefill_tokens), request_len)  # (a dry run may ask for any length)
        return (
            self._admit(state, state.remaining_prefill_tokens, prompt, request_len < prompt, dry_run=dry_run)
            is not None
        )

    def search_prefix_match(self, request_id: str, prompt_ids: list[int]) -> int:
        """transformers' scheduler asks this for each new request before admission, and makes the request active at
        the returned position at once: so a hit (the first whole units of ``prompt_ids`` cached, at least one token
        left to compute) is admitted here, with all it will hold; otherwise 0, and :meth:`can_store_request_tokens`
        admits it from position 0, or keeps it waiting while another request prefills a unit of its prompt."""
        state = None if self.scheduler is None else self.scheduler.waiting_requests.get(request_id)
        if state is None or state.max_new_tokens is None or not self._admissible(request_id):
            return 0
        prefixes, rows = self.holdings.prefixes, self.budget.rows
        salt = self.salts.get(request_id)
        hashes = self._prompt_hashes(request_id, prompt_ids)
        chain = prefixes.match(hashes[: (len(prompt_ids) - 1) // rows])
        if prefixes.awaited(hashes[len(chain) :], request_id):
            self._awaiting.add(request_id)
            return 0
        parent = chain[-1].key if chain else None
        tail = prefixes.match_tail(parent, salt, prompt_ids[len(chain) * rows :])
        if not chain and tail is None:
            return 0
        prompt = len(prompt_ids)
        cached = self._admit(state, prompt_ids, prompt, True, chain, tail)
        if cached is None:
            return 0  # (admission from position 0 may still fit, evicting this prefix too)
        self.cached_prompt_tokens[request_id] = cached
        while len(self.cached_prompt_tokens) > _CACHED_TOKENS_KEPT:
            self.cached_prompt_tokens.pop(next(iter(self.cached_prompt_tokens)))
        logger.info(
            "KIVI pages: request %s starts after %d cached tokens of its %d-token prompt (%.0f%% of the prompt tokens "
            "admitted so far were found cached)", request_id, cached, prompt, 100 * prefixes.hit_rate,
        )  # fmt: skip
        return cached

    def _admit(self, state, prompt_ids: list[int], prompt: int, staged: bool, chain: list[Entry] = (),
               tail: Entry | None = None, dry_run: bool = False) -> int | None:  # fmt: skip
        """Admits ``state``'s request (``prompt`` tokens, ``prompt_ids`` still to prefill, after the cached ``chain``
        and ``tail`` of a hit) with all it will hold, evicting cached prefixes other than those if it must; returns
        the prompt tokens found cached, or ``None`` when it does not fit (a ``dry_run`` only asks)."""
        request_id = state.request_id
        hashes = [] if dry_run else self._prompt_hashes(request_id, prompt_ids)
        tail_key = None if dry_run else self._tail_key(hashes, self.salts.get(request_id), prompt_ids)
        staged = staged or bool(hashes) or tail_key is not None  # a prompt kept as prefixes is staged whole
        needs = self.budget.needs(prompt, state.max_new_tokens - len(state.generated_tokens), staged)
        shared = len(self.holdings.prefixes.shared_pages(chain))
        needs = needs._replace(pages=needs.pages - shared, units=needs.units - len(chain))
        keep = list(chain) if tail is None else [*chain, tail]
        if not self.holdings.fits(needs, keep=keep, evict=not dry_run):
            return None
        if dry_run:
            return 0
        cached = self.holdings.take(request_id, needs, prompt, staged, hashes, list(chain), tail, tail_key)
        self._waiting_hashes.pop(request_id, None)
        return cached

    def _tail_key(self, hashes: list[int], salt: str | None, prompt_ids: list[int]) -> int | None:
        """The hash of the prompt's tokens after its whole units (``None``: none, or no prefix reuse)."""
        start = len(hashes) * self.budget.rows
        if not self.use_prefix_sharing or start == len(prompt_ids):
            return None
        return chain_hash(hashes[-1] if hashes else None, salt, prompt_ids[start:])

    def _admissible(self, request_id: str) -> bool:
        if self.budget.max_requests is not None and len(self.holdings) >= self.budget.max_requests:
            return False
        return not request_id.startswith("__warmup_")  # transformers' warm-up of padded shapes: nothing to warm

    def _prompt_hashes(self, request_id: str, prompt_ids: list[int]) -> list[int]:
        """The hash chain of the prompt's whole units (none without prefix reuse), computed once per waiting request
        (the scheduler asks at every step until it is admitted)."""
        if not self.use_prefix_sharing:
            return []
        hashes = self._waiting_hashes.get(request_id)
        if hashes is None:
            rows = self.budget.rows
            hashes = unit_hashes(prompt_ids, rows, self.salts.get(request_id), len(prompt_ids) // rows)
            self._waiting_hashes[request_id] = hashes
        return hashes

    def count_new_complete_blocks(self, state, request_len: int) -> dict:
        return {}  # units are registered by update (:meth:`Holdings.register_filled_units`), not by block hashes

    def mark_complete_blocks(self, state, complete_blocks) -> None:
        pass

    def evict_cached_blocks(self) -> bool:
        return False  # cached prefixes are evicted by admission, one at a time, only when a request needs the room

    def extend_read_and_write_indices(self, request_id, past_length, query_length, read_index, write_index) -> None:
        """transformers' indices, and the order of the next forward's requests (which names them in :meth:`_plan`)."""
        self._batch_ids.append(request_id)
        super().extend_read_and_write_indices(request_id, past_length, query_length, read_index, write_index)

    def free_blocks(self, request_id: str, no_cache: bool = False) -> None:
        """Returns everything the request holds: its pages, its window, its staged prompt (the whole units of its
        prompt stay cached)."""
        self.holdings.free(request_id)
        self.salts.pop(request_id, None)
        self._waiting_hashes.pop(request_id, None)

    def free_all_requests(self, clear_ledgers: bool = False) -> None:
        for request_id in list(self.cache_allocators[FULL_ATTENTION].block_table):
            self.free_blocks(request_id)

    def prepare_fork_request(self, *args, **kwargs):
        raise ValueError(
            "KIVI pages cannot fork a request (num_return_sequences > 1): each copy would need its own exact slot; "
            "submit the prompt several times instead"
        )

    # ---------------------------------------------------------------- update

    def _plan(self, kwargs: dict[str, Any]) -> list[Request]:
        """The requests of this forward, named in transformers' order (once per forward)."""
        cu_q = kwargs["cu_seq_lens_q"].tolist()
        cu_k = kwargs["cu_seq_lens_k"][FULL_ATTENTION].tolist()
        ids, self._batch_ids = self._batch_ids, []
        requests = []
        for r in range(len(cu_q) - 1):
            q_start, q_len = cu_q[r], cu_q[r + 1] - cu_q[r]
            if q_len == 0:
                continue  # padding
            if len(requests) == len(ids):
                raise RuntimeError("KiviPagedCache: a forward has more requests than transformers prepared")
            request_id = ids[len(requests)]
            held = self.holdings[request_id]
            past = cu_k[r + 1] - cu_k[r] - q_len
            requests.append(Request(request_id, held.slot, past, q_start, q_len, held.blocks, held.prompt_end,
                                    held.staging, self.settings.split(past), held.shared_pages,
                                    held.keep_prompt))  # fmt: skip
        return requests

    def _plan_decode(self) -> None:
        """Splits the forward's requests into decode rows (one token after full sinks and a stored prompt: one
        batched store and one attention call per layer) and the others."""
        decode, self._others = [], []
        for r in self._requests:
            (decode if r.decode_row else self._others).append(r)
        tokens = self.budget.block.tokens
        self._decode_plan = DecodePlan.of(decode, self.settings, tokens, self.units, self.device) if decode else None

    @torch.compiler.disable
    def update(self, key_states, value_states, layer_idx: int, kwargs: dict[str, Any]):
        """Stores ``key_states`` / ``value_states [1, H, sum(q_len), D]`` of every request of the batch and leaves
        the layer's :class:`LayerStep` in ``kwargs``; returns the states unchanged (attention reads the
        steps, not them)."""
        if layer_idx == self.first_layer or not self._requests:
            self._requests = self._plan(kwargs)
            self._plan_decode()
        kwargs["cu_seq_lens_k"] = kwargs["cu_seq_lens_k"][FULL_ATTENTION]
        kwargs["max_length_k"] = kwargs["max_length_k"][FULL_ATTENTION]
        pages = self.cache_allocators[FULL_ATTENTION].pages[layer_idx]
        plan, writer = self._decode_plan, self._writers[layer_idx]
        decode = None if plan is None else writer.decode_rows(plan, layer_idx, pages, key_states, value_states)
        steps = [writer.request_step(layer_idx, pages, r, key_states, value_states) for r in self._others]
        if layer_idx == self.last_layer:
            self._end_finished_staging()
        kwargs[STEP_KEY] = LayerStep(self.backend, decode, steps, (writer.key_rotation, writer.value_rotation))
        return key_states, value_states

    def _end_finished_staging(self) -> None:
        """After the last layer: the whole units that prompts filled become cached prefixes, and requests whose last
        prompt chunk ran return their staging units."""
        for r in self._others:
            if r.staging is not None:
                self.holdings.register_filled_units(r.request_id, r.past + r.q_len)
                if r.past + r.q_len == r.prompt_end:
                    self.holdings.end_staging(r.request_id)
