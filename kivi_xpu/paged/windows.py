"""The exact tokens of continuous batching, in **units** of the pool (:mod:`.budget`): windows and prompt staging.

A unit holds ``W`` exact tokens, keys and values, of every layer: ``[layers, 2, H, W, D]`` in the model dtype, one
after another in the cache's byte tensor, so a layer's keys of all units are one strided view ``[units, H, W, D]``
(what ``paged_decode_attention`` reads as its windows, a unit id as the slot).

**The window.** A running request holds one unit, its slot. By position ``p`` (``S`` sinks, ``R`` window, ``n``
tokens held; ``qk(n)`` / ``qv(n)`` the packed counts of the rule's :class:`~kivi_xpu.algorithm.TokenSplit`, so a
request stores exactly what its own :class:`~kivi_xpu.KiviCache` would):

* ``p < S``: the sinks, exact, rows ``[0, S)`` of its slot;
* packed: keys ``[S, S + qk(n))``, values ``[S, S + qv(n))``, in its pages (:mod:`.pages`);
* the rest, exact, in its slot: keys from row ``S`` (the window empties when a block of ``R`` is packed), values
  from row ``S + qv(n) - base`` where ``base`` is ``qv`` rounded down to a multiple of the step ``G`` (the smallest
  key group size) when the rows were last moved. Values leave one per step, so their rows move down only once every
  ``G`` steps (``R`` rows each time), and a decode step's tail is a view of the slot.

**The staging.** While the scheduler feeds a prompt in several chunks, its exact states so far wait in more units
(token ``p`` in unit ``p // W``, row ``p % W``), so that every chunk attends the exact states of every earlier
prompt token, as ``KiviCache``'s one-shot prefill does; the last chunk stores the whole prompt as that prefill would
and the staging units go back to the pool.
"""

from __future__ import annotations

import torch

from ..algorithm import TokenSplit
from .budget import UNITS


class ExactUnits:
    """The exact units of the pool (see the module docstring): lent by transformers' ``CachePool`` (index
    :data:`~kivi_xpu.paged.budget.UNITS`), a sector at a time; or, with ``pool`` ``None``, by a lender elsewhere
    (the vLLM plugin's scheduler, :mod:`kivi_xpu.vllm.ledger`), which calls :meth:`reset` on the units it lends."""

    def __init__(self, budget, cache_tensor: torch.Tensor, pool, layers: list[int], heads: int, head_dim: int,
                 dtype):  # fmt: skip
        count = cache_tensor.numel() // budget.unit_bytes
        units = cache_tensor[: count * budget.unit_bytes].view(dtype).view(count, len(layers), 2, heads, budget.rows,
                                                                           head_dim)  # fmt: skip
        self._start(budget.rows, budget.block.window_step, pool)
        for i, layer in enumerate(layers):
            self.add_layer(layer, units[:, i])
        self.units_per_sector = budget.units_per_sector
        if pool is not None:
            pool.set_blocks_per_sector(UNITS, self.units_per_sector)

    @classmethod
    def in_blocks(cls, rows: int, step: int) -> ExactUnits:
        """Units that live in another engine's blocks (vLLM's, :mod:`kivi_xpu.vllm.requests`), lent by a lender
        elsewhere; each layer's units are added as its blocks appear (:meth:`add_layer`)."""
        units = cls.__new__(cls)
        units._start(rows, step, None)
        return units

    def _start(self, rows: int, step: int, pool) -> None:
        self.rows, self.step, self.pool = rows, step, pool
        self._both: dict[int, torch.Tensor] = {}  # layer -> [units, 2, H, W, D] (a strided view)
        self.keys: dict[int, torch.Tensor] = {}  # layer -> [units, H, W, D] views
        self.values: dict[int, torch.Tensor] = {}
        self.value_base: dict[int, list[int]] = {}  # layer -> base of each slot's value rows

    def add_layer(self, layer: int, both: torch.Tensor) -> None:
        """Layer ``layer``'s units: ``both [units, 2, H, W, D]``, keys then values (a view of where they live)."""
        self._both[layer], self.keys[layer], self.values[layer] = both, both[:, 0], both[:, 1]
        self.value_base[layer] = [0] * both.shape[0]

    # ------------------------------------------------------------------ lending

    def take(self, count: int) -> list[int]:
        """``count`` units (the caller checked that they fit: :meth:`~kivi_xpu.paged.budget.PageBudget.sectors`)."""
        missing = count - self.pool.count_free_blocks(UNITS)
        for _ in range(-(-max(0, missing) // self.units_per_sector)):
            self.pool.allocate_sector(UNITS)
        units = self.pool.get_free_blocks(UNITS, count)
        self.reset(units)
        return units

    def reset(self, units: list[int]) -> None:
        """Units lent anew: their value rows start at row 0 again."""
        for bases in self.value_base.values():
            for unit in units:
                bases[unit] = 0

    def give_back(self, units: list[int]) -> None:
        self.pool.free_blocks(UNITS, units)

    def copy_rows(self, source: int, target: int, rows: int) -> None:
        """Copies the first ``rows`` exact tokens of unit ``source`` (every layer, keys and values) into ``target``."""
        for both in self._both.values():
            both[target, :, :, :rows] = both[source, :, :, :rows]

    # ------------------------------------------------------------------ window

    def value_base_for(self, split: TokenSplit) -> int:
        """Where the value rows of a request holding ``split`` start once moved: ``qv`` rounded down to the window's
        step (:attr:`~kivi_xpu.paged.pages.BlockLayout.window_step`)."""
        qv = split.packed_values
        return qv - qv % self.step

    def move_values(self, layer: int, slot: int, split: TokenSplit) -> None:
        """Moves a slot's exact value rows down so that they start at :meth:`value_base_for` ``(split)``."""
        bases, base = self.value_base[layer], self.value_base_for(split)
        old = bases[slot]
        if base == old:
            return
        s, qv, exact = split.sink_tokens, split.packed_values, split.value_window
        rows = self.values[layer][slot]
        if exact > 0:
            src = rows[:, s + qv - old : s + qv - old + exact].clone()
            rows[:, s + qv - base : s + qv - base + exact] = src
        bases[slot] = base

    # ------------------------------------------------------------------ staging

    def _positions(self, units: torch.Tensor, start: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The units and rows of prompt tokens ``[start, start + count)`` staged in ``units`` (int64, in order)."""
        tokens = torch.arange(start, start + count, device=units.device)
        return units[tokens // self.rows], tokens % self.rows

    def stage(self, units: torch.Tensor, layer: int, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Writes prompt tokens ``[start, start + m)`` (``keys`` / ``values [1, H, m, D]``) into staging ``units``."""
        at, rows = self._positions(units, start, keys.shape[2])
        self.keys[layer][at, :, rows] = keys[0].transpose(0, 1)
        self.values[layer][at, :, rows] = values[0].transpose(0, 1)

    def staged(self, units: torch.Tensor, layer: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``count`` staged prompt tokens: keys, values ``[1, H, count, D]`` (copies)."""
        at, rows = self._positions(units, 0, count)
        keys, values = self.keys[layer][at, :, rows], self.values[layer][at, :, rows]  # [count, H, D]
        return keys.transpose(0, 1).unsqueeze(0), values.transpose(0, 1).unsqueeze(0)
