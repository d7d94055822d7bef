"""Exact units carved from vLLM's block pool: unit ``u`` is blocks ``[u k, u k + k)`` of every layer (``k`` the
plan's ``unit_blocks``), so a layer's units are one strided view of its KV tensor
(:meth:`~kivi_xpu.vllm.requests.WorkerRequests.add_layer`), and a unit counts against vLLM's free blocks while a
request holds it.

Units are carved from the top of the block ids down and given back to the tail of vLLM's free queue, while vLLM
lends pages from its head: the high blocks stay free for units as long as pages leave them (unit 0 is never lent:
it holds vLLM's null block). A cached prefix's units stay in the free queue, lent last, and are forgotten when vLLM
lends one of their blocks (:meth:`~kivi_xpu.vllm.ledger.UnitLedger.forget_block`), as vLLM's own cached blocks are.
"""

from __future__ import annotations


class BlockUnits:
    """The units of ``pool`` (vLLM's ``BlockPool``: its ``blocks``, ``free_block_queue`` and
    ``_maybe_evict_cached_block``), ``unit_blocks`` blocks each."""

    def __init__(self, pool, unit_blocks: int):
        self.pool, self.unit_blocks = pool, unit_blocks
        self.count = len(pool.blocks) // unit_blocks

    def _blocks(self, unit: int) -> list:
        return self.pool.blocks[unit * self.unit_blocks : (unit + 1) * self.unit_blocks]

    def _is_free(self, unit: int) -> bool:
        return all(block.ref_cnt == 0 and not block.is_null for block in self._blocks(unit))

    def count_free(self) -> int:
        """Units whose blocks are all free (cached blocks that no request holds count as free)."""
        return sum(self._is_free(unit) for unit in range(1, self.count))

    def take(self, count: int, last=(), avoid=frozenset()) -> list[int] | None:
        """``count`` units whose blocks leave vLLM's free queue (what they held forgotten: the pool's eviction hook
        tells the ledger), or ``None`` (nothing taken) when fewer are free; units in ``last`` only when no others
        are (a cached prefix's), units in ``avoid`` never."""
        units = self._free_units(count, set(last) | avoid)
        if len(units) < count:
            units += self._free_units(count - len(units), avoid, among=set(last))
        if len(units) < count:
            return None
        for unit in units:
            for block in self._blocks(unit):
                self.pool._maybe_evict_cached_block(block)
        self.hold(units)
        return units

    def _free_units(self, count: int, skip, among=None) -> list[int]:
        candidates = range(self.count - 1, 0, -1) if among is None else sorted(among, reverse=True)
        units = []
        for unit in candidates:
            if len(units) == count:
                break
            if unit not in skip and self._is_free(unit):
                units.append(unit)
        return units

    def hold(self, units: list[int]) -> None:
        """Takes free units' blocks out of vLLM's free queue."""
        for unit in units:
            for block in self._blocks(unit):
                if block.ref_cnt != 0 or block.is_null:
                    raise RuntimeError(f"KIVI exact units: block {block.block_id} of unit {unit} is not free")
                self.pool.free_block_queue.remove(block)
                block.ref_cnt = 1

    def give_back(self, units: list[int]) -> None:
        """Returns units' blocks to the tail of vLLM's free queue."""
        blocks = [block for unit in units for block in self._blocks(unit)]
        for block in blocks:
            block.ref_cnt = 0
        self.pool.free_block_queue.append_n(blocks)
