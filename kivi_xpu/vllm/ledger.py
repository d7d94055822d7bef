"""Who holds which exact unit, decided once per step in vLLM's scheduler and sent to every worker with the step.

vLLM lends the blocks as 2-bit pages; this ledger lends the exact units (:mod:`kivi_xpu.paged.windows`), carved
from the same blocks (:mod:`.units`), in the scheduler's process, so that every rank of a step stores alike and a
prefix-cache hit can be checked where vLLM decides it. When vLLM allocates a request's blocks for a step, the units
that step needs are taken first (:meth:`UnitLedger.reserve`: a new request's window, a prompt chunk's staging), so
that vLLM admits, waits or preempts counting them. Per step (:meth:`UnitLedger.schedule`) each scheduled request
gets an :class:`Assignment`: its window unit, the units of its exact prompt while it is staged, and its shared
pages; the worker (:mod:`.requests`) only reads them.

**Cached prefixes.** A request's page ``p`` holds packed tokens ``[S + Tp, S + Tp + T)``: it depends on ``S`` tokens
of the next block, which vLLM's block hash does not cover, and it is written only when those tokens leave the
window. And a prompt that extends a cached one attends the exact states of the cached part (its own ``generate``
prefills in one go). So a hit that vLLM finds is used only as far as

* a kept :class:`PrefixEntry` (a finished prompt's exact states, kept in units whose blocks stay in vLLM's free
  queue, at its tail, and forgotten when vLLM lends one of them or a unit is carved from them) starts with the same
  tokens, and
* each hit block's page is complete and was written after the same ``S`` tokens (:meth:`page_written`).

:meth:`cap_hit` cuts vLLM's hit to that, in whole blocks, and pins the entry until the request's prompt is stored.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import NamedTuple

logger = logging.getLogger("vllm.kivi_xpu")  # under vLLM's logger, which has the handlers


class Assignment(NamedTuple):
    """A scheduled request's units in this step: its window ``slot``; ``prompt_end``, the end of its exact prompt
    (the prompt's length unless staging ran out); ``staging``, the units of its exact prompt so far, in order (its
    own, or a cached prefix's, read only); ``shared_pages``, its first pages that a cached prefix's blocks hold;
    ``keep``: its last prompt chunk is staged too (its units become a cached prefix)."""

    slot: int
    prompt_end: int
    staging: tuple[int, ...]
    shared_pages: int
    keep: bool


class Flush(NamedTuple):
    """A request that vLLM freed: its window's tokens that complete pages (packed positions up to ``upto``, whole
    pages) are packed into them, as the request would have packed them had it gone on, so that its cached blocks
    serve hits whole. ``length``: the tokens it held; ``shared_pages``: its first pages, another's (not written)."""

    slot: int
    blocks: tuple[int, ...]
    length: int
    shared_pages: int
    upto: int


class StepUnits(NamedTuple):
    """What the workers apply before a step's forward, in this order: ``flushes`` of requests that ended
    (:class:`Flush`), the units lent anew (``lent``: their value rows start at 0), ``copies`` ``(source units,
    target units, tokens)`` of a cached prefix's exact rows; and each scheduled request's :class:`Assignment`."""

    flushes: list[Flush]
    lent: list[int]
    copies: list[tuple[tuple[int, ...], tuple[int, ...], int]]
    requests: dict[str, Assignment]

    @classmethod
    def none(cls) -> StepUnits:
        """A step without requests (a dummy run's, or before the first step)."""
        return cls([], [], [], {})


@dataclass(eq=False)
class PrefixEntry:
    """A stored prompt's exact states: token ``i`` in unit ``units[i // W]``, row ``i % W``."""

    tokens: list[int]
    units: list[int]
    pins: int = 0  # requests reading it until their prompts are stored


@dataclass
class Held:
    """A request's units (see :class:`Assignment`) and what the ledger remembers of it between steps."""

    slot: int
    prompt_len: int
    prompt_end: int
    prompt_tokens: list[int]  # what a kept prompt is matched by
    staging: list[int] = field(default_factory=list)  # its own units
    entry: PrefixEntry | None = None  # a cached prefix it reads while its prompt is not stored
    shared_pages: int = 0
    keep: bool = False
    stored: bool = False  # its (exact) prompt's last chunk was scheduled
    flagged_pages: int = 0  # pages recorded as complete (:meth:`UnitLedger.page_written`)
    blocks_seen: int = 0
    length: int = 0  # tokens stored after its last scheduled step
    blocks: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # vLLM's list of its tokens (prompt and answer)


class UnitLedger:
    """The exact units of every rank (each rank's blocks hold the same unit ids), lent per step; see the module
    docstring. ``plan``: the :class:`~kivi_xpu.vllm.plan.KiviPlan`; ``prefix_caching``: vLLM's setting (without it
    there are no hits, and no prompt is kept); ``units``: the :class:`~kivi_xpu.vllm.units.BlockUnits` of vLLM's
    block pool."""

    def __init__(self, plan, prefix_caching: bool, units):
        self.plan, self.prefix_caching, self.units = plan, prefix_caching, units
        self.rows, self.tokens = plan.rows, plan.block_tokens
        self.settings = plan.settings[0]  # S and R are alike in every layer, so are the counts
        self.reserved: dict[str, list[int]] = {}  # units taken as vLLM allocated a request's blocks this step
        self.kept: dict[int, PrefixEntry] = {}  # unit -> the cached prefix it holds
        self.no_hit: set[str] = set()  # waiting requests whose hit was given up for want of units
        self.held: dict[str, Held] = {}
        self.entries: OrderedDict[int, PrefixEntry] = OrderedDict()  # least recently used first
        self.pins: dict[str, PrefixEntry] = {}  # hits granted to requests not yet scheduled
        self.page_spill: dict[int, tuple[int, ...]] = {}  # complete page's block -> the S tokens after its block
        self._flushes: list[Flush] = []
        self._lent: list[int] = []
        self._copies: list = []
        self._staging_warned = False

    # ------------------------------------------------------------------ units

    @property
    def free_units(self) -> int:
        return self.units.count_free()

    def reserve(self, request, end: int, hit_blocks=()) -> bool:
        """Before vLLM allocates blocks for ``request`` up to ``end`` tokens: takes the units that its step will need
        (a window if it is new, staging if the chunk is not its prompt's last), so that vLLM's check of its free
        blocks counts them; never from ``hit_blocks``, the free cached blocks its prefix-cache hit is about to
        reuse. ``False`` (nothing taken) when too few blocks are free; then a request not yet admitted gives up the
        cached prefix it pinned, and its next lookup finds no hit (that prefix's units could be what it waits for)."""
        request_id = request.request_id
        missing = self._needs(request_id, request, end) - len(self.reserved.get(request_id, ()))
        if missing <= 0:  # (every running request's decode step: no entry made)
            return True
        k = self.plan.unit_blocks
        units = self.units.take(missing, self.kept, avoid={block // k for block in hit_blocks})
        if units is None:
            if request_id in self.pins:
                self._unpin(self.pins.pop(request_id))
                self.no_hit.add(request_id)
            return False
        self.reserved.setdefault(request_id, []).extend(units)
        return True

    def unreserve(self, request_id: str) -> None:
        """vLLM could not allocate the request's blocks after all: its reserved units go back."""
        self._give_back(self.reserved.pop(request_id, []))

    def _needs(self, request_id: str, request, end: int) -> int:
        """The units a step up to ``end`` needs, held ones included: its window, and its exact prompt's staging when
        the step ends before the prompt (at most :attr:`~kivi_xpu.vllm.plan.KiviPlan.staging_units`; a cached
        prefix it reads is copied into its own)."""
        held = self.held.get(request_id)
        needs = 0 if held is not None else 1
        prompt_len = request.num_prompt_tokens
        exact = held is None or held.prompt_end == prompt_len
        staged = -(-end // self.rows)
        if exact and end < prompt_len and staged <= self.plan.staging_units:
            needs += staged - (len(held.staging) if held is not None else 0)
        return needs

    def _take(self, count: int, request_id: str | None = None) -> list[int] | None:
        """``count`` units: the request's reserved ones, or free blocks' (a cached prefix's only when no others are
        free: it is evicted); ``None`` (nothing taken) if too few are free."""
        reserved = self.reserved.get(request_id, [])
        units = [reserved.pop() for _ in range(count)] if len(reserved) >= count else self.units.take(count, self.kept)
        if units is not None:
            self._lent += units
        return units

    def _give_back(self, units: list[int]) -> None:
        if units:
            self.units.give_back(units)

    def _pin(self, entry: PrefixEntry) -> None:
        """A request reads ``entry``: its blocks leave vLLM's free queue until no request does."""
        if not entry.pins:
            self.units.hold(entry.units)
        entry.pins += 1

    def _unpin(self, entry: PrefixEntry | None) -> None:
        if entry is not None:
            entry.pins -= 1
            if not entry.pins:
                self._give_back(entry.units)

    def _drop(self, entry: PrefixEntry) -> None:
        """Forgets an unpinned cached prefix (its blocks are free already)."""
        del self.entries[id(entry)]
        for unit in entry.units:
            del self.kept[unit]

    # -------------------------------------------------------------- lifecycle

    def release(self, request_ids) -> None:
        """Gives back the units of requests that vLLM finished, aborted or preempted (a stored prompt to keep
        becomes a cached prefix)."""
        for request_id in request_ids:
            self._unpin(self.pins.pop(request_id, None))
            self.no_hit.discard(request_id)
            self.unreserve(request_id)
            held = self.held.pop(request_id, None)
            if held is None:
                continue
            if self.prefix_caching and held.stored:
                self._flush(held)
            self._unpin(held.entry)
            self._give_back([held.slot])
            self._end_staging(held)

    def _end_staging(self, held: Held) -> None:
        """The staging of a stored prompt (or of a request that ended) goes back, or becomes a cached prefix."""
        if held.keep and held.stored:
            self._keep(held)
        else:
            self._give_back(held.staging)
        held.staging, held.keep = [], False

    def _keep(self, held: Held) -> None:
        tokens = held.prompt_tokens
        for entry in list(self.entries.values()):  # a cached prompt this one extends serves nobody more
            if not entry.pins and tokens[: len(entry.tokens)] == entry.tokens:
                self._drop(entry)
        entry = PrefixEntry(tokens, held.staging)
        self.entries[id(entry)] = entry
        self.kept.update(dict.fromkeys(entry.units, entry))
        self._give_back(entry.units)  # free blocks to vLLM, lent last; lending one forgets the entry

    # ------------------------------------------------------------------ steps

    def schedule(self, scheduled: list, block_ids) -> StepUnits:
        """One step's assignments. ``scheduled``: ``(request_id, request, new_tokens)`` of each scheduled request,
        ``request`` vLLM's (``num_computed_tokens`` already counts this step's tokens); ``block_ids(request_id)``:
        its blocks (the first KV cache group's)."""
        assignments = {}
        new = [item for item in scheduled if item[0] not in self.held]
        for request_id, request, count in new:
            self._admit(request_id, request, request.num_computed_tokens - count)
        for request_id, request, count in scheduled:
            end = request.num_computed_tokens
            held = self.held[request_id]
            self._step(request_id, held, request, end - count, end)
            if self.prefix_caching:
                self._record_pages(held, request, end, block_ids(request_id))
            staging = held.entry.units if held.entry is not None else held.staging
            assignments[request_id] = Assignment(held.slot, held.prompt_end, tuple(staging), held.shared_pages,
                                                 held.keep)  # fmt: skip
        for request_id in list(self.reserved):  # (taken for a step that vLLM then did not schedule)
            self.unreserve(request_id)
        step = StepUnits(self._flushes, self._lent, self._copies, assignments)
        self._flushes, self._lent, self._copies = [], [], []
        return step

    def _admit(self, request_id: str, request, past: int) -> None:
        """A request's first step (again after a preemption): its window unit; with ``past`` tokens computed, the
        cached prefix that :meth:`cap_hit` pinned for it."""
        entry = self.pins.pop(request_id, None)
        self.no_hit.discard(request_id)
        if past and (entry is None or len(entry.tokens) < past):
            raise RuntimeError(f"KIVI pages: request {request_id} starts after {past} cached tokens, no exact prefix")
        if not past:
            self._unpin(entry)
            entry = None
        units = self._take(1, request_id)
        if units is None:
            raise RuntimeError(f"KIVI exact units: none reserved or free for request {request_id}'s window")
        prompt_len = request.num_prompt_tokens
        shared = past // self.tokens
        held = Held(units[0], prompt_len, prompt_len, list(request.prompt_token_ids or ()), entry=entry,
                    shared_pages=shared, blocks_seen=shared)  # fmt: skip
        self.held[request_id] = held

    def _step(self, request_id: str, held: Held, request, past: int, end: int) -> None:
        if past >= held.prompt_end:  # its prompt was stored in an earlier step
            self._unpin(held.entry)
            held.entry = None
            if held.staging:
                self._end_staging(held)
            return
        if end < held.prompt_len:  # a prompt chunk before the last
            self._stage(request_id, held, past, end)
        elif held.prompt_end == held.prompt_len and self._worth_keeping(held, request):
            held.keep = self._stage(request_id, held, past, held.prompt_len, keep=True)  # (a resumed one: answer too)
        if end >= held.prompt_end:
            held.stored = True

    def _worth_keeping(self, held: Held, request) -> bool:
        """A prompt is kept when prefix caching is on and another prompt could share a page of it beyond what it read
        itself (a block and the ``S`` tokens after it): a chat's next turn extends the turn it read."""
        read = held.shared_pages * self.tokens
        return (self.prefix_caching and request.prompt_token_ids is not None
                and held.prompt_len - read >= self.tokens + self.settings.sink_tokens)  # fmt: skip

    def _stage(self, request_id: str, held: Held, past: int, end: int, keep: bool = False) -> bool:
        """Units for the exact prompt up to ``end``, its own (a cached prefix it read is copied first). When a chunk
        before the last would stage more than ``staging_units`` (or, which :meth:`reserve` prevents, finds no free
        blocks), it ends the exact prompt: it is stored with the chunks before it as ``KiviCache``'s prefill of
        ``end`` tokens stores them, and the later chunks attend it as stored (2-bit, not exact). A prompt to keep
        whose units are not free is not kept."""
        staged = -(-end // self.rows)
        need = staged - len(held.staging)
        if need <= 0:
            return True
        units = self._take(need, request_id) if keep or staged <= self.plan.staging_units else None
        if units is not None:
            if held.entry is not None:  # its own copy of the cached prefix's rows before staging after them
                self._copies.append((tuple(held.entry.units), tuple(units), past))
                self._unpin(held.entry)
                held.entry = None
            held.staging += units
            return True
        if not keep:
            held.prompt_end = end
            if not self._staging_warned:
                self._staging_warned = True
                logger.warning(
                    "KIVI pages: request %s's prompt arrives in chunks and is longer than the staging allows: its "
                    'tokens after %d attend the earlier ones as stored (2-bit), not exact. Raise "staging_tokens" in '
                    "--additional-config kivi to keep every chunked prompt exact (logged once)",
                    request_id,
                    end,
                )
        return False

    # -------------------------------------------------------------- prefixes

    def _record_pages(self, held: Held, request, end: int, blocks: list[int]) -> None:
        """Forgets what was recorded of blocks new to the request (vLLM lends them anew) and records its pages that
        this step completes (:meth:`page_written`)."""
        for block in blocks[held.blocks_seen :]:
            self.page_spill.pop(block, None)
        held.blocks_seen, held.blocks, held.length, held.tokens = len(blocks), blocks, end, request.all_token_ids
        split = self.settings.split(end)
        self._record_complete(held, min(split.packed_keys, split.packed_values) // self.tokens)

    def _record_complete(self, held: Held, complete: int) -> None:
        """Records the request's pages before ``complete`` that hold its exact prompt only: answer tokens, and prompt
        tokens after an exact prompt that ended early, were computed attending 2-bit history, where the own
        ``generate`` of a prompt that contains them computes them exactly."""
        t, s = self.tokens, self.settings.sink_tokens
        complete = min(complete, max(0, held.prompt_end - s) // t)
        for page in range(max(held.flagged_pages, held.shared_pages), complete):
            after = t * (page + 1)
            self.page_spill[held.blocks[page]] = tuple(held.tokens[after : after + s])
        held.flagged_pages = max(held.flagged_pages, complete)

    def _flush(self, held: Held) -> None:
        """A request vLLM frees: its pages that its tokens fill but its window still holds are to be packed
        (:class:`Flush`, before the next forward lends its blocks or its slot again) and are recorded as complete."""
        s = self.settings.sink_tokens
        pages = max(0, min(held.length, held.prompt_end) - s) // self.tokens  # filled, of its exact prompt
        if pages > max(held.flagged_pages, held.shared_pages):
            upto = pages * self.tokens
            self._flushes.append(Flush(held.slot, tuple(held.blocks), held.length, held.shared_pages, upto))
            self._record_complete(held, pages)

    def page_written(self, block: int, tokens: list[int], page: int) -> bool:
        """Whether ``block``, holding page ``page`` of a request whose tokens begin with ``tokens``, is complete and
        was written after the same ``S`` tokens as those (vLLM's block hash vouches for the tokens before)."""
        after = self.tokens * (page + 1)
        return self.page_spill.get(block) == tuple(tokens[after : after + self.settings.sink_tokens])

    def drop_pins(self) -> None:
        """Before vLLM resets its prefix cache: waiting requests give up the cached prefixes they pinned (their blocks
        return to the free queue, which the reset requires; the next lookup pins again)."""
        for entry in self.pins.values():
            self._unpin(entry)
        self.pins.clear()

    def forget(self) -> None:
        """vLLM reset its prefix cache (with no request running, as it requires): no hit may use what was kept or
        recorded before, which a weight update, the reason for a reset, has made stale."""
        for entry in list(self.entries.values()):  # no request runs, so none reads them
            self._drop(entry)
        self.pins.clear()
        self.page_spill.clear()

    def forget_block(self, block: int) -> None:
        """vLLM lends ``block`` anew (or this ledger carves it into a unit): what it held, a complete page or part of
        a cached prefix's unit, is forgotten."""
        self.page_spill.pop(block, None)
        entry = self.kept.get(block // self.plan.unit_blocks)
        if entry is not None:
            self._drop(entry)

    def cap_hit(self, request, block_ids: list[int], hit_tokens: int) -> int:
        """The tokens of vLLM's hit (``hit_tokens``, blocks ``block_ids``) that ``request`` may use (see the module
        docstring): whole blocks, at most its prompt less one token, backed by a cached prefix's exact states and
        complete pages. Pins that prefix for the request."""
        self._unpin(self.pins.pop(request.request_id, None))
        prompt = request.prompt_token_ids
        if not self.prefix_caching or not hit_tokens or prompt is None or request.request_id in self.no_hit:
            return 0
        t = self.tokens
        limit = min(hit_tokens, request.num_prompt_tokens - 1) // t * t
        best, best_common = None, 0
        for entry in self.entries.values():
            common = _common_blocks(entry.tokens, prompt, min(limit, len(entry.tokens)), t)
            if common > best_common:
                best, best_common = entry, common
        tokens, pages = request.all_token_ids, 0
        while pages * t < best_common and self.page_written(block_ids[pages], tokens, pages):
            pages += 1
        if not pages:
            return 0
        self._pin(best)
        self.pins[request.request_id] = best
        self.entries.move_to_end(id(best))
        return pages * t


def _common_blocks(kept: list[int], prompt: list[int], limit: int, tokens: int) -> int:
    """The tokens, in whole blocks of ``tokens`` and at most ``limit``, that ``prompt`` shares with ``kept``."""
    common = 0
    while common + tokens <= limit and kept[common : common + tokens] == prompt[common : common + tokens]:
        common += tokens
    return common
