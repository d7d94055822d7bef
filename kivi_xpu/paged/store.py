"""What one layer of a continuous-batching forward stores, and what its attention then reads.

:class:`PageWriter` writes each request's new tokens as its own :class:`~kivi_xpu.KiviCache` would (same counts,
same codes) into its pages (:mod:`.pages`) and its exact units (:mod:`.windows`), and returns the layer's steps
(:class:`RequestStep`, :class:`DecodeRows`) that the ``"kivi_paged"`` attention (:mod:`.attention`) reads. Three
kinds of request step:

* **decode rows** (one token after full sinks, the prompt stored): all at once, one indexed copy per kind into the
  windows and one ``paged_decode_attention`` call reading every request's pages in place;
* **prompt chunks**: the exact prompt so far (staged chunks and this one) for SDPA, causal; the last chunk stores
  the whole prompt as ``KiviCache``'s prefill stores it;
* anything else (a decode row before the sinks are full, a multi-token append after the prompt): the general
  append, attended as ``KiviCache`` attends it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..algorithm import KiviSettings, TokenSplit
from ..codec import KeyCodec, ValueCodec
from ..ops.operands import KindOperands
from ..stream import KeyStream, KindStream, ValueStream
from .pages import LayerPages
from .windows import ExactUnits


class Request(NamedTuple):
    """One request of a forward: query rows ``[q_start, q_start + q_len)`` after ``past`` tokens held."""

    request_id: str
    slot: int  # its window unit
    past: int
    q_start: int
    q_len: int
    blocks: torch.Tensor  # int64 block ids of its pages 0, 1, ...
    prompt_end: int  # its prompt's length: tokens before it are prompt tokens
    staging: torch.Tensor | None  # int64 units of its exact prompt while the prompt is staged
    split: TokenSplit  # how its ``past`` tokens split (the rule): sinks, packed, window
    shared_pages: int = 0  # its first pages are a cached prefix's: read, never written
    keep_prompt: bool = False  # its whole prompt is staged (its units become cached prefixes)
    replayed: bool = False  # one token of an answer computed again (after a preemption): stored and attended alone

    @property
    def in_prompt(self) -> bool:
        return self.past < self.prompt_end

    @property
    def decode_row(self) -> bool:
        """One token after full sinks and a stored prompt: stored and attended with every other decode row at once
        (:class:`DecodePlan`); a replayed token is not (its request has other rows in the forward)."""
        return self.q_len == 1 and self.split.sinks_full and not self.in_prompt and not self.replayed


class RequestStep(NamedTuple):
    """One request's share of a layer's attention: query rows ``[q_start, q_start + q_len)``. ``prompt``: ``keys`` /
    ``values`` are the exact prompt states so far ``[1, H, n, D]`` and the rows their last ``q_len`` (causal);
    otherwise :class:`~kivi_xpu.ops.checks.KindOperands` (sinks, packed history, exact tail)."""

    q_start: int
    q_len: int
    keys: KindOperands | torch.Tensor
    values: KindOperands | torch.Tensor
    prompt: bool


class DecodeRows(NamedTuple):
    """The decode rows of a layer's forward, for one ``paged_decode_attention`` call: query rows ``q_index`` of the
    flat batch; ``args``: the op's arguments after ``query``."""

    q_index: torch.Tensor
    args: tuple


class DecodePlan(NamedTuple):
    """What every layer's store and attention of a forward's decode rows need, worked out once per forward (all
    layers hold the same counts)."""

    requests: list[Request]
    bases: list[int]  # where each request's value rows start in its slot (after move_values)
    q_index: torch.Tensor  # [N] their query rows in the flat batch
    slots: torch.Tensor  # [N]
    window_rows: torch.Tensor  # [2, N] the new token's key row and value row in the slot
    table: torch.Tensor  # [N, pages] block table
    table_rows: torch.Tensor  # [N, 7] paged_decode_attention's requests table
    leaving: torch.Tensor | None  # [4, n] value tokens leaving: slot, window row, block, page row
    key_blocks: list[tuple[Request, int, int]]  # (request, packed keys before, keys leaving now)

    @classmethod
    def of(cls, decode: list[Request], settings: KiviSettings, tokens: int, units: ExactUnits, device) -> DecodePlan:
        """The plan of ``decode`` (requests of one token each) on pages of ``tokens`` tokens."""
        s, t = settings.sink_tokens, tokens
        table = torch.zeros(len(decode), max(r.blocks.numel() for r in decode), dtype=torch.int64)
        rows, bases, window_rows, leaving, key_blocks = [], [], [], [], []
        for i, r in enumerate(decode):
            table[i, : r.blocks.numel()] = r.blocks
            qk0, qv0 = r.split.packed_keys, r.split.packed_values
            after = settings.split(r.past + 1)
            base = units.value_base_for(r.split)  # where move_values puts the slot's value rows
            bases.append(base)
            window_rows.append((r.past - qk0, r.past - base))  # the new token's key and value rows
            rows.append((r.slot, s, qk0, s, qv0, s + qv0 - base, after.length))
            shared = r.shared_pages * t  # packed positions a cached prefix's pages hold already
            if after.packed_values > qv0 >= shared:  # the oldest exact value token leaves
                leaving.append((r.slot, s + qv0 - base, int(r.blocks[qv0 // t]), qv0 % t))
            qk1 = after.packed_keys
            if qk1 > max(qk0, shared):  # the key window is full: its block leaves it (into its private pages)
                key_blocks.append((r, qk0, qk1 - qk0))
        return cls(
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


class PageWriter:
    """Stores a layer's new tokens into pages of ``tokens`` tokens and units (see the module docstring), through the
    kinds' codecs (the codes are those a ``KiviCache`` of the same settings writes). ``rotations``: the codecs'
    rotations on the cache's device (``None`` or ``Q [D, D]``), which attention reads."""

    def __init__(self, settings: KiviSettings, tokens: int, units: ExactUnits, keys: KeyCodec, values: ValueCodec,
                 rotations: tuple):  # fmt: skip
        self.settings, self.tokens, self.units = settings, tokens, units
        self.key_codec, self.value_codec = keys, values
        self.key_rotation, self.value_rotation = rotations

    # ------------------------------------------------------------ decode rows

    def decode_rows(self, plan: DecodePlan, layer: int, pages: LayerPages, key_states, value_states) -> DecodeRows:
        """Every decode row's update of one layer at once: the new tokens join their slots' windows (one indexed
        copy per kind), the value tokens leaving the windows are quantized into their pages (one call), a key block
        that fills its window is packed (per request, once in R steps)."""
        settings, s, units = self.settings, self.settings.sink_tokens, self.units
        key_windows, value_windows = units.keys[layer], units.values[layer]
        bases_now = units.value_base[layer]
        for r, base in zip(plan.requests, plan.bases, strict=True):
            if bases_now[r.slot] != base:  # once in G steps per request: the value rows move down
                units.move_values(layer, r.slot, r.split)
        key_windows[plan.slots, :, plan.window_rows[0]] = key_states[0, :, plan.q_index].transpose(0, 1)
        value_windows[plan.slots, :, plan.window_rows[1]] = value_states[0, :, plan.q_index].transpose(0, 1)
        if plan.leaving is not None:
            self._pack_leaving_values(pages, value_windows, plan.leaving)
        for r, qk0, count in plan.key_blocks:
            private = WritablePages(r.blocks, r.shared_pages * self.tokens)  # a block may straddle them
            self._pack_keys(pages, private, qk0, key_windows[r.slot, :, s : s + count].unsqueeze(0))
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
        slots, window_rows, blocks, page_rows = leaving
        x = value_windows[slots, :, window_rows].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        heads, n = x.shape[1:3]
        codes = pages.value_codes.new_empty(1, heads, n, pages.value_codes.shape[3])
        scales = pages.value_scales.new_empty(1, heads, n, pages.value_scales.shape[3])
        zeros = torch.empty_like(scales)
        self.value_codec.quantize_into(x.contiguous(), codes, scales, zeros, 0)
        for section, part in ((pages.value_codes, codes), (pages.value_scales, scales), (pages.value_zeros, zeros)):
            section[blocks, :, page_rows] = part[0].transpose(0, 1)

    def request_step(self, layer: int, pages: LayerPages, request: Request, key_states, value_states) -> RequestStep:
        """A request that is not a decode row: a chunk of its prompt (:meth:`prompt_chunk`) or any other append
        (:meth:`append`)."""
        store = self.prompt_chunk if request.in_prompt else self.append
        return store(layer, pages, request, key_states, value_states)

    # ---------------------------------------------------------- prompt chunks

    def prompt_chunk(self, layer: int, pages: LayerPages, request: Request, key_states, value_states) -> RequestStep:
        """A chunk of a request's prompt: attention reads the exact prompt so far; a chunk before the last is staged,
        the last stores the whole prompt as ``KiviCache``'s prefill of ``prompt_end`` tokens does."""
        past, m, q_start = request.past, request.q_len, request.q_start
        new_k, new_v = key_states[:, :, q_start : q_start + m], value_states[:, :, q_start : q_start + m]
        if past + m > request.prompt_end:
            raise RuntimeError(f"KiviPagedCache: a chunk runs past its prompt ({past} + {m} > {request.prompt_end})")
        keys, values = new_k, new_v
        if past:
            staged_keys, staged_values = self.units.staged(request.staging, layer, past)
            keys, values = torch.cat([staged_keys, new_k], dim=2), torch.cat([staged_values, new_v], dim=2)
        last = past + m == request.prompt_end
        if not last or request.keep_prompt:
            self.units.stage(request.staging, layer, past, new_k, new_v)
        if last:
            self._append(layer, pages, request, self.settings.split(0), keys, values)
        return RequestStep(q_start, m, keys, values, True)

    # ---------------------------------------------------------- other appends

    def append(self, layer: int, pages: LayerPages, request: Request, key_states, value_states) -> RequestStep:
        """Any other request's update of one layer (a token before the sinks are full, a multi-token append after
        the prompt): returns what its attention reads."""
        q_start, m, blocks = request.q_start, request.q_len, request.blocks
        new_k = key_states[:, :, q_start : q_start + m]
        new_v = value_states[:, :, q_start : q_start + m]
        (key_tail, key_sinks), (value_tail, value_sinks) = self._append(layer, pages, request, request.split, new_k,
                                                                        new_v)  # fmt: skip
        t, k, v = self.tokens, self.key_codec, self.value_codec
        key_count, value_count = request.split.packed_keys, request.split.packed_values
        key_parts, value_parts = pages.keys(blocks[: -(-key_count // t)]), pages.values(blocks[: -(-value_count // t)])
        keys = KindOperands(key_sinks, *key_parts, key_count, k.group, k.bits, key_tail, self.key_rotation)
        values = KindOperands(value_sinks, *value_parts, value_count, v.group, v.bits, value_tail, self.value_rotation)
        return RequestStep(q_start, m, keys, values, False)

    def _append(self, layer: int, pages: LayerPages, request: Request, before: TokenSplit, new_k, new_v):
        """Appends ``new_k`` / ``new_v [1, H, m, D]`` to ``request`` after the tokens split as ``before``: sinks,
        packed tokens and window as :mod:`.windows` lays them out (its shared pages are not written: they hold these
        bytes already). Returns per kind the exact tail (window rows, then the new tokens: the tokens leaving now are
        still in it, as attention reads them) and the sinks held before."""
        units, s, slot = self.units, self.settings.sink_tokens, request.slot
        blocks = WritablePages(request.blocks, request.shared_pages * self.tokens)
        after = self.settings.split(before.length + new_k.shape[2])
        units.move_values(layer, slot, before)
        base, base_after = units.value_base[layer][slot], units.value_base_for(after)
        keys = self._append_kind(KeyStream, self._pack_keys, pages, blocks, units.keys[layer][slot], (s, s), before,
                                 after, new_k)  # fmt: skip
        value_rows = (s + before.packed_values - base, s + after.packed_values - base_after)
        values = self._append_kind(ValueStream, self._pack_values, pages, blocks, units.values[layer][slot],
                                   value_rows, before, after, new_v)  # fmt: skip
        units.value_base[layer][slot] = base_after
        return keys, values

    @staticmethod
    def _append_kind(kind: type[KindStream], pack, pages: LayerPages, blocks, rows: torch.Tensor, window_rows: tuple,
                     before: TokenSplit, after: TokenSplit, new: torch.Tensor) -> tuple:  # fmt: skip
        """One kind of :meth:`_append`, by the stream's split (``kind.packed_in``) and ``pack``: ``rows [H, W, D]``
        is the kind's part of the slot, whose exact tokens after the packed ones start at row ``window_rows[0]``
        before the append and ``window_rows[1]`` after it. Returns (tail ``[1, H, n, D]``, sinks held before)."""
        held_sinks, packed_before, packed_after = before.sinks, kind.packed_in(before), kind.packed_in(after)
        first, first_after = window_rows
        # Exact tokens after the packed ones: window rows then the new tokens (sinks-bound ones first).
        tail = torch.cat([rows[:, first : first + before.length - held_sinks - packed_before].unsqueeze(0), new], dim=2)
        sinks = rows[:, :held_sinks].unsqueeze(0)
        to_sinks = after.sinks - held_sinks
        if to_sinks > 0:
            rows[:, held_sinks : held_sinks + to_sinks] = new[0, :, :to_sinks]
        start, leaving = max(0, before.sink_tokens - before.length), packed_after - packed_before
        if leaving:  # (tail index `start` is position S: the tail starts at S + packed or at the length held)
            pack(pages, blocks, packed_before, tail[:, :, start : start + leaving])
        rows[:, first_after : first_after + after.length - after.sinks - packed_after] = tail[0, :, start + leaving :]
        return tail, sinks

    def flush(self, layer: int, pages: LayerPages, slot: int, blocks: torch.Tensor, length: int, shared_pages: int,
              upto: int) -> None:  # fmt: skip
        """Packs the exact tokens of the window of ``slot`` (a request holding ``length`` tokens, its pages
        ``blocks``) at packed positions up to ``upto`` (whole pages) into their pages, as its later steps would have
        (not into its first ``shared_pages``, a cached prefix's)."""
        split, s = self.settings.split(length), self.settings.sink_tokens
        writable = WritablePages(blocks, shared_pages * self.tokens)
        qk, qv = split.packed_keys, split.packed_values
        if upto > qk:  # key rows start at S: position S + qk
            self._pack_keys(pages, writable, qk, self.units.keys[layer][slot][:, s : s + upto - qk].unsqueeze(0))
        if upto > qv:  # value rows start at S + qv - base
            first = s + qv - self.units.value_base[layer][slot]
            rows = self.units.values[layer][slot][:, first : first + upto - qv]
            self._pack_values(pages, writable, qv, rows.unsqueeze(0))

    def _pack_keys(self, pages: LayerPages, blocks: WritablePages, start: int, keys) -> None:
        """Quantizes ``keys [1, H, n, D]`` (packed positions ``[start, start + n)``, whole pages) into their pages,
        except into shared ones."""
        start, keys = blocks.writable_part(start, keys)
        if not keys.shape[2]:
            return
        t, blocks = self.tokens, blocks.blocks
        codes, scales, zeros = self.key_codec.quantize(keys)
        pages.store_keys(blocks[start // t : (start + keys.shape[2]) // t], codes, scales, zeros)

    def _pack_values(self, pages: LayerPages, blocks: WritablePages, start: int, values) -> None:
        """Quantizes ``values [1, H, n, D]`` (packed positions ``[start, start + n)``) into their pages' rows, except
        into shared pages."""
        start, values = blocks.writable_part(start, values)
        t, done, n, blocks = self.tokens, 0, values.shape[2], blocks.blocks
        while done < n:
            position = start + done
            page, row = int(blocks[position // t]), position % t
            count = min(n - done, t - row)
            self.value_codec.quantize_into(
                values[:, :, done : done + count],
                pages.value_codes[page : page + 1],
                pages.value_scales[page : page + 1],
                pages.value_zeros[page : page + 1],
                row,
            )
            done += count


class WritablePages(NamedTuple):
    """A request's pages as the packers see them: ``blocks`` (int64), of which packed positions before ``shared`` are
    a cached prefix's pages, read and never written."""

    blocks: torch.Tensor
    shared: int

    def writable_part(self, start: int, states: torch.Tensor) -> tuple[int, torch.Tensor]:
        """Packed positions ``[start, start + n)`` of ``states [1, H, n, D]`` less those in shared pages: the first
        position to write and the states to write there."""
        skip = min(states.shape[2], max(0, self.shared - start))
        return start + skip, states[:, :, skip:]
