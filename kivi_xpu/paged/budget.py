"""How ``kv_memory`` is one pool, and what a request takes from it.

The cache is one byte tensor cut into equal **sectors** (transformers' ``CachePool``), each lent whole to one of two
kinds of block and returned when all its blocks are free:

* **pages** (pool index 0): one 2-bit page per layer, ``T`` packed tokens (the key group size, or the least common
  multiple of the layers' with per-layer settings; :mod:`.pages`);
* **exact units** (pool index 1): ``W`` exact tokens, keys and values, of every layer (:mod:`.windows`). A running
  request holds one for its sinks and residual window; a request whose prompt the scheduler splits holds
  ``ceil(P / W)`` more for its exact prompt until its last chunk (:mod:`.windows`, staging).

A request of ``P`` prompt and ``N`` new tokens is admitted only when everything it will ever hold fits at once (its
pages for ``P + N`` tokens, its window, its exact prompt if split): nothing it holds is ever taken back, so
transformers' preemption (a soft reset re-prefills prompt and answer as one prompt, which KIVI would quantize
differently) never runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from math import lcm
from typing import NamedTuple

from ..algorithm import KiviSettings
from .pages import BlockLayout

PAGES, UNITS = 0, 1  # pool indices


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def window_rows(settings: KiviSettings, block: BlockLayout, token_bytes: int) -> int:
    """``W``, the exact tokens of a unit (``token_bytes`` each, every layer's keys and values): at least the window's
    value rows (sinks, ``R``, and ``block.window_step`` rows of slack so that values move down once every that many
    steps), rounded up (by at most a page's ``T`` tokens) so that a unit is a whole number of blocks when possible,
    which keeps sectors small."""
    need = settings.sink_tokens + settings.residual_length + block.window_step
    for rows in range(need, need + block.tokens + 1):
        if rows * token_bytes % block.block_bytes == 0:
            return rows
    return need


def exact_token_bytes(shape: PageShape, dtype) -> int:
    """Bytes of one exact token of every layer, keys and values (a unit holds ``W`` of them)."""
    return shape.num_layers * 2 * shape.heads * shape.head_dim * dtype.itemsize


def layer_settings(settings: KiviSettings | Sequence[KiviSettings], num_layers: int) -> tuple[KiviSettings, ...]:
    """One :class:`~kivi_xpu.KiviSettings` per layer of the pages (``settings`` itself for every layer, or a sequence
    of ``num_layers``); ``ValueError`` when the layers disagree on what the pool's geometry needs alike: the sinks and
    the window (every layer's exact window lives in the same unit, as its tokens are counted once)."""
    every = (settings,) * num_layers if isinstance(settings, KiviSettings) else tuple(settings)
    if len(every) != num_layers:
        raise ValueError(f"KIVI pages: {len(every)} per-layer settings for {num_layers} full-attention layers")
    for name in ("sink_tokens", "residual_length"):
        values = sorted({getattr(s, name) for s in every})
        if len(values) > 1:
            raise ValueError(
                f"KIVI pages need the same {name} in every layer (each request's exact window is one unit of the "
                f"pool), these layers have {values}: keep {name} out of layer_overrides to serve them with continuous "
                f"batching"
            )
    return every


class RequestTooLong(ValueError):
    """A request that the whole ``kv_memory`` budget cannot serve exactly, even alone (the message names the longest
    prompt it serves): a client's error, which ``kivi-xpu serve`` answers with HTTP 400."""


class PageShape(NamedTuple):
    """What the pool's geometry needs of a model, whatever the engine: the KV heads of one rank, ``head_dim`` and the
    number of full-attention layers (each engine's adapter reads them from its config)."""

    heads: int
    head_dim: int
    num_layers: int


class RequestNeeds(NamedTuple):
    """What one request takes from the pool: page blocks and exact units."""

    pages: int
    units: int


class PageBudget(NamedTuple):
    """How ``kv_memory`` bytes split into sectors of pages and exact units (see the module docstring)."""

    block: BlockLayout  # one page per layer
    num_layers: int
    rows: int  # W, exact tokens per unit
    unit_bytes: int
    bytes_per_sector: int
    num_sectors: int
    max_requests: int | None  # a cap on requests in flight; None: memory alone bounds them

    @classmethod
    def plan(cls, shape: PageShape, settings: KiviSettings | Sequence[KiviSettings], dtype, kv_memory: int,
             max_requests: int | None) -> PageBudget:  # fmt: skip
        """The budget of ``kv_memory`` bytes for a model of ``shape`` (one rank's KV heads under tensor parallelism);
        ``settings``: every layer's, or one per full-attention layer (:func:`layer_settings`)."""
        heads, head_dim, num_layers = shape
        every = layer_settings(settings, num_layers)
        for one in every:
            one.check_head_dim(head_dim)
        block = BlockLayout.for_settings(every, heads, head_dim)
        token_bytes = exact_token_bytes(shape, dtype)
        rows = window_rows(every[0], block, token_bytes)
        unit_bytes = rows * token_bytes
        bytes_per_sector = lcm(block.block_bytes, unit_bytes, 128)
        num_sectors = kv_memory // bytes_per_sector
        budget = cls(block, num_layers, rows, unit_bytes, bytes_per_sector, num_sectors, max_requests)
        if num_sectors < 2:
            raise ValueError(
                f"`kv_memory` ({kv_memory / 2**20:.1f} MiB) is too small: the pool needs at least two sectors of "
                f"{bytes_per_sector / 2**20:.2f} MiB (one of exact windows, one of 2-bit pages); raise it"
            )
        return budget

    @property
    def pages_per_sector(self) -> int:
        return self.bytes_per_sector // self.block.block_bytes

    @property
    def units_per_sector(self) -> int:
        return self.bytes_per_sector // self.unit_bytes

    def needs(self, prompt: int, new_tokens: int, split: bool) -> RequestNeeds:
        """What a request of ``prompt`` + ``new_tokens`` tokens holds at most; ``split``: its prompt arrives in
        several chunks (its exact states wait in units until the last one)."""
        staging = _ceil_div(prompt, self.rows) if split else 0
        return RequestNeeds(_ceil_div(prompt + new_tokens, self.block.tokens), 1 + staging)

    def sectors(self, needs: RequestNeeds, free_pages: int = 0, free_units: int = 0) -> int:
        """Sectors to lend for ``needs`` when ``free_pages`` / ``free_units`` blocks are already lent and free."""
        return _ceil_div(max(0, needs.pages - free_pages), self.pages_per_sector) + _ceil_div(
            max(0, needs.units - free_units), self.units_per_sector
        )

    def fits_alone(self, prompt: int, new_tokens: int, split: bool) -> bool:
        """Whether a request fits in the empty pool."""
        return self.sectors(self.needs(prompt, new_tokens, split)) <= self.num_sectors

    def _longest(self, new_tokens: int, split: bool) -> int:
        low, high = 0, self.num_sectors * max(self.pages_per_sector * self.block.tokens, self.rows)
        while low < high:  # the largest prompt that fits: needs grow with the prompt
            mid = (low + high + 1) // 2
            low, high = (mid, high) if self.fits_alone(mid, new_tokens, split) else (low, mid - 1)
        return low

    def longest_prompt(self, new_tokens: int, max_batch_tokens: int | None = None) -> int:
        """The longest prompt served exactly with ``new_tokens`` new tokens (0: none): split into chunks, or, up to
        ``max_batch_tokens``, whole in one forward (then it needs no staging, and waits for a forward with room)."""
        chunked = self._longest(new_tokens, True)
        return chunked if max_batch_tokens is None else max(chunked, min(self._longest(new_tokens, False),
                                                                         max_batch_tokens))  # fmt: skip

    def check_request(self, prompt: int, new_tokens: int, max_batch_tokens: int) -> None:
        """:class:`RequestTooLong` (a ``ValueError``) for a request the empty pool cannot serve exactly."""
        longest = self.longest_prompt(new_tokens, max_batch_tokens)
        if prompt > longest:
            raise RequestTooLong(
                f"request of {prompt} prompt + {new_tokens} new tokens exceeds the `kv_memory` budget of KIVI pages "
                f"({self.num_sectors * self.bytes_per_sector / 2**20:.1f} MiB) even alone: the longest prompt it "
                f"serves exactly with {new_tokens} new tokens is {longest} tokens (a prompt's exact states wait in the "
                f"pool while it is prefilled in chunks); raise `kv_memory` or shorten the request"
            )

    def summary(self, new_tokens: int, max_batch_tokens: int | None = None) -> str:
        """One line for the log: the pool and the longest prompt it serves exactly."""
        return (
            f"KIVI pages: {self.num_sectors} sectors of {self.bytes_per_sector / 2**20:.2f} MiB "
            f"({self.pages_per_sector} pages of {self.block.tokens} tokens or {self.units_per_sector} exact units of "
            f"{self.rows} tokens each); "
            f"the longest prompt served exactly with {new_tokens} new tokens: "
            f"{self.longest_prompt(new_tokens, max_batch_tokens)} tokens"
        )

    def requests_held(self, prompt: int, new_tokens: int) -> int:
        """How many requests of ``prompt`` + ``new_tokens`` tokens the pool holds at once while they decode (their
        prompts' staging returned): sectors for their pages and windows together."""
        needs = self.needs(prompt, new_tokens, split=False)
        count = 0
        while self.sectors(RequestNeeds(needs.pages * (count + 1), needs.units * (count + 1))) <= self.num_sectors:
            count += 1
            if self.max_requests is not None and count == self.max_requests:
                break
        return count
