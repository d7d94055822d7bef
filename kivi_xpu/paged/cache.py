"""``KiviPagedCache``: transformers' continuous-batching cache with each request's history in 2-bit pages.

It replaces transformers' ``PagedAttentionCache`` (same interface, used by the same scheduler, request lifecycle,
chunked prefill and batch preparation): the byte budget buys 2-bit pages (:mod:`.pages`) plus one exact slot per
request in flight (:mod:`.windows`). The flat batch of a forward is ``[1, H, sum(q_len), D]``; ``update`` splits it
per request (``cu_seq_lens_q`` / ``cu_seq_lens_k``), finds each request's pages from the read or write indices that
transformers computed from its block table, stores the new tokens as the request's own :class:`~kivi_xpu.KiviCache`
would (same counts, same codes), and leaves in ``kwargs`` what attention reads (:class:`RequestStep` per request),
which the ``"kivi_paged"`` attention (:mod:`.attention`) consumes.
"""

from __future__ import annotations

from math import lcm
from typing import Any, NamedTuple

import torch
from transformers.generation.continuous_batching.cache import PagedAttentionCache, group_layers_by_attn_type
from transformers.generation.continuous_batching.cache_allocators import FULL_ATTENTION, CachePool
from transformers.generation.continuous_batching.utils import find_head_dim, find_num_key_value_heads

from ..algorithm import KiviSettings
from ..ops import kernel
from ..ops.checks import KindOperands
from ..rotation import rotate, rotation_matrix
from .pages import KiviPageAllocator, LayerPages, PageLayout
from .windows import WindowSlots

STEP_KEY = "kivi_paged_step"  # where update leaves the layer's RequestSteps in the attention kwargs


class RequestStep(NamedTuple):
    """One request's share of a layer's forward: query rows ``[q_start, q_start + q_len)`` of the flat batch attend
    to ``keys`` / ``values`` (sinks, packed history, exact tail, as ``decode_attention`` reads them); ``prefill``:
    the request held nothing before (exact causal attention over its own tokens, as KiviCache's prefill)."""

    q_start: int
    q_len: int
    keys: KindOperands
    values: KindOperands
    prefill: bool


class DecodeRows(NamedTuple):
    """The decode rows of a layer's forward (one query row each, sinks full), for one ``paged_decode_attention``
    call: query rows ``q_index`` of the flat batch; ``args``: the op's arguments after ``query``."""

    q_index: torch.Tensor
    args: tuple


class LayerStep(NamedTuple):
    """What ``update`` leaves for attention in ``kwargs[STEP_KEY]``: the backend whose kernels read the pages, the
    batch's decode rows (or ``None``) and one :class:`RequestStep` per other request (prefill and prompt chunks)."""

    backend: str
    decode: DecodeRows | None
    requests: list[RequestStep]
    rotations: tuple  # (key rotation, value rotation): None or Q [D, D] float32


class _Request(NamedTuple):
    slot: int
    past: int
    q_start: int
    q_len: int
    blocks: torch.Tensor  # int64 block ids of pages 0, 1, ... (ceil((past + q_len) / T) of them)


class _DecodePlan(NamedTuple):
    """What every layer's store and attention of a forward's decode rows need, worked out once per forward."""

    requests: list[_Request]
    bases: list[int]  # where each request's value rows start in its slot (after move_values)
    q_index: torch.Tensor  # [N] their query rows in the flat batch
    slots: torch.Tensor  # [N]
    window_rows: torch.Tensor  # [2, N] the new token's key row and value row in the slot
    table: torch.Tensor  # [N, pages] block table
    table_rows: torch.Tensor  # [N, 7] paged_decode_attention's requests table
    leaving: torch.Tensor | None  # [4, n] value tokens leaving: slot, window row, block, page row
    key_blocks: list[tuple[_Request, int, int]]  # (request, packed keys before, keys leaving now)


class PageBudget(NamedTuple):
    """How a byte budget splits into exact slots and 2-bit pages (whole sectors, two of them trash)."""

    layout: PageLayout
    max_requests: int
    bytes_per_sector: int
    num_sectors: int
    num_layers: int

    @classmethod
    def plan(cls, config, settings: KiviSettings, dtype, kv_memory: int, max_requests: int | None) -> PageBudget:
        heads, head_dim = find_num_key_value_heads(config), find_head_dim(config)
        settings.check_head_dim(head_dim)
        num_layers = len(group_layers_by_attn_type(config).get(FULL_ATTENTION, []))
        layout = PageLayout.for_settings(settings, heads, head_dim)
        bytes_per_sector = lcm(layout.page_bytes * num_layers, 128)
        slot_bytes = WindowSlots.bytes_per_slot(settings, num_layers, heads, head_dim, dtype)
        if max_requests is None:
            max_requests = max(1, min(256, kv_memory // 4 // slot_bytes))
        num_sectors = (kv_memory - max_requests * slot_bytes) // bytes_per_sector - 2
        if num_sectors < 1:
            raise ValueError(
                f"`kv_memory` ({kv_memory / 2**20:.1f} MiB) is too small: {max_requests} request slot(s) take "
                f"{max_requests * slot_bytes / 2**20:.1f} MiB and the pages need at least "
                f"{3 * bytes_per_sector / 2**20:.1f} MiB more; raise it or lower `max_requests`"
            )
        return cls(layout, max_requests, bytes_per_sector, num_sectors, num_layers)

    @property
    def max_request_tokens(self) -> int:
        """The longest request the pages can hold: every block (``T`` tokens) of every sector given to it."""
        blocks_per_sector = self.bytes_per_sector // (self.layout.page_bytes * self.num_layers)
        return self.num_sectors * blocks_per_sector * self.layout.tokens


class KiviPagedCache(PagedAttentionCache):
    """Paged KIVI cache for transformers' continuous batching (see the module docstring).

    Args:
        kv_memory: the byte budget of everything this cache stores (pages and exact slots); requests beyond it wait
            in transformers' queue.
        settings: the KIVI settings (resolved for the model dtype).
        max_requests: exact slots, the most requests in flight; default: as many as a quarter of the budget holds.
        backend: the kernels' backend name (``native``, ``sycl`` or ``reference``).
    """

    def __init__(self, config, continuous_batching_config, device, distributed_helper, dtype, *, kv_memory: int,
                 settings: KiviSettings, backend: str, max_requests: int | None = None, **_ignored):  # fmt: skip
        if distributed_helper.tp_size > 1:
            raise ValueError("KIVI pages do not support tensor-parallel continuous batching (tp_size > 1)")
        groups = group_layers_by_attn_type(config)
        if list(groups) != [FULL_ATTENTION]:
            raise ValueError(
                f"KIVI pages serve models whose layers all use full attention; this one has {sorted(groups)}"
            )
        self.config, self.dtype, self.device = config, dtype, torch.device(device)
        self.settings, self.backend = settings, backend
        heads, head_dim = find_num_key_value_heads(config), find_head_dim(config)
        if continuous_batching_config.page_size != settings.key_group_size:
            continuous_batching_config.page_size = settings.key_group_size
        self.max_blocks_per_request = 0  # no flash block-table fast path
        layers = groups[FULL_ATTENTION]
        budget = PageBudget.plan(config, settings, dtype, kv_memory, max_requests)
        allocator = KiviPageAllocator(0, budget.layout, layers)
        self.cache_allocators = {FULL_ATTENTION: allocator}
        self.layer_to_allocator = dict.fromkeys(layers, allocator)
        self.bytes_per_sector, num_sectors = budget.bytes_per_sector, budget.num_sectors
        self.tokens_per_sector = self.bytes_per_sector // allocator.bytes_per_block * allocator.tokens_per_page
        max_requests = budget.max_requests
        self.max_batch_tokens = continuous_batching_config.max_batch_tokens or 1024
        self.num_sectors = num_sectors
        self.cache_tensor = torch.zeros((num_sectors + 2) * self.bytes_per_sector, dtype=torch.uint8, device=device)
        self.pool = CachePool(num_sectors, 1)
        allocator.register_cache_tensor(self.bytes_per_sector, num_sectors * self.bytes_per_sector,
                                        self.cache_tensor, self.pool)  # fmt: skip
        self.windows = WindowSlots(settings, max_requests, layers, heads, head_dim, dtype, self.device)
        self.allow_block_sharing = self.use_prefix_sharing = False
        self.num_blocks = allocator.num_blocks
        self.read_cache_limit = None
        self.max_decode_fast_path_length = 0
        self.max_tokens_read = allocator.tokens_per_page * allocator.num_blocks
        self.first_layer = layers[0]
        self._slot_of_request: dict[str, int] = {}
        self._slot_of_first_block: dict[int, int] = {}
        self._requests: list[_Request] = []
        self._decode_plan: _DecodePlan | None = None
        self._others: list[_Request] = []
        self._key_rotation = rotation_matrix(settings.key_rotation, head_dim, self.device)
        self._value_rotation = rotation_matrix(settings.value_rotation, head_dim, self.device)

    # ------------------------------------------------------------------ memory

    @property
    def kv_bytes(self) -> int:
        """Bytes this cache holds resident: the pages (with the two trash sectors) and the exact slots."""
        return self.cache_tensor.numel() + self.windows.nbytes

    @property
    def free_slots(self) -> int:
        return len(self.windows.free)

    # ------------------------------------------------------------- lifecycle

    def can_store_request_tokens(self, state, request_len: int, dry_run: bool = False) -> bool:
        """transformers' rule, plus: a request not yet in flight needs a free slot."""
        allocator = self.cache_allocators[FULL_ATTENTION]
        new = state.request_id not in allocator.block_table
        if new and not self.windows.free:
            return False
        stored = super().can_store_request_tokens(state, request_len, dry_run)
        if not stored or dry_run:
            return stored
        if new:
            slot = self.windows.take()
            self._slot_of_request[state.request_id] = slot
            self._slot_of_first_block[allocator.block_table[state.request_id][0]] = slot
        return True

    def free_blocks(self, request_id: str, no_cache: bool = False) -> None:
        allocator = self.cache_allocators[FULL_ATTENTION]
        blocks = allocator.block_table.get(request_id)
        slot = self._slot_of_request.pop(request_id, None)
        if slot is not None:
            if blocks:
                self._slot_of_first_block.pop(blocks[0], None)
            self.windows.give_back(slot)
        super().free_blocks(request_id, no_cache=True)

    def free_all_requests(self, clear_ledgers: bool = False) -> None:
        for request_id in list(self.cache_allocators[FULL_ATTENTION].block_table):
            self.free_blocks(request_id)

    def prepare_fork_request(self, *args, **kwargs):
        raise ValueError(
            "KIVI pages cannot fork a request (num_return_sequences > 1): each copy would need its own exact slot; "
            "submit the prompt several times instead"
        )

    # ---------------------------------------------------------------- update

    def _plan(self, kwargs: dict[str, Any]) -> list[_Request]:
        """The requests of this forward, from the batch's cumulative lengths and indices (once per forward)."""
        allocator = self.cache_allocators[FULL_ATTENTION]
        t, stride = allocator.tokens_per_page, allocator.block_physical_stride
        cu_q = kwargs["cu_seq_lens_q"].tolist()
        cu_k = kwargs["cu_seq_lens_k"][FULL_ATTENTION].tolist()
        read, write = kwargs["read_index"][0], kwargs["write_index"][0]
        requests = []
        for r in range(len(cu_q) - 1):
            q_start, q_len = cu_q[r], cu_q[r + 1] - cu_q[r]
            if q_len == 0:
                continue  # padding
            past = cu_k[r + 1] - cu_k[r] - q_len
            # Physical token index = block * stride + offset: the first index of each page gives its block.
            if read.numel():
                blocks = read[cu_k[r] : cu_k[r + 1] : t] // stride
            else:  # nothing read in this batch: every request starts here, its write indices cover it
                blocks = write[q_start : q_start + q_len : t] // stride
            slot = self._slot_of_first_block.get(int(blocks[0]))
            if slot is None:
                raise RuntimeError(
                    "KiviPagedCache: a request reached the model without a slot (it was admitted by another cache?)"
                )
            requests.append(_Request(slot, past, q_start, q_len, blocks.to(torch.int64)))
        return requests

    def _plan_decode(self) -> None:
        """Splits the forward's requests into decode rows (one token after full sinks: one batched store and one
        attention call per layer) and the others, and works out once per forward what every layer's store and
        attention of the decode rows need (all layers hold the same counts)."""
        s, t, settings = self.settings.sink_tokens, self.settings.key_group_size, self.settings
        decode, self._others = [], []
        for r in self._requests:
            (decode if r.q_len == 1 and r.past >= s else self._others).append(r)
        self._decode_plan = None
        if not decode:
            return
        table = torch.zeros(len(decode), max(r.blocks.numel() for r in decode), dtype=torch.int64)
        rows, bases, window_rows, leaving, key_blocks = [], [], [], [], []
        for i, r in enumerate(decode):
            table[i, : r.blocks.numel()] = r.blocks
            qk0, qv0 = settings.quantized_key_count(r.past), settings.quantized_value_count(r.past)
            base = self.windows.value_base_for(r.past)  # where move_values puts the slot's value rows
            bases.append(base)
            window_rows.append((r.past - qk0, r.past - base))  # the new token's key and value rows
            rows.append((r.slot, s, qk0, s, qv0, s + qv0 - base, r.past + 1))
            if settings.quantized_value_count(r.past + 1) > qv0:  # the oldest exact value token leaves
                leaving.append((r.slot, s + qv0 - base, int(r.blocks[qv0 // t]), qv0 % t))
            qk1 = settings.quantized_key_count(r.past + 1)
            if qk1 > qk0:  # the key window is full: its block leaves it
                key_blocks.append((r, qk0, qk1 - qk0))
        device = self.device
        self._decode_plan = _DecodePlan(
            decode,
            bases,
            torch.tensor([r.q_start for r in decode], device=device),
            torch.tensor([r.slot for r in decode], device=device),
            torch.tensor(window_rows, device=device).T.contiguous(),
            table.to(device),
            torch.tensor(rows, dtype=torch.int64, device=device),
            torch.tensor(leaving, device=device).T.contiguous() if leaving else None,
            key_blocks,
        )

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
        plan = self._decode_plan
        decode = None if plan is None else self._store_decode_rows(plan, layer_idx, pages, key_states, value_states)
        steps = [self._store(layer_idx, pages, request, key_states, value_states) for request in self._others]
        kwargs[STEP_KEY] = LayerStep(self.backend, decode, steps, (self._key_rotation, self._value_rotation))
        return key_states, value_states

    def _store_decode_rows(self, plan: _DecodePlan, layer: int, pages: LayerPages, key_states, value_states):
        """Every decode row's update of one layer at once: the new tokens join their slots' windows (one indexed
        copy per kind), the value tokens leaving the windows are quantized into their pages (one call), a key block
        that fills its window is packed (per request, once in R steps). Returns the :class:`DecodeRows` attention
        reads."""
        settings, s = self.settings, self.settings.sink_tokens
        key_windows, value_windows = self.windows.keys[layer], self.windows.values[layer]
        held = self.windows.value_base[layer]
        for r, base in zip(plan.requests, plan.bases, strict=True):
            if held[r.slot] != base:  # once in G steps per request: the value rows move down
                self.windows.move_values(layer, r.slot, r.past)
        key_windows[plan.slots, :, plan.window_rows[0]] = key_states[0, :, plan.q_index].transpose(0, 1)
        value_windows[plan.slots, :, plan.window_rows[1]] = value_states[0, :, plan.q_index].transpose(0, 1)
        if plan.leaving is not None:
            self._pack_leaving_values(pages, value_windows, plan.leaving)
        for r, qk0, count in plan.key_blocks:
            self._pack_keys(pages, r.blocks, qk0, key_windows[r.slot, :, s : s + count].unsqueeze(0))
        args = (
            key_windows,
            value_windows,
            pages.key_codes,
            pages.key_scales,
            pages.key_zeros,
            pages.value_codes,
            pages.value_scales,
            pages.value_zeros,
            plan.table,
            plan.table_rows,
            settings.key_bits,
            settings.value_group_size,
            settings.value_bits,
        )
        return DecodeRows(plan.q_index, args)

    def _pack_leaving_values(self, pages: LayerPages, value_windows, leaving: torch.Tensor) -> None:
        """Quantizes the value tokens leaving the windows (``leaving [4, n]``: slots, window rows, blocks, page rows)
        into their pages' rows: one quantization of all of them (the rotation folded in, as KiviCache's), one indexed
        copy per section."""
        settings = self.settings
        slots, window_rows, blocks, page_rows = leaving
        x = value_windows[slots, :, window_rows].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        heads, n = x.shape[1:3]
        codes = pages.value_codes.new_empty(1, heads, n, pages.value_codes.shape[3])
        scales = pages.value_scales.new_empty(1, heads, n, pages.value_scales.shape[3])
        zeros = torch.empty_like(scales)
        kernel("quantize_values_into", self.backend)(
            x.contiguous(), codes, scales, zeros, 0, settings.value_group_size, settings.value_bits,
            self._value_rotation,
        )  # fmt: skip
        for section, part in ((pages.value_codes, codes), (pages.value_scales, scales), (pages.value_zeros, zeros)):
            section[blocks, :, page_rows] = part[0].transpose(0, 1)

    def _store(self, layer: int, pages: LayerPages, request: _Request, key_states, value_states) -> RequestStep:
        """One request's update of one layer, for a request that is not a decode row (a prefill, a prompt chunk, or
        a token before the sinks are full): returns what its attention reads."""
        s, settings = self.settings.sink_tokens, self.settings
        slot, past, m = request.slot, request.past, request.q_len
        new_k = key_states[:, :, request.q_start : request.q_start + m]
        new_v = value_states[:, :, request.q_start : request.q_start + m]
        length = past + m
        key_rows, value_rows = self.windows.keys[layer][slot], self.windows.values[layer][slot]
        qk0, qk1 = settings.quantized_key_count(past), settings.quantized_key_count(length)
        qv0, qv1 = settings.quantized_value_count(past), settings.quantized_value_count(length)
        self.windows.move_values(layer, slot, past)
        base = self.windows.value_base[layer][slot]
        held_sinks = min(past, s)
        # Exact tokens after the packed ones: window rows then the new tokens (sinks-bound ones first).
        key_tail = torch.cat([key_rows[:, s : s + max(0, past - s - qk0)].unsqueeze(0), new_k], dim=2)
        value_tail = torch.cat([value_rows[:, s + qv0 - base : s + max(0, past - s) - base].unsqueeze(0), new_v],
                               dim=2)  # fmt: skip
        to_sinks = min(m, s - held_sinks)
        if to_sinks > 0:
            key_rows[:, held_sinks : held_sinks + to_sinks] = new_k[0, :, :to_sinks]
            value_rows[:, held_sinks : held_sinks + to_sinks] = new_v[0, :, :to_sinks]
        step = RequestStep(
            request.q_start,
            m,
            self._operands("keys", pages, request.blocks, key_rows[:, :held_sinks].unsqueeze(0), qk0, key_tail),
            self._operands("values", pages, request.blocks, value_rows[:, :held_sinks].unsqueeze(0), qv0, value_tail),
            past == 0,
        )
        # Tokens leaving the exact window now (attention still reads them exact, from the tails above).
        start = max(0, s - past)  # tail index of position s (the tails start at s + q0 or at past)
        if qk1 > qk0:
            self._pack_keys(pages, request.blocks, qk0, key_tail[:, :, start : start + qk1 - qk0])
        if qv1 > qv0:
            self._pack_values(pages, request.blocks, qv0, value_tail[:, :, start : start + qv1 - qv0])
        self._rewrite_windows(layer, slot, length, key_tail, value_tail, past)
        return step

    def _rewrite_windows(self, layer: int, slot: int, length: int, key_tail, value_tail, past: int) -> None:
        """After a multi-token (or sink-filling) append: the slot's exact rows as :mod:`.windows` lays them out."""
        s, settings = self.settings.sink_tokens, self.settings
        skip = max(0, s - past)  # tail tokens that went to the sinks
        qk0, qv0 = settings.quantized_key_count(past), settings.quantized_value_count(past)
        qk1, qv1 = settings.quantized_key_count(length), settings.quantized_value_count(length)
        exact = max(0, length - s)
        key_rows, value_rows = self.windows.keys[layer][slot], self.windows.values[layer][slot]
        keys = key_tail[0, :, skip + qk1 - qk0 :]
        key_rows[:, s : s + exact - qk1] = keys
        base = self.windows.value_base_for(length)
        values = value_tail[0, :, skip + qv1 - qv0 :]
        value_rows[:, s + qv1 - base : s + exact - base] = values
        self.windows.value_base[layer][slot] = base

    def _operands(self, kind: str, pages: LayerPages, blocks, sinks, count: int, tail) -> KindOperands:
        t = self.settings.key_group_size
        used = blocks[: -(-count // t)]
        if kind == "keys":
            codes, scales, zeros = pages.keys(used)
            group, bits, rotation = self.settings.key_group_size, self.settings.key_bits, self._key_rotation
        else:
            codes, scales, zeros = pages.values(used)
            group, bits, rotation = self.settings.value_group_size, self.settings.value_bits, self._value_rotation
        return KindOperands(sinks, codes, scales, zeros, count, group, bits, tail, rotation)

    def _pack_keys(self, pages: LayerPages, blocks, start: int, keys) -> None:
        """Quantizes ``keys [1, H, n, D]`` (packed positions ``[start, start + n)``, whole pages) into their pages."""
        t = self.settings.key_group_size
        x = rotate(keys, self._key_rotation)
        codes, scales, zeros = kernel("quantize_keys", self.backend)(
            x.contiguous(), self.settings.key_group_size, self.settings.key_bits, self.settings.meta_dtype
        )
        pages.store_keys(blocks[start // t : (start + keys.shape[2]) // t], codes, scales, zeros)

    def _pack_values(self, pages: LayerPages, blocks, start: int, values) -> None:
        """Quantizes ``values [1, H, n, D]`` (packed positions ``[start, start + n)``) into their pages' rows."""
        t, quantize = self.settings.key_group_size, kernel("quantize_values_into", self.backend)
        done, n = 0, values.shape[2]
        while done < n:
            position = start + done
            page, row = int(blocks[position // t]), position % t
            count = min(n - done, t - row)
            quantize(
                values[:, :, done : done + count],
                pages.value_codes[page : page + 1],
                pages.value_scales[page : page + 1],
                pages.value_zeros[page : page + 1],
                row,
                self.settings.value_group_size,
                self.settings.value_bits,
                self._value_rotation,
            )
            done += count
