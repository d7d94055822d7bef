"""Growable token buffers and the packed key/value history of one cache layer.

Storage grows with the tokens actually held, by amortised chunks (geometric growth), never by concatenating the
whole history at every step, and a decode step only quantizes the tokens that leave the full-precision window.
"""

from __future__ import annotations

import warnings

import torch

from .algorithm import KiviSettings
from .ops import kernel
from .ops.checks import codes_per_byte
from .rotation import rotate, rotation_matrix, unrotate

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


def size_class(needed: int, min_rows: int) -> int:
    """The capacity of an unbounded buffer that must hold ``needed`` rows: ``needed`` rounded up to a multiple of
    ``max(min_rows // SHORT_STEPS_PER_BLOCK, 2**k)``, with ``2**k`` the largest power of two ≤ ``needed /
    CLASSES_PER_DOUBLING``; at least ``min_rows``."""
    short_step = max(1, min_rows // SHORT_STEPS_PER_BLOCK)
    step = max(short_step, 1 << max(0, needed.bit_length() - CLASSES_PER_DOUBLING.bit_length()))
    return max(min_rows, -(-needed // step) * step)


_overflow_warned = False


def warn_on_metadata_overflow(
    x: torch.Tensor, scales: torch.Tensor, kind: str, rotation: torch.Tensor | None = None
) -> None:
    """Warns once per process when finite ``x [B, H, n, D]`` (quantized as ``x @ rotation`` with a rotation)
    exceeded the float16 range of its scales/zero points (their groups then hold NaN, by the quantizer's rule: a loud
    result, but the cause deserves a message). Cheap: ``scales`` is small, and ``x`` is only looked at when some
    scale is NaN."""
    global _overflow_warned
    if _overflow_warned or scales.device.type == "meta" or not scales.isnan().any():
        return
    x = rotate(x, rotation)
    largest = x.abs().masked_fill(~x.isfinite(), 0).max()
    if largest > torch.finfo(torch.float16).max:
        _overflow_warned = True
        warnings.warn(
            f"KiviCache: {kind} up to {largest.item():.3g} in magnitude overflow the float16 scales and zero points "
            "(max 65504): their quantization groups hold NaN, so the model's output becomes NaN. Use "
            "meta_dtype=torch.bfloat16 (or torch.float32) for this model",
            UserWarning,
            stacklevel=2,
        )


def dequantized(
    kind: str,
    backend: str,
    codes,
    scales,
    zeros,
    count: int,
    group: int,
    bits: int,
    rotation,
    out_dtype: torch.dtype,
    device=None,
) -> torch.Tensor:
    """``count`` packed tokens of ``kind`` ("keys" or "values") as ``[B, H, count, D]`` in ``out_dtype`` (moved to
    ``device`` when given): the backend's dequantize op, then ``@ rotation.T`` when the codes hold rotated tokens
    (``rotation`` ``[D, D]`` float32 or ``None``; dequantized in float32 then, so the rotation back is exact)."""
    work_dtype = out_dtype if rotation is None else torch.float32
    x = kernel(f"dequantize_{kind}", backend)(codes, scales, zeros, count, group, bits, work_dtype)
    return unrotate(x if device is None else x.to(device), rotation, out_dtype)


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


class PackedHistory:
    """The quantized part of one layer's keys or values, on the storage device.

    * ``kind="keys"`` (per-channel, channel-major): codes ``[B, H, D, T/P]``, scales/zeros ``[B, H, D, T/G]``;
    * ``kind="values"`` (per-token): codes ``[B, H, T, D/P]``, scales/zeros ``[B, H, T, D/G]``;

    with ``P = 8 // bits`` codes per byte and ``G`` the group size of that kind (``settings.key_bits`` /
    ``key_group_size`` for keys, ``value_bits`` / ``value_group_size`` for values; see :mod:`kivi_xpu.ops.reference`).
    The codes are written and read by the ``quantize_<kind>`` / ``dequantize_<kind>`` ops of ``backend`` (a name).
    With a rotation (``settings.key_rotation`` / ``value_rotation``), the codes are those of ``x @ Q``
    (:mod:`kivi_xpu.rotation`), and :meth:`dequantize` returns them rotated back.
    """

    def __init__(self, kind: str, settings: KiviSettings, batch: int, heads: int, head_dim: int, device, backend: str):
        if kind == "keys":
            self.bits, self.group_size, self.rotation_name = (
                settings.key_bits,
                settings.key_group_size,
                settings.key_rotation,
            )
        elif kind == "values":
            self.bits, self.group_size = settings.value_bits, settings.value_group_size
            self.rotation_name = settings.value_rotation
        else:
            raise ValueError(f"`kind` must be 'keys' or 'values', got {kind!r}")
        self.kind, self.settings, self.backend = kind, settings, backend
        per, g, r = codes_per_byte(self.bits), self.group_size, settings.residual_length
        if kind == "keys":
            # Token axis last (channel-major); rows are bytes of P tokens (codes) and groups of G tokens (metadata).
            token_dim, self.tokens_per_code_row, self.tokens_per_meta_row = 3, per, g
            code_width, meta_width = head_dim, head_dim
        else:
            token_dim, self.tokens_per_code_row, self.tokens_per_meta_row = 2, 1, 1
            code_width, meta_width = head_dim // per, head_dim // g
        # At least one residual block of tokens (capped: see MIN_GROWTH_TOKENS); size_class grows from there.
        grow_tokens = min(r, MIN_GROWTH_TOKENS)
        code_rows = max(1, grow_tokens // self.tokens_per_code_row)
        meta_rows = max(1, grow_tokens // self.tokens_per_meta_row)
        self.codes = TokenBuffer(batch, heads, code_width, torch.uint8, device, code_rows, token_dim)
        self.scales = TokenBuffer(batch, heads, meta_width, settings.meta_dtype, device, meta_rows, token_dim)
        self.zeros = TokenBuffer(batch, heads, meta_width, settings.meta_dtype, device, meta_rows, token_dim)
        self.head_dim, self.num_tokens = head_dim, 0

    @property
    def device(self) -> torch.device:
        return self.codes.device

    def rotation(self, device) -> torch.Tensor | None:
        """The rotation ``Q [D, D]`` float32 on ``device`` (``None`` without one): a shared matrix, kept outside the
        cache (so it is neither copied with it nor counted as its memory)."""
        return rotation_matrix(self.rotation_name, self.head_dim, device)

    def buffers(self) -> tuple[TokenBuffer, ...]:
        return self.codes, self.scales, self.zeros

    def append(self, x: torch.Tensor) -> None:
        """Quantizes and appends ``x [B, H, n, D]`` (for keys, ``n`` is a multiple of the group size)."""
        n, rotation = x.shape[2], None
        if self.kind == "values":
            # Straight into the storage rows, rotated by the op itself: one op call and no temporaries for a decode
            # step's departing token.
            x, rotation = x.to(self.device), self.rotation(self.device)
            self.reserve(n)
            codes, scales, zeros = (buf.data for buf in self.buffers())
            quantize = kernel("quantize_values_into", self.backend)
            quantize(x, codes, scales, zeros, self.codes.end, self.group_size, self.bits, rotation)
            self.commit(n)
            # Checked for blocks only (prefill, appends of several tokens): a per-token check would cost a
            # reduction per layer and step, and keys, from the same activations, are checked every R tokens.
            written_scales = self.scales.rows(self.scales.end - n, self.scales.end) if n > 1 else None
        else:
            x = rotate(x, self.rotation(x.device)).to(self.device)  # once per G tokens: not worth folding
            quantize = kernel("quantize_keys", self.backend)
            parts = quantize(x, self.group_size, self.bits, self.settings.meta_dtype)
            for buf, part in zip(self.buffers(), parts, strict=True):
                buf.append(part)
            self.num_tokens += n
            written_scales = parts[1]
        quantized = x.dtype if rotation is None else torch.float32  # values quantize x @ Q in float32
        if written_scales is not None and self.settings.meta_dtype == torch.float16 and quantized != torch.float16:
            warn_on_metadata_overflow(x, written_scales, self.kind, rotation)  # only then can it overflow

    def reserve(self, n: int) -> None:
        """Values: makes token rows ``[num_tokens, num_tokens + n)`` of the storage writable in place, for a writer
        that fills them itself (``quantize_values_into``, ``append_decode_step``) and then calls :meth:`commit`."""
        for buf in self.buffers():
            buf.reserve(n)

    def commit(self, n: int) -> None:
        """Counts the ``n`` value tokens written after :meth:`reserve` as stored."""
        for buf in self.buffers():
            buf.commit(n)
        self.num_tokens += n

    def dequantize(self, out_dtype: torch.dtype, start: int = 0, count: int | None = None) -> torch.Tensor:
        """Stored tokens ``[start, count)`` (default: all) as ``[B, H, count - start, D]``; ``start`` is
        group-aligned for keys."""
        count = self.num_tokens if count is None else count
        codes, scales, zeros = (b.data for b in self.buffers())  # whole buffers: the op reads only what it needs
        if start:
            code_start, meta_start = start // self.tokens_per_code_row, start // self.tokens_per_meta_row
            codes = self.codes.rows(code_start, self.codes.capacity).contiguous()
            scales = self.scales.rows(meta_start, self.scales.capacity).contiguous()
            zeros = self.zeros.rows(meta_start, self.zeros.capacity).contiguous()
        return dequantized(
            self.kind,
            self.backend,
            codes,
            scales,
            zeros,
            count - start,
            self.group_size,
            self.bits,
            self.rotation(self.device),
            out_dtype,
        )

    def truncate(self, num_tokens: int) -> None:
        """Keeps the first ``num_tokens`` tokens (group-aligned for keys)."""
        self.codes.truncate(num_tokens // self.tokens_per_code_row)
        self.scales.truncate(num_tokens // self.tokens_per_meta_row)
        self.zeros.truncate(num_tokens // self.tokens_per_meta_row)
        self.num_tokens = num_tokens

    def select_batch(self, index: torch.Tensor) -> None:
        for buf in self.buffers():
            buf.select_batch(index)

    def nbytes(self) -> tuple[int, int]:
        """(bytes of codes, bytes of scales and zeros) actually holding tokens."""
        return self.codes.nbytes(), self.scales.nbytes() + self.zeros.nbytes()

    def allocated_bytes(self) -> int:
        return sum(b.allocated_bytes() for b in self.buffers())


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
