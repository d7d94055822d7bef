"""The named parts of the attention ops' flat arguments: a kind's operands of ``decode_attention``
(:class:`KindOperands`), both kinds with the backend that reads them (:class:`DecodeInputs`, what a cache layer hands
to the attention call) and the columns of ``paged_decode_attention``'s ``requests`` table (:class:`RequestColumns`).

The ops' schemas are flat (one argument per tensor or number, as ``torch.library`` wants them); these give the
parts names, so that no caller, check or kernel wrapper counts positions itself.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class KindOperands(NamedTuple):
    """One kind (keys or values) of a ``decode_attention`` call, its tokens in position order: ``sinks [B, Hkv, S, D]``
    exact, the first ``count`` tokens of the packed ``codes``/``scales``/``zeros`` (``group`` size, ``bits``), then
    ``tail [B, Hkv, T, D]`` exact; ``rotation``: ``None``, or the ``Q [D, D]`` float32 whose ``x @ Q`` the codes hold
    (:mod:`kivi_xpu.rotation`). The op takes the first eight in this order, the rotations last (``packed(...)``)."""

    sinks: torch.Tensor
    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    count: int
    group: int
    bits: int
    tail: torch.Tensor
    rotation: torch.Tensor | None = None

    # These two build the tuple with tuple.__new__ on the fields in order, half the cost of the named constructor:
    # every layer takes them at every decode step.
    def with_tail(self, tail: torch.Tensor | None) -> KindOperands:
        """The same operands with another ``tail``."""
        return _new_tuple(KindOperands, (*self[:7], tail, self[8]))

    def with_count(self, count: int, rotation: torch.Tensor | None) -> KindOperands:
        """The same operands with ``count`` packed tokens and ``rotation``."""
        return _new_tuple(KindOperands, (*self[:4], count, self[5], self[6], self[7], rotation))


_new_tuple = tuple.__new__


class DecodeInputs(NamedTuple):
    """What one layer's ``update`` hands to the attention call that follows it: keys, values and the name of
    the backend whose kernels read the packed codes. (A named tuple: built three times per layer and step.)"""

    keys: KindOperands  # sinks, packed codes/scales/zeros (whole buffers), count, group, bits, tail
    values: KindOperands
    backend: str

    def with_tails(self, key_tail: torch.Tensor | None, value_tail: torch.Tensor | None) -> DecodeInputs:
        """The same inputs with other tails (``None`` while the step waits in the hand-over's slot)."""
        return DecodeInputs(self.keys.with_tail(key_tail), self.values.with_tail(value_tail), self.backend)


def decode_args(keys: KindOperands, values: KindOperands, mask, scaling: float, softcap: float) -> tuple:
    """The flat arguments of ``decode_attention`` after ``query``, the inverse of :func:`split_decode_args`."""
    return (*keys[:8], *values[:8], mask, scaling, softcap, keys.rotation, values.rotation)


def split_decode_args(args: tuple) -> tuple:
    """``decode_attention``'s arguments after ``query`` -> ``(keys, values, mask, scaling, softcap)`` with ``keys``
    and ``values`` as :class:`KindOperands` (the op's schema is flat; its parts have names here)."""
    key_rotation, value_rotation = (*args[19:21], None, None)[:2]
    keys, values = KindOperands(*args[:8], key_rotation), KindOperands(*args[8:16], value_rotation)
    return keys, values, *args[16:19]


class RequestColumns(NamedTuple):
    """The columns of ``paged_decode_attention``'s ``requests`` table (int64, one row per request; the C++ side names
    them in the same order in csrc/cpu/paged_requests.h): the request's window ``slot``; its ``sinks`` exact rows at
    the start of the slot; its ``key_count`` / ``value_count`` packed tokens (in its pages); the slot rows where its
    exact key / value tail starts (``key_tail_row`` / ``value_tail_row``); its ``length`` in tokens.
    ``RequestColumns(*requests.unbind(1))`` names the columns of the whole table, ``RequestColumns(*row)`` one row's
    values."""

    slot: torch.Tensor
    sinks: torch.Tensor
    key_count: torch.Tensor
    key_tail_row: torch.Tensor
    value_count: torch.Tensor
    value_tail_row: torch.Tensor
    length: torch.Tensor


PAGED_REQUEST_COLUMNS = RequestColumns._fields
