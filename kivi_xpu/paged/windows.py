"""The exact tokens of continuous batching: each running request's sinks and residual window, in a slot.

A request holds its tokens in three places, by position ``p`` (``S`` sinks, ``R`` window, ``n`` tokens held;
the counts are :class:`~kivi_xpu.KiviSettings`' ``quantized_key_count`` / ``quantized_value_count``, so a request
stores exactly what its own :class:`~kivi_xpu.KiviCache` would):

* ``p < S``: the sinks, exact, rows ``[0, S)`` of its slot;
* packed: keys ``[S, S + qk(n))``, values ``[S, S + qv(n))``, in its pages (:mod:`.pages`);
* the rest, exact, in its slot: keys from row ``S`` (the window empties when a block of ``R`` is packed), values
  from row ``S + qv(n) - base`` where ``base`` is ``qv`` rounded down to a multiple of ``G`` when the rows were
  last moved. Values leave one per step, so their rows move down only once every ``G`` steps (``R`` rows each
  time), and a decode step's tail is a view of the slot.

A slot of a layer: keys ``[H, S + R, D]``, values ``[H, S + R + G, D]`` in the model dtype. Slots are taken at
admission and returned when the request finishes, so the number of slots bounds the requests in flight.
"""

from __future__ import annotations

import torch

from ..algorithm import KiviSettings


class WindowSlots:
    """The exact-token slots of every layer (see the module docstring)."""

    def __init__(self, settings: KiviSettings, num_slots: int, layers: list[int], heads: int, head_dim: int, dtype,
                 device):  # fmt: skip
        s, r, g = settings.sink_tokens, settings.residual_length, settings.key_group_size
        self.settings, self.num_slots, self.step_rows = settings, num_slots, g
        self.key_rows, self.value_rows = s + r, s + r + g
        self.keys = {layer: torch.zeros(num_slots, heads, self.key_rows, head_dim, dtype=dtype, device=device)
                     for layer in layers}  # fmt: skip
        self.values = {layer: torch.zeros(num_slots, heads, self.value_rows, head_dim, dtype=dtype, device=device)
                       for layer in layers}  # fmt: skip
        self.value_base = {layer: [0] * num_slots for layer in layers}  # base of each slot's value rows
        self.free = list(range(num_slots - 1, -1, -1))

    @staticmethod
    def bytes_per_slot(settings: KiviSettings, num_layers: int, heads: int, head_dim: int, dtype) -> int:
        """Bytes of one slot over all layers."""
        s, r, g = settings.sink_tokens, settings.residual_length, settings.key_group_size
        return num_layers * heads * head_dim * dtype.itemsize * ((s + r) + (s + r + g))

    @property
    def nbytes(self) -> int:
        tensors = [*self.keys.values(), *self.values.values()]
        return sum(t.numel() * t.element_size() for t in tensors)

    def take(self) -> int:
        slot = self.free.pop()
        for bases in self.value_base.values():
            bases[slot] = 0
        return slot

    def give_back(self, slot: int) -> None:
        self.free.append(slot)

    def value_base_for(self, length: int) -> int:
        """Where the value rows of a request of ``length`` tokens start once moved: ``qv`` rounded down to ``G``."""
        qv = self.settings.quantized_value_count(length)
        return qv - qv % self.step_rows

    def move_values(self, layer: int, slot: int, length: int) -> None:
        """Moves a slot's exact value rows down so that they start at :meth:`value_base_for` ``(length)``."""
        bases, base = self.value_base[layer], self.value_base_for(length)
        old = bases[slot]
        if base == old:
            return
        s, qv = self.settings.sink_tokens, self.settings.quantized_value_count(length)
        exact = length - s - qv  # exact value tokens after the sinks
        rows = self.values[layer][slot]
        if exact > 0:
            src = rows[:, s + qv - old : s + qv - old + exact].clone()
            rows[:, s + qv - base : s + qv - base + exact] = src
        bases[slot] = base
