"""What each request in flight holds, in one owner (as vLLM's ``BlockPool``): :class:`Holdings` lends a request its
pages (transformers' block table, :mod:`.pages`) and its exact units (its slot and, while its prompt is split, its
staging: :mod:`.windows`) from the one pool of sectors (:mod:`.budget`), and takes all of them back in
:meth:`Holdings.free`."""

from __future__ import annotations

from typing import NamedTuple

import torch

from .budget import PAGES, UNITS, PageBudget, RequestNeeds
from .pages import KiviPageAllocator
from .windows import ExactUnits


class Held(NamedTuple):
    """What one admitted request holds besides its pages (transformers' block table): its window unit, its prompt's
    length, and while its prompt is split the units of its exact prompt (int64, in order)."""

    slot: int
    prompt_end: int
    staging: torch.Tensor | None

    def staged_units(self) -> list[int]:
        return [] if self.staging is None else self.staging.tolist()


class Holdings:
    """The pages and units of every request in flight (see the module docstring)."""

    def __init__(self, budget: PageBudget, allocator: KiviPageAllocator, units: ExactUnits, pool, device):
        self.budget, self.allocator, self.units, self.pool, self.device = budget, allocator, units, pool, device
        self.held: dict[str, Held] = {}
        self._request_of_first_block: dict[int, str] = {}  # a request's first page names it in the batch

    def __len__(self) -> int:
        return len(self.held)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.held

    def fits(self, needs: RequestNeeds) -> bool:
        """Whether the free sectors (and the free blocks of sectors lent already) hold ``needs``."""
        pool = self.pool
        sectors = self.budget.sectors(needs, pool.count_free_blocks(PAGES), pool.count_free_blocks(UNITS))
        return sectors <= pool.num_free_sectors

    def take(self, request_id: str, needs: RequestNeeds, prompt_end: int, split: bool) -> None:
        """Lends ``request_id`` everything ``needs`` says (it :meth:`fits`): its pages, its slot and, for a ``split``
        prompt, its staging units."""
        allocator, pool = self.allocator, self.pool
        for _ in range(self.budget.sectors(needs._replace(units=0), pool.count_free_blocks(PAGES))):
            pool.allocate_sector(PAGES)
        allocator.allocate_cache_to_request(request_id, 0, needs.pages * allocator.tokens_per_page)
        units = self.units.take(needs.units)
        staging = torch.tensor(units[1:], dtype=torch.int64, device=self.device) if split else None
        self.held[request_id] = Held(units[0], prompt_end, staging)
        self._request_of_first_block[allocator.block_table[request_id][0]] = request_id

    def free(self, request_id: str) -> None:
        """Takes back everything ``request_id`` holds: its pages, its slot, its staged prompt."""
        held = self.held.pop(request_id, None)
        if held is not None:
            self._request_of_first_block.pop(self.allocator.block_table[request_id][0], None)
            self.units.give_back([held.slot, *held.staged_units()])
        self.allocator.free_blocks(request_id, no_cache=True)

    def end_staging(self, request_id: str) -> None:
        """The prompt is stored: its staging units go back to the pool."""
        held = self.held[request_id]
        self.units.give_back(held.staged_units())
        self.held[request_id] = held._replace(staging=None)

    def of_first_block(self, block: int) -> tuple[str, Held]:
        """The request whose first page is ``block``, and what it holds."""
        request_id = self._request_of_first_block.get(block)
        if request_id is None:
            raise RuntimeError(
                "KiviPagedCache: a request reached the model without a slot (it was admitted by another cache?)"
            )
        return request_id, self.held[request_id]
