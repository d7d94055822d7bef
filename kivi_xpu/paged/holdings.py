"""What each request in flight holds, in one owner (as vLLM's ``BlockPool``): :class:`Holdings` lends a request its
pages (transformers' block table, :mod:`.pages`) and its exact units (its slot and, while its prompt is staged, its
staging: :mod:`.windows`) from the one pool of sectors (:mod:`.budget`), shares cached prefixes with it
(:mod:`.prefixes`), evicts cached prefixes when a request needs their room, and takes back what it held in
:meth:`Holdings.free`. At all times the pool's bytes are held (by requests), cached (by prefixes alone) or free."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..algorithm import KiviSettings
from .allocator import KiviPageAllocator
from .budget import PAGES, UNITS, PageBudget, RequestNeeds
from .prefixes import Entry, PrefixIndex
from .windows import ExactUnits


@dataclass
class Held:
    """What one admitted request holds besides its pages (transformers' block table ``blocks``, of which the first
    ``shared_pages`` are a cached prefix's): its window unit, its prompt's length and, while its prompt is staged,
    the units of its exact prompt (int64, in order: the cached prefix's units, then its own)."""

    slot: int
    prompt_end: int
    blocks: torch.Tensor
    shared_pages: int = 0
    staging: torch.Tensor | None = None
    own_units: list[int] = field(default_factory=list)  # staging units it lends no entry
    hashes: list[int] = field(default_factory=list)  # of its prompt's whole units
    chain: list[Entry] = field(default_factory=list)  # entries of its prompt's units: found cached, then registered
    hit_units: int = 0  # units of its prompt found cached
    tail_key: int | None = None  # hash of its prompt's tokens after the whole units (None: there are none)
    keep_prompt: bool = False  # its whole units become entries


class Holdings:
    """The pages and units of every request in flight and of the cached prefixes (see the module docstring)."""

    def __init__(self, settings: KiviSettings, budget: PageBudget, allocator: KiviPageAllocator, units: ExactUnits,
                 pool, device):  # fmt: skip
        self.settings, self.budget, self.allocator, self.units = settings, budget, allocator, units
        self.pool, self.device = pool, device
        self.held: dict[str, Held] = {}
        self.prefixes = PrefixIndex()

    def __len__(self) -> int:
        return len(self.held)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.held

    def __getitem__(self, request_id: str) -> Held:
        return self.held[request_id]

    # ------------------------------------------------------------------ memory

    def _fits_now(self, needs: RequestNeeds) -> bool:
        pool = self.pool
        sectors = self.budget.sectors(needs, pool.count_free_blocks(PAGES), pool.count_free_blocks(UNITS))
        return sectors <= pool.num_free_sectors

    def fits(self, needs: RequestNeeds, keep: list[Entry] = (), evict: bool = True) -> bool:
        """Whether the pool holds ``needs``; with ``evict``, after evicting cached prefixes (least recently used first,
        never ``keep``) until it does or none is left."""
        if self._fits_now(needs):
            return True
        if evict:
            for unit, pages in self.prefixes.evictable(keep):
                self._give_back_evicted(unit, pages)
                if self._fits_now(needs):
                    return True
        return False

    def _give_back_evicted(self, unit: int, pages: list[int]) -> None:
        """An evicted prefix's unit, and its pages that no one else holds, back to the pool."""
        self.units.give_back([unit])
        self.pool.free_blocks(PAGES, pages)
        self.pool.try_to_free_sectors()

    def drop_cached_prefixes(self) -> int:
        """Evicts every cached prefix; returns how many."""
        count = 0
        for unit, pages in self.prefixes.evictable():
            self._give_back_evicted(unit, pages)
            count += 1
        return count

    def cached_pages(self) -> set[int]:
        """Pages that only cached prefixes hold."""
        listed = {block for table in self.allocator.block_table.values() for block in table}
        return self.prefixes.pages() - listed

    # ------------------------------------------------------------------ lending

    def take(self, request_id: str, needs: RequestNeeds, prompt_end: int, staged: bool, hashes: list[int],
             chain: list[Entry], tail: Entry | None = None, tail_key: int | None = None) -> int:  # fmt: skip
        """Lends ``request_id`` everything ``needs`` says (it :meth:`fits`): its private pages after the ``chain``'s
        shared ones, its slot and, for a ``staged`` prompt, its staging units after the ``chain``'s (the first
        starting with a copy of the cached ``tail``'s rows). ``hashes``: its prompt's whole units, registered as they
        fill; ``tail_key``: the hash of its prompt's tokens after them, registered when the prompt is stored. Returns
        the prompt tokens found cached."""
        allocator, pool, prefixes = self.allocator, self.pool, self.prefixes
        shared = prefixes.shared_pages(chain)
        for _ in range(self.budget.sectors(needs._replace(units=0), pool.count_free_blocks(PAGES))):
            pool.allocate_sector(PAGES)
        allocator.block_table[request_id] = list(shared)
        allocator.allocate_cache_to_request(request_id, 0, (len(shared) + needs.pages) * allocator.tokens_per_page)
        prefixes.share_pages(shared)
        prefixes.acquire(chain)
        units = self.units.take(needs.units)
        blocks = torch.tensor(allocator.block_table[request_id], dtype=torch.int64, device=self.device)
        held = Held(units[0], prompt_end, blocks, len(shared), hit_units=len(chain))
        if staged:
            held.staging = torch.tensor([e.unit for e in chain] + units[1:], dtype=torch.int64, device=self.device)
            held.own_units, held.hashes, held.chain = units[1:], hashes, list(chain)
            held.keep_prompt, held.tail_key = bool(hashes) or tail_key is not None, tail_key
            if tail is not None:
                self.units.copy_rows(tail.unit, units[1], tail.rows)
                prefixes.touch([tail])
            prefixes.expect(hashes[len(chain) :], request_id)
        cached = len(chain) * self.budget.rows + (0 if tail is None else tail.rows)
        prefixes.count_admission(prompt_end, cached)
        self.held[request_id] = held
        return cached

    def register_filled_units(self, request_id: str, staged_end: int) -> None:
        """After a forward that staged the request's prompt up to ``staged_end``: its newly filled whole units become
        cached prefixes (none once one of them was cached by another request: a chain has one donor per unit)."""
        held, prefixes, rows = self.held[request_id], self.prefixes, self.budget.rows
        if not held.keep_prompt:
            return
        for depth in range(len(held.chain), min(staged_end // rows, len(held.hashes))):
            key = held.hashes[depth]
            if key in prefixes:
                held.keep_prompt = False
                self.prefixes.forget(held.hashes, request_id)  # no one should wait for its units now
                return
            unit = int(held.staging[depth])
            parent = held.chain[-1].key if held.chain else None
            held.chain.append(prefixes.register(key, parent, depth, unit, rows))
            held.own_units.remove(unit)

    def end_staging(self, request_id: str) -> None:
        """The prompt is stored: its unregistered staging units go back to the pool, its prefixes' units are no
        longer read by it (cached from now on), and the pages its own packing filled inside its registered units go
        to those entries too."""
        held, prefixes = self.held[request_id], self.prefixes
        self._register_tail(held)
        self.units.give_back(held.own_units)
        prefixes.release_units(held.chain)
        self._attach_pages(held)
        held.staging, held.own_units = None, []

    def _register_tail(self, held: Held) -> None:
        """The prompt's tokens after its whole units become a cached tail (when all its whole units are entries)."""
        depth, rows = len(held.hashes), held.prompt_end % self.budget.rows
        if not held.keep_prompt or held.tail_key is None or len(held.chain) != depth:
            return
        if held.tail_key in self.prefixes:
            return
        unit = int(held.staging[depth])
        parent = held.chain[-1].key if held.chain else None
        self.prefixes.register_tail(held.tail_key, parent, depth, unit, rows)
        held.own_units.remove(unit)

    def _attach_pages(self, held: Held) -> None:
        settings, rows, t = self.settings, self.budget.rows, self.allocator.tokens_per_page
        split = settings.split(held.prompt_end)
        filled = min(split.packed_keys, split.packed_values) // t  # pages the prompt's packing filled
        by_depth: dict[int, list[tuple[int, int]]] = {}
        for page in range(held.shared_pages, filled):
            depth = -(-(settings.sink_tokens + (page + 1) * t) // rows) - 1  # the unit its last token is in
            by_depth.setdefault(depth, []).append((page, int(held.blocks[page])))
        for entry in held.chain[held.hit_units :]:
            self.prefixes.attach_pages(entry, by_depth.get(entry.depth, []))

    def free(self, request_id: str) -> None:
        """Takes back everything ``request_id`` holds: its slot, its staged prompt, its pages (a shared page stays
        while anyone else holds it)."""
        held = self.held.pop(request_id, None)
        prefixes = self.prefixes
        if held is not None:
            if held.staging is not None:  # freed mid-prompt (cancelled, failed)
                prefixes.release_units(held.chain)
                self.units.give_back(held.own_units)
            self.prefixes.forget(held.hashes, request_id)
            self.units.give_back([held.slot])
        table = self.allocator.block_table.pop(request_id, [])
        self.pool.free_blocks(PAGES, prefixes.release_pages(table))
