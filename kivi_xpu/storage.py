"""Growable token buffers and the packed history of one cache layer: bytes and rows, nothing else.

Storage grows with the tokens actually held, by amortised chunks (geometric growth), never by concatenating the
whole history at every step. It knows layouts (:class:`PackedLayout`), not quantization: the codecs
(:mod:`kivi_xpu.codec`) write the codes into these buffers and read them back. A leaf: torch and the standard library
only.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

# Unbounded buffers (the packed history) take a size class: the rows needed rounded up to a step of 1/32 to 1/64 of
# them (CLASSES_PER_DOUBLING), or of a quarter of `min_rows` (a residual block of tokens) while that is larger, and at
# least `min_rows` in all. Growth stays geometric (amortised O(1) copies per token, while every decode step reads all
# the rows anyway), the slack stays under ~3 % of a long history (at equal memory, batch: kivi-xpu bench --kv-budget)
# and under a quarter of a residual block of a short one, and the capacity is a function of the rows held alone, not
# of the way there: a cache that holds fewer packed tokens (the default's exact sinks) never reserves more than one
# that holds more (the paper preset).
CLASSES_PER_DOUBLING = 32
SHORT_STEPS_PER_BLOCK = 4
# Bounded buffers (the full-precision windows) double up to their bound: few reallocations for a short cache.
WINDOW_GROWTH_FACTOR = 2
# The packed history reserves room for at least this many tokens (or one residual block if smaller), and while short
# grows by a quarter of that at a time (size_class).
MIN_GROWTH_TOKENS = 1024
# A channel-major buffer (token axis last: the packed keys) whose rows would be a multiple of this many bytes apart gets
# one cache line more per row. The fused decode attention reads the same position of a head's D channel rows together;
# at a multiple of 512 bytes those D lines fall into at most 8 of the 64 sets of a 32 KiB 8-way L1 data cache and evict
# each other. It happens after a prompt whose packed keys fill a multiple of 2048 tokens (2-bit), until the buffer first
# grows: with the default 4 sinks, prompts of 2048 m + 4 to 2048 m + 131 tokens. The padding makes such decode steps
# faster in the model (docs/measurements.md).
ROW_ALIGNMENT_TO_AVOID = 512
CACHE_LINE_BYTES = 64
# The layout of the packed history (the ops' codes and metadata, kivi_xpu/ops/declarations.py) that copies and pickles
# of a layer carry (KiviLayer.__getstate__). A change of that layout raises it, and KiviLayer.__setstate__ converts
# the older formats it knows or refuses them by name; a pickle without it is format 1.
STORAGE_FORMAT = 1


def padded_channel_row(elements: int, itemsize: int) -> int:
    """Elements to allocate for a channel-major row of ``elements`` items of ``itemsize`` bytes: one cache line more
    where the row would be a multiple of ``ROW_ALIGNMENT_TO_AVOID`` bytes (see there)."""
    if elements > 0 and elements * itemsize % ROW_ALIGNMENT_TO_AVOID == 0:
        return elements + CACHE_LINE_BYTES // itemsize
    return elements


def growth_tokens(residual_length: int) -> int:
    """Tokens a packed history reserves at least: one residual block, capped at ``MIN_GROWTH_TOKENS``."""
    return min(residual_length, MIN_GROWTH_TOKENS)


def size_class(needed: int, min_rows: int) -> int:
    """The capacity of an unbounded buffer that must hold ``needed`` rows: ``needed`` rounded up to a multiple of
    ``max(min_rows // SHORT_STEPS_PER_BLOCK, 2**k)``, with ``2**k`` the largest power of two ≤ ``needed /
    CLASSES_PER_DOUBLING``; at least ``min_rows``."""
    short_step = max(1, min_rows // SHORT_STEPS_PER_BLOCK)
    step = max(short_step, 1 << max(0, needed.bit_length() - CLASSES_PER_DOUBLING.bit_length()))
    return max(min_rows, -(-needed // step) * step)


class TokenBuffer:
    """A 4-D tensor used as a sequence along its token axis ``dim`` (2: ``[B, H, capacity, X]``; 3:
    ``[B, H, X, capacity]``), holding rows ``[start, end)`` of that axis.

    Appends write into spare capacity; dropping rows from the front only moves ``start``, and the live rows are
    moved back to the front when the buffer runs out of room at its end. Capacity follows the rows held: when full
    it grows to the :func:`size_class` of the rows it must hold (geometric, at least ``min_rows``), or, for a buffer
    with a ``bound`` (rows it normally never exceeds, e.g. a full-precision window), doubles up to that bound, so that
    a short cache never reserves a whole window.
    """

    def __init__(
        self,
        batch: int,
        heads: int,
        width: int,
        dtype: torch.dtype,
        device,
        min_rows: int = 1,
        dim: int = 2,
        bound: int | None = None,
    ):
        if dim not in (2, 3):
            raise ValueError(f"`dim` must be 2 or 3, got {dim!r}")
        self.batch, self.heads, self.width, self.dim = batch, heads, width, dim
        self.dtype, self.device = dtype, torch.device(device)
        self.min_rows, self.bound = max(1, min_rows), bound
        self.data = self._empty(0)
        self.start = self.end = 0

    def _empty(self, rows: int) -> torch.Tensor:
        if self.dim == 3:
            rows = padded_channel_row(rows, self.dtype.itemsize)
        shape = (
            (self.batch, self.heads, rows, self.width) if self.dim == 2 else (self.batch, self.heads, self.width, rows)
        )
        return torch.empty(shape, dtype=self.dtype, device=self.device)

    def __len__(self) -> int:
        return self.end - self.start

    @property
    def capacity(self) -> int:
        return self.data.shape[self.dim]

    def rows(self, start: int, end: int) -> torch.Tensor:
        """Rows ``[start, end)`` of the underlying buffer along the token axis (a view)."""
        return self.data.narrow(self.dim, start, end - start)

    def view(self) -> torch.Tensor:
        """The live rows (a view, not a copy)."""
        return self.rows(self.start, self.end)

    def _make_room(self, n: int) -> None:
        live = len(self)
        if self.end + n <= self.capacity:
            return
        if live + n <= self.capacity:  # enough room once the live rows move to the front
            # In pieces of `start` rows: each lands on rows already copied or free, never on rows still to read.
            for first in range(0, live, self.start):
                count = min(self.start, live - first)
                self.rows(first, first + count).copy_(self.rows(self.start + first, self.start + first + count))
        else:
            grown = self._empty(self._grown_capacity(live + n))
            grown.narrow(self.dim, 0, live).copy_(self.view())
            self.data = grown
        self.start, self.end = 0, live

    def _grown_capacity(self, needed: int) -> int:
        if self.bound is None:
            return size_class(needed, self.min_rows)
        doubled = max(self.capacity * WINDOW_GROWTH_FACTOR, self.min_rows)
        return max(needed, min(doubled, self.bound))

    def append(self, rows: torch.Tensor) -> None:
        """Appends ``rows`` (``n`` rows along the token axis)."""
        n = rows.shape[self.dim]
        self.reserve(n)
        self.rows(self.end, self.end + n).copy_(rows)
        self.end += n

    def reserve(self, n: int) -> None:
        """Makes rows ``[end, end + n)`` writable in place (for a writer that fills them itself, then calls
        :meth:`commit`)."""
        data = self.data
        inference = data.is_inference() and not torch.is_inference_mode_enabled()
        if not inference and self.end + n <= data.shape[self.dim]:
            return  # (the common case, checked first: a decode step reserves five buffers)
        if inference:
            # Filled under torch.inference_mode(), whose tensors refuse in-place writes outside it: go on with a
            # normal copy (once), as DynamicCache does implicitly by concatenating.
            self.data = self.data.clone()
        self._make_room(n)

    def commit(self, n: int) -> None:
        """Counts the ``n`` rows written after :meth:`reserve` as live."""
        self.end += n

    def drop_front(self, n: int) -> None:
        self.start += n
        if self.start == self.end:
            self.start = self.end = 0

    def truncate(self, length: int) -> None:
        """Keeps only the first ``length`` live rows."""
        self.end = self.start + length

    def select_batch(self, index: torch.Tensor) -> None:
        """Keeps the batch rows ``index`` (beam reordering, batch selection, repeat-interleave)."""
        self.data = self.data.index_select(0, index.to(self.device))
        self.batch = self.data.shape[0]

    def nbytes(self) -> int:
        """Bytes of the live rows."""
        return len(self) * self.batch * self.heads * self.width * self.data.element_size()

    def allocated_bytes(self) -> int:
        return self.data.numel() * self.data.element_size()


class PackedLayout(NamedTuple):
    """How one kind's codes and metadata lie in a :class:`PackedHistory` (the codec's, :mod:`kivi_xpu.codec`):

    * ``token_dim`` 3, channel-major (keys): codes ``[B, H, D, T/P]``, scales/zeros ``[B, H, D, T/G]``;
    * ``token_dim`` 2, token-major (values): codes ``[B, H, T, D/P]``, scales/zeros ``[B, H, T, D/G]``;

    a code row holds ``tokens_per_code_row`` tokens and a metadata row ``tokens_per_meta_row`` (``P`` codes per byte,
    ``G`` the group); rows are ``code_width`` / ``meta_width`` wide; the metadata is ``meta_dtype``; the buffers
    reserve at least ``growth_tokens`` tokens and grow by a quarter of that while short (:func:`size_class`)."""

    token_dim: int
    tokens_per_code_row: int
    tokens_per_meta_row: int
    code_width: int
    meta_width: int
    meta_dtype: torch.dtype
    growth_tokens: int


class PackedHistory:
    """The packed part of one kind of one layer, on the storage device: ``codes``, ``scales`` and ``zeros`` token
    buffers in a :class:`PackedLayout`, and ``num_tokens``, the tokens they hold, which only this class writes.
    Written by a codec (:meth:`kivi_xpu.codec.KindCodec.pack`): whole parts (:meth:`append_parts`) or in place
    (:meth:`reserve`, then :meth:`commit`)."""

    def __init__(self, layout: PackedLayout, batch: int, heads: int, device):
        self.layout = layout
        code_rows = max(1, layout.growth_tokens // layout.tokens_per_code_row)
        meta_rows = max(1, layout.growth_tokens // layout.tokens_per_meta_row)
        dim = layout.token_dim
        self.codes = TokenBuffer(batch, heads, layout.code_width, torch.uint8, device, code_rows, dim)
        self.scales = TokenBuffer(batch, heads, layout.meta_width, layout.meta_dtype, device, meta_rows, dim)
        self.zeros = TokenBuffer(batch, heads, layout.meta_width, layout.meta_dtype, device, meta_rows, dim)
        self.num_tokens = 0

    @property
    def device(self) -> torch.device:
        return self.codes.device

    def buffers(self) -> tuple[TokenBuffer, ...]:
        return self.codes, self.scales, self.zeros

    def append_parts(self, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> None:
        """Appends packed tokens given as parts in this layout (whole metadata rows)."""
        for buf, part in zip(self.buffers(), (codes, scales, zeros), strict=True):
            buf.append(part)
        self.num_tokens += scales.shape[self.layout.token_dim] * self.layout.tokens_per_meta_row

    def reserve(self, n: int) -> None:
        """Makes the rows of ``n`` more tokens writable in place, for a writer that fills them itself
        (``quantize_values_into``, ``append_decode_step``) and then calls :meth:`commit`."""
        for buf in self.buffers():
            buf.reserve(n)

    def commit(self, n: int) -> None:
        """Counts the ``n`` token rows written after :meth:`reserve` as held (token-major layouts)."""
        for buf in self.buffers():
            buf.commit(n)
        self.num_tokens += n

    def parts_from(self, start: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The buffers from token ``start`` on (group-aligned for keys) to their capacity: the whole buffers for 0,
        contiguous copies otherwise (what a dequantize op reads; it reads only the tokens it is asked for)."""
        if not start:
            return self.codes.data, self.scales.data, self.zeros.data
        code_start, meta_start = start // self.layout.tokens_per_code_row, start // self.layout.tokens_per_meta_row
        return (
            self.codes.rows(code_start, self.codes.capacity).contiguous(),
            self.scales.rows(meta_start, self.scales.capacity).contiguous(),
            self.zeros.rows(meta_start, self.zeros.capacity).contiguous(),
        )

    def truncate(self, num_tokens: int) -> None:
        """Keeps the first ``num_tokens`` tokens (group-aligned for keys)."""
        self.codes.truncate(num_tokens // self.layout.tokens_per_code_row)
        self.scales.truncate(num_tokens // self.layout.tokens_per_meta_row)
        self.zeros.truncate(num_tokens // self.layout.tokens_per_meta_row)
        self.num_tokens = num_tokens

    def select_batch(self, index: torch.Tensor) -> None:
        for buf in self.buffers():
            buf.select_batch(index)

    def nbytes(self) -> tuple[int, int]:
        """(bytes of codes, bytes of scales and zeros) actually holding tokens."""
        return self.codes.nbytes(), self.scales.nbytes() + self.zeros.nbytes()

    def allocated_bytes(self) -> int:
        return sum(b.allocated_bytes() for b in self.buffers())

    def __setstate__(self, state: dict) -> None:
        """Reads the pickles of kivi-xpu <= 0.3 (bc2f283), whose packed history also named its kind, settings,
        backend and quantization (now the codec's): the layout is rebuilt from the buffers, the rest kept aside in
        ``legacy`` for the stream (:meth:`KindStream.__setstate__
        <kivi_xpu.stream.KindStream.__setstate__>`)."""
        if "layout" not in state:
            codes, scales = state["codes"], state["scales"]
            growth = growth_tokens(state["settings"].residual_length)
            layout = PackedLayout(codes.dim, state["tokens_per_code_row"], state["tokens_per_meta_row"], codes.width,
                                  scales.width, scales.dtype, growth)  # fmt: skip
            kept = ("codes", "scales", "zeros", "num_tokens")
            legacy = {k: v for k, v in state.items() if k not in kept}
            state = {"layout": layout, **{k: state[k] for k in kept}, "legacy": legacy}
        self.__dict__.update(state)


class DepartedTokens:
    """Exact copies of the tokens that most recently left a full-precision window for a :class:`PackedHistory`
    (kept only while a layer records its past, so that a rollback can restore them bit for bit).

    Holds the last ``len(self)`` tokens of the packed history, oldest first, as chunks ``[B, H, n_i, D]``.
    """

    def __init__(self):
        self.chunks: list[torch.Tensor] = []
        self.num_tokens = 0

    def __len__(self) -> int:
        return self.num_tokens

    def append(self, x: torch.Tensor) -> None:
        self.chunks.append(x)
        self.num_tokens += x.shape[2]

    def tokens(self, start: int, end: int) -> torch.Tensor:
        """Tokens ``[start, end)`` of the recorded ones as ``[B, H, end - start, D]``."""
        if len(self.chunks) > 1:
            self.chunks = [torch.cat(self.chunks, dim=2)]
        return self.chunks[0][:, :, start:end]

    def clear(self) -> None:
        self.chunks, self.num_tokens = [], 0

    def select_batch(self, index: torch.Tensor) -> None:
        self.chunks = [c.index_select(0, index.to(c.device)) for c in self.chunks]

    def allocated_bytes(self) -> int:
        return sum(c.numel() * c.element_size() for c in self.chunks)
