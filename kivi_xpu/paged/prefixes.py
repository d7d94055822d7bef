"""Prefix reuse on KIVI pages: exact prompt states kept in the pool, found by content, shared, evicted LRU.

**What is kept.** A request's prompt is staged in exact units (:mod:`.windows`: token ``p`` in unit ``p // W``). Each
unit that its prompt fills completely becomes an :class:`Entry`, found by a hash chain over the prompt's units of
``W`` tokens (blake2b of the parent's hash, the tenant's salt and the unit's tokens: the same on every process, as
transformers' block hashes). When the request's prompt is stored, the entry also takes the 2-bit pages that lie
wholly inside its tokens and that the prompt's own packing filled.

**A hit.** A new prompt whose first ``J`` units' hashes are entries (at least one prompt token is always left to
compute) is admitted at position ``b = J * W``: its staging begins with those units, so its remaining prompt chunks
attend the exact states of the whole prompt, as its own ``KiviCache`` prefill does; when its prompt is stored, the
run of the entries' pages from page 0 is its first pages (shared, never written by it: they hold the bytes it would
write, packed from the same exact states). Its answer is therefore its own ``generate``'s, up to the batch-size
rounding of the exact states (a prefix's states were computed in its donor's batch).

**Ownership.** A unit is held by the requests still prefilling from it (``unit_refs``); a shared page by the
entries and requests whose tables list it (:attr:`PrefixIndex.page_refs`; a page absent from it has one owner).
An entry with ``unit_refs == 0`` is cached: evictable, least recently used first by a logical clock (never wall
time), and only as a leaf (as SGLang's radix cache evicts), so that a chain is never cut in the middle. Eviction
returns the unit, and each page whose last reference it held.
"""

from __future__ import annotations

import hashlib
import heapq
from array import array
from collections.abc import Iterator
from dataclasses import dataclass, field


def chain_hash(parent: int | None, salt: str | None, tokens: list[int]) -> int:
    """The hash of ``tokens`` after the unit hashed ``parent`` (``None``: the first unit, after the tenant's
    ``salt``, mixed into every hash of the chain so that tenants never share)."""
    start = b"kivi-xpu" + (b"" if salt is None else salt.encode()) if parent is None else parent.to_bytes(16, "little")
    digest = hashlib.blake2b(start, digest_size=16)
    digest.update(array("q", tokens).tobytes())
    return int.from_bytes(digest.digest(), "little")


def unit_hashes(tokens: list[int], rows: int, salt: str | None, count: int) -> list[int]:
    """The hash chain of the first ``count`` units of ``rows`` tokens of ``tokens``."""
    hashes, parent = [], None
    for j in range(count):
        parent = chain_hash(parent, salt, tokens[j * rows : (j + 1) * rows])
        hashes.append(parent)
    return hashes


@dataclass(eq=False)
class Entry:
    """One cached unit of exact prompt states: ``depth`` (its index in the prompt: tokens
    ``[depth * W, (depth + 1) * W)``), its ``unit`` in the pool, and ``pages`` ``[(page index, block)]`` of packed
    tokens wholly inside them."""

    key: int
    parent: int | None
    depth: int
    unit: int
    rows: int  # tokens it holds: W, or fewer for a prompt's tail (a leaf for ever)
    pages: list[tuple[int, int]] = field(default_factory=list)
    unit_refs: int = 1  # the request that registers it is prefilling from it
    last_used: int = 0
    children: int = 0  # cached entries whose parent it is: only a leaf is evicted


class PrefixIndex:
    """The entries of one cache, their references and their eviction order (see the module docstring)."""

    def __init__(self):
        self.entries: dict[int, Entry] = {}
        self.tail_rows: dict[int | None, dict[int, int]] = {}  # parent -> {rows of a cached tail: how many}
        self.page_refs: dict[int, int] = {}  # shared page -> references (absent: one owner)
        self.pending: dict[int, str] = {}  # hash of a unit a prefilling request will register -> that request
        self.clock = 0
        self.prompt_tokens = 0  # admitted prompts' tokens, and those found cached: the hit rate
        self.cached_tokens = 0

    # ------------------------------------------------------------------ lookup

    def match(self, hashes: list[int]) -> list[Entry]:
        """The longest chain of entries that ``hashes`` begins with."""
        chain = []
        for key in hashes:
            entry = self.entries.get(key)
            if entry is None:
                break
            chain.append(entry)
        return chain

    def __contains__(self, key: int) -> bool:
        return key in self.entries

    def pages(self) -> set[int]:
        """Every page that some entry keeps."""
        return {block for entry in self.entries.values() for _, block in entry.pages}

    def awaited(self, hashes: list[int], request_id: str) -> bool:
        """Whether another request is prefilling a unit of ``hashes`` that is not cached yet (then the request waits
        for it rather than computing the same states twice)."""
        return any(self.pending.get(key, request_id) != request_id for key in hashes if key not in self.entries)

    @staticmethod
    def shared_pages(chain: list[Entry]) -> list[int]:
        """The blocks of the run of ``chain``'s pages from page 0 (a page missing ends it)."""
        blocks = []
        for entry in chain:
            for index, block in entry.pages:
                if index != len(blocks):
                    return blocks
                blocks.append(block)
        return blocks

    # ------------------------------------------------------------- admission

    def expect(self, hashes: list[int], request_id: str) -> None:
        """``request_id`` will register the units of ``hashes`` that no other request is prefilling already."""
        for key in hashes:
            self.pending.setdefault(key, request_id)

    def forget(self, hashes: list[int], request_id: str) -> None:
        """``request_id`` will register none of ``hashes`` after all (others should not wait for it)."""
        for key in hashes:
            if self.pending.get(key) == request_id:
                del self.pending[key]

    def count_admission(self, prompt_tokens: int, cached_tokens: int) -> None:
        """An admitted prompt of ``prompt_tokens``, ``cached_tokens`` of which were found cached (the hit rate)."""
        self.prompt_tokens += prompt_tokens
        self.cached_tokens += cached_tokens

    # ------------------------------------------------------------- references

    def touch(self, entries: list[Entry]) -> None:
        """``entries`` are the most recently used."""
        self.clock += 1
        for entry in entries:
            entry.last_used = self.clock

    def acquire(self, chain: list[Entry]) -> None:
        """A request prefills from ``chain``: its units are held, and it is the most recently used."""
        self.touch(chain)
        for entry in chain:
            entry.unit_refs += 1

    def release_units(self, chain: list[Entry]) -> None:
        for entry in chain:
            entry.unit_refs -= 1

    def share_pages(self, blocks: list[int]) -> None:
        for block in blocks:
            self.page_refs[block] = self.page_refs.get(block, 1) + 1

    def release_pages(self, blocks: list[int]) -> list[int]:
        """Drops one reference of each of ``blocks``; returns those that no one holds any more."""
        freed = []
        for block in blocks:
            refs = self.page_refs.pop(block, 1) - 1
            if refs > 0:
                self.page_refs[block] = refs
            else:
                freed.append(block)
        return freed

    def register(self, key: int, parent: int | None, depth: int, unit: int, rows: int) -> Entry:
        """A prefilling request's unit ``depth`` holds ``rows`` of its prompt's tokens (all the unit's, or the last
        ones of its prompt): it becomes an entry, held by that request."""
        self.pending.pop(key, None)
        self.clock += 1
        if parent is not None:
            self.entries[parent].children += 1
        entry = self.entries[key] = Entry(key, parent, depth, unit, rows, last_used=self.clock)
        return entry

    def register_tail(self, key: int, parent: int | None, depth: int, unit: int, rows: int) -> Entry:
        """A prompt's last ``rows`` tokens after its whole units (cached at once: its request is done with them)."""
        entry = self.register(key, parent, depth, unit, rows)
        entry.unit_refs = 0
        lengths = self.tail_rows.setdefault(parent, {})
        lengths[rows] = lengths.get(rows, 0) + 1
        return entry

    def match_tail(self, parent: int | None, salt: str | None, tokens: list[int]) -> Entry | None:
        """The longest cached tail after ``parent`` that ``tokens`` begins with and leaves a token of."""
        for rows in sorted(self.tail_rows.get(parent, ()), reverse=True):
            if rows < len(tokens):
                entry = self.entries.get(chain_hash(parent, salt, tokens[:rows]))
                if entry is not None:
                    return entry
        return None

    def attach_pages(self, entry: Entry, pages: list[tuple[int, int]]) -> None:
        """``entry`` keeps ``pages`` (page index, block) besides the request that wrote them."""
        entry.pages.extend(pages)
        self.share_pages([block for _, block in pages])

    # ---------------------------------------------------------------- eviction

    @property
    def cached_units(self) -> int:
        return sum(1 for entry in self.entries.values() if entry.unit_refs == 0)

    def evictable(self, keep: list[Entry] = ()) -> Iterator[tuple[int, list[int]]]:
        """Forgets cached entries not in ``keep``, least recently used first, one for each step the caller takes:
        yields each one's unit and the pages that no one holds any more. The entries are scanned once: an entry
        that an eviction turns into a leaf joins the candidates as it does."""
        kept = {id(entry) for entry in keep}

        def candidate(entry: Entry) -> bool:
            return entry.unit_refs == 0 and not entry.children and id(entry) not in kept

        heap = [(e.last_used, e.key) for e in self.entries.values() if candidate(e)]
        heapq.heapify(heap)
        while heap:
            _, key = heapq.heappop(heap)
            victim = self.entries.get(key)
            if victim is None or not candidate(victim):  # changed since it was pushed (the caller may admit between)
                continue
            yield self._forget(victim)
            parent = self.entries.get(victim.parent) if victim.parent is not None else None
            if parent is not None and candidate(parent):
                heapq.heappush(heap, (parent.last_used, parent.key))

    def _forget(self, victim: Entry) -> tuple[int, list[int]]:
        del self.entries[victim.key]
        if victim.parent is not None:
            self.entries[victim.parent].children -= 1
        lengths = self.tail_rows.get(victim.parent, {})
        if victim.rows in lengths:  # (a whole unit's rows are never a tail's)
            lengths[victim.rows] -= 1
            if not lengths[victim.rows]:
                del lengths[victim.rows]
        return victim.unit, self.release_pages([block for _, block in victim.pages])

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
