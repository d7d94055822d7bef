""":class:`KindStream`: one kind (keys or values) of one KIVI cache layer, with the streaming rule applied.

A layer is two streams that receive the same tokens; the streams differ only in how many of them are packed
(:meth:`KiviSettings.split <kivi_xpu.algorithm.KiviSettings.split>`, read here and never worked out again) and in
the layout of the codes (:class:`~kivi_xpu.storage.PackedHistory`).

A token goes down one way: the layer asks a stream (:meth:`KindStream.append_and_read`) or, for a steady decode
step, a :class:`SteadyRun` of both streams; those write the storage (:mod:`kivi_xpu.storage`), which calls the ops.
"""

from __future__ import annotations

import torch

from .algorithm import KiviSettings
from .attention import DecodeInputs
from .memory import KiviMemoryReport
from .ops import direct_kernel
from .ops.operands import KindOperands
from .storage import DepartedTokens, PackedHistory, TokenBuffer

KINDS = ("keys", "values")


class KindStream:
    """The ``length`` tokens of one kind held by a layer, in sequence order:

    * ``sinks``: the first ``min(length, S)`` tokens exact (``S = settings.sink_tokens``), ``[B, H, <=S, D]``;
    * ``packed``: the next ``packed_count(length)`` tokens as codes on the storage device;
    * ``window``: the rest exact (the full-precision window, on the model's device);
    * ``departed``: while the layer records its past, exact copies of the tokens that left the window for
      ``packed`` since the last ``forget_departed`` (what an exact :meth:`truncate` needs).

    ``like [B, H, *, D]`` gives batch, heads, head_dim, dtype and device; ``backend`` names the kernels.
    """

    def __init__(self, kind: str, settings: KiviSettings, like: torch.Tensor, storage_device, backend: str):
        if kind not in KINDS:
            raise ValueError(f"`kind` must be one of {KINDS}, got {kind!r}")
        batch, heads, _, head_dim = like.shape
        self.kind, self.settings = kind, settings
        self.dtype, self.device = like.dtype, like.device
        r = settings.residual_length
        # The key window holds < R tokens; the value FIFO holds R and one more during a decode step. Its R / 4 spare
        # rows let it move its live rows back to the front once every R / 4 steps (R rows copied: under 1 % of a step's
        # reads of the history at 4k tokens) instead of reserving R more. Both grow with the tokens held up to that.
        window_rows = r if kind == "keys" else r + max(1, r // 4)
        self.sinks = TokenBuffer(batch, heads, head_dim, self.dtype, self.device, bound=settings.sink_tokens)
        self.window = TokenBuffer(batch, heads, head_dim, self.dtype, self.device, bound=window_rows)
        self.packed = PackedHistory(kind, settings, batch, heads, head_dim, storage_device, backend)
        self.departed = DepartedTokens()
        self.length = 0

    @property
    def batch(self) -> int:
        return self.window.batch

    @property
    def heads(self) -> int:
        return self.window.heads

    @property
    def head_dim(self) -> int:
        return self.window.width

    def packed_count(self, length: int) -> int:
        """Tokens held as codes when the stream holds ``length`` tokens (the rule's :class:`TokenSplit`)."""
        return self.settings.split(length).packed(self.kind)

    def operands(self, sinks: torch.Tensor, count: int, tail: torch.Tensor) -> KindOperands:
        """What attention reads: ``sinks``, the first ``count`` packed tokens (the whole buffers: the op reads only
        ``count``) and the exact ``tail``."""
        codes, scales, zeros = (b.data for b in self.packed.buffers())
        packed = self.packed
        rotation = packed.rotation(self.device)
        return KindOperands(sinks, codes, scales, zeros, count, packed.group_size, packed.bits, tail, rotation)

    def append_and_read(self, new: torch.Tensor, record: bool) -> KindOperands:
        """Appends ``new [B, H, m, D]`` (as :meth:`append`) and returns what attention reads for it: the sinks, the
        history packed before this append and the exact tail ``[window | new]``, which still holds the tokens this
        append just quantized (attention reads them exact, as the dense path does).

        A decode step (sinks full, ``m <= R``) appends into the window first and hands out a view of it: no copy
        of the window. The view stays valid until the next append (the rows it shows are only moved or
        overwritten then)."""
        count, sinks = self.packed.num_tokens, self.sinks.view()  # as before this append
        if not self.settings.split(self.length).sinks_full or new.shape[2] > self.settings.residual_length:
            # Tokens of `new` bound for the sinks are in the tail, which is in order: the window is empty until
            # the sinks are full.
            tail = torch.cat([self.window.view(), new], dim=2)
            self.append(new, record)
            return self.operands(sinks, count, tail)
        self.window.append(new)
        tail = self.window.view()
        self.length += new.shape[2]
        leaving = self.packed_count(self.length) - count
        if leaving:
            self._pack(tail[:, :, :leaving], record)
            self.window.drop_front(leaving)
        return self.operands(sinks, count, tail)

    def steady(self) -> tuple[int, int, bool] | None:
        """Prepares the one-call decode steps (:class:`SteadyRun`) of one new token each: makes room for the next in
        the window and, for values, for the token leaving it in the packed storage. Returns ``(leaving, steps,
        inference)``: the tokens leaving the window at each step (0 or 1), for how many steps, this one first, that
        holds (:meth:`_steady_budget`), and whether the buffers written are inference tensors. ``None`` when this
        append needs :meth:`append_and_read`: sinks not full yet, or a key block leaving (packed once every R
        steps)."""
        if not self.settings.split(self.length).sinks_full:
            return None
        leaving = self.packed_count(self.length + 1) - self.packed.num_tokens
        if leaving and self.kind == "keys":
            return None
        self.window.reserve(1)
        if leaving:
            self.packed.reserve(leaving)
        return leaving, *self._steady_budget(leaving)

    def _steady_budget(self, leaving: int) -> tuple[int, bool]:
        """(steps, inference): decode steps, this one first, that move ``leaving`` tokens each (the rule) into rows
        reserved already, so that the buffers they write hold that many more rows without moving or growing; and
        whether those buffers were made under ``torch.inference_mode``, which refuse in-place writes outside it
        (``TokenBuffer.reserve`` copies them then): their steps are steady only while it lasts."""
        window, packed = self.window, self.packed
        written = (window, *packed.buffers()) if leaving else (window,)
        inference = any(b.data.is_inference() for b in written)
        steps = min(self.settings.steady_appends(self.kind, self.length), window.capacity - window.end)
        if leaving:  # (value rows: one per token)
            steps = min(steps, *((b.capacity - b.end) // leaving for b in packed.buffers()))
        return steps, inference

    def held(self) -> KindOperands:
        """All ``length`` tokens as attention reads them: the sinks, the whole packed history and the window as the
        tail (``attention.dense_kind`` of it gives them dense)."""
        return self.operands(self.sinks.view(), self.packed.num_tokens, self.window.view())

    def _pack(self, block: torch.Tensor, record: bool) -> None:
        self.packed.append(block)
        if record:  # an exact copy (the window rows will be overwritten)
            self.departed.append(block.to(self.dtype, copy=True))

    def append(self, new: torch.Tensor, record: bool) -> None:
        """Appends ``new [B, H, m, D]``: the first tokens of the sequence fill the sinks, then exactly the tokens
        the rule says must leave the window are quantized (oldest first); with ``record``, exact copies of them
        are kept. Tokens that leave at once go straight to the packed store, so a long prefill never passes
        through (and never inflates) the window."""
        after = self.settings.split(self.length + new.shape[2])
        to_sinks = after.sinks - len(self.sinks)
        if to_sinks > 0:
            self.sinks.append(new[:, :, :to_sinks])
            new = new[:, :, to_sinks:]
        self.length = after.length
        leaving = max(after.packed(self.kind) - self.packed.num_tokens, 0)
        from_window = min(leaving, len(self.window))
        from_new = leaving - from_window
        if leaving:
            if from_window and from_new:
                block = torch.cat([self.window.view(), new[:, :, :from_new]], dim=2)
            elif from_window:
                block = self.window.view()[:, :, :from_window]
            else:
                block = new[:, :, :from_new]
            self._pack(block, record)
        self.window.drop_front(from_window)
        self.window.append(new[:, :, from_new:])

    def truncate(self, length: int) -> None:
        """Keeps the first ``length`` tokens, split as the rule splits ``length`` tokens. Tokens that return to
        the window are restored exactly when recorded in ``departed``, otherwise dequantized from their codes
        (from the rule's count on, which is group-aligned for keys: keys are read in whole groups)."""
        split = self.settings.split(length)
        self.sinks.truncate(split.sinks)
        after_sinks = length - split.sinks
        target, quantized = split.packed(self.kind), self.packed.num_tokens
        self.length = length
        if target >= quantized:
            self.window.truncate(after_sinks - quantized)
            return
        # Packed tokens [target, end) return to the window: the recorded ones (the last len(departed) packed
        # tokens) exactly, older ones from their codes.
        end = min(after_sinks, quantized)
        recorded_from = quantized - len(self.departed)
        exact_from = max(target, recorded_from)
        window = []
        if target < min(exact_from, end):
            restored = self.packed.dequantize(self.dtype, start=target, count=exact_from)
            window.append(restored[:, :, : min(exact_from, end) - target].to(self.device))
        if end > exact_from:
            window.append(self.departed.tokens(exact_from - recorded_from, end - recorded_from))
        window.append(self.window.view()[:, :, : max(0, after_sinks - quantized)])
        window = torch.cat(window, dim=2)
        self.packed.truncate(target)
        self.window.truncate(0)
        self.window.append(window)

    def forget_departed(self) -> None:
        self.departed.clear()

    def select_batch(self, index: torch.Tensor) -> None:
        """Keeps the batch rows ``index`` of every stored tensor (codes and recorded copies included)."""
        for holder in (self.sinks, self.packed, self.window, self.departed):
            holder.select_batch(index)

    def memory_report(self) -> KiviMemoryReport:
        """Bytes of this stream; ``residual_bytes`` counts the sinks and the window, ``allocated_bytes`` also
        the recorded copies."""
        codes, meta = self.packed.nbytes()
        exact = (self.sinks, self.window)
        allocated = self.packed.allocated_bytes() + sum(b.allocated_bytes() for b in exact)
        element = self.window.data.element_size()
        return KiviMemoryReport(
            tokens=self.length,
            code_bytes=codes,
            meta_bytes=meta,
            residual_bytes=sum(b.nbytes() for b in exact),
            allocated_bytes=allocated + self.departed.allocated_bytes(),
            dense_bytes=self.batch * self.heads * self.head_dim * self.length * element,
        )


class SteadyRun:
    """The one-call decode steps of a layer's ``keys`` and ``values`` streams while both are steady
    (:meth:`KindStream.steady`: no key leaves the window, ``leaving`` value tokens leave it at every step, into rows
    the buffers already hold): each step appends one token to both windows and packs ``leaving`` value tokens in one
    call of ``kernel`` (the ``append_decode_step`` op), and counts that in the streams. The run owns its budget
    (``key_steps``, ``value_steps``: the steps each stream's answer holds); the layer keeps the run between steps,
    asks :meth:`start` for the next one when :meth:`step` gives ``None``, and drops it whenever anything else
    changes its streams.

    The run holds the kernel, its arguments and the operands it hands to attention, so that a step costs a few
    attribute reads instead of a dozen Python calls: in the model, where the weights of the other layers pass
    through the caches between two steps of a layer, each such call costs as much as the step's own work. It holds
    the layer's buffers: hence the layer drops it on any other change."""

    __slots__ = ("keys", "values", "leaving", "kernel", "backend", "args", "keep", "key_steps", "value_steps",
                 "key_inference", "value_inference", "inference")  # fmt: skip

    @classmethod
    def start(cls, keys: KindStream, values: KindStream, backend: str, ended: SteadyRun | None) -> SteadyRun | None:
        """The run of the next decode steps, or ``None`` when the next step needs the general path. ``ended``: the run
        that just ran out (nothing else changed the streams since), whose budget left for one kind still holds: that
        kind's rule is not looked at again."""
        key_plan = cls._left(ended, "key") or keys.steady()
        if key_plan is None or key_plan[0] != 0:
            return None
        value_plan = cls._left(ended, "value") or values.steady()
        if value_plan is None:
            return None
        kernel = direct_kernel("append_decode_step", backend, keys.window.data)
        return cls(keys, values, key_plan, value_plan, kernel, backend, ended)

    @staticmethod
    def _left(run: SteadyRun | None, kind: str) -> tuple[int, int, bool] | None:
        """``kind``'s (leaving, steps, inference) left in ``run``, or ``None``."""
        if run is None or not getattr(run, f"{kind}_steps"):
            return None
        inference = getattr(run, f"{kind}_inference")
        if inference and not torch.is_inference_mode_enabled():
            return None
        return (0 if kind == "key" else run.leaving), getattr(run, f"{kind}_steps"), inference

    def __init__(self, keys: KindStream, values: KindStream, key_plan: tuple, value_plan: tuple, kernel, backend: str,
                 ended: SteadyRun | None = None):  # fmt: skip
        window, packed = keys.window, values.packed
        leaving, self.value_steps, self.value_inference = value_plan
        _, self.key_steps, self.key_inference = key_plan
        self.keys, self.values, self.leaving, self.kernel, self.backend = keys, values, leaving, kernel, backend
        # append_decode_step's arguments; step() fills the states and the row counts
        self.args = [None, None, window.data, 0, 0, values.window.data, 0, 0, *(b.data for b in packed.buffers()), 0,
                     leaving, packed.group_size, packed.bits, packed.rotation(packed.device)]  # fmt: skip
        # The operands without count and tail; rebuilt only when a buffer changed since the ended run (a view costs
        # as much dispatch as a step's own work).
        kept = (None, None) if ended is None else (ended.keep[0], ended.keep[2])
        self.keep = (self._kept(keys, kept[0]), keys.packed.rotation(keys.device),
                     self._kept(values, kept[1]), packed.rotation(values.device))  # fmt: skip
        self.inference = self.key_inference or self.value_inference

    @staticmethod
    def _kept(stream: KindStream, kept: KindOperands | None) -> KindOperands:
        """``stream``'s operands with its sinks, no count, no tail and no rotation (the rotation, shared and not the
        cache's, is never kept): ``kept`` when it still shows the stream's buffers."""
        packed = stream.packed
        if (
            kept is None
            or kept.codes is not packed.codes.data
            or kept.scales is not packed.scales.data
            or kept.zeros is not packed.zeros.data
        ):
            kept = stream.operands(stream.sinks.view(), 0, None)._replace(rotation=None)
        return kept

    def step(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple | None:
        """Appends one token ``[B, H, 1, D]`` of each kind; returns the key and value tails (views of the windows)
        and the :class:`~kivi_xpu.attention.DecodeInputs` (of ``backend``) without them, or ``None`` (nothing done)
        once the run has ended."""
        if not (self.key_steps and self.value_steps):
            return None
        if self.inference and not torch.is_inference_mode_enabled():  # (see KindStream._steady_budget)
            return None
        keys, values, args = self.keys, self.values, self.args
        key_window, value_window, packed = keys.window, values.window, values.packed
        key_count, value_count = keys.packed.num_tokens, packed.num_tokens  # as before this append
        args[0], args[1], args[3], args[4] = key_states, value_states, key_window.start, key_window.end
        args[6], args[7], args[11] = value_window.start, value_window.end, value_count
        try:
            key_tail, value_tail = self.kernel(*args)
        finally:
            args[0] = args[1] = None  # (the run must not keep the states alive)
        key_window.end += 1  # (TokenBuffer.commit, one call less)
        value_window.end += 1
        if self.leaving:
            value_window.drop_front(self.leaving)
            packed.commit(self.leaving)
        keys.length += 1
        values.length += 1
        self.key_steps -= 1
        self.value_steps -= 1
        k, key_rotation, v, value_rotation = self.keep
        inputs = DecodeInputs(
            k.with_count(key_count, key_rotation), v.with_count(value_count, value_rotation), self.backend
        )
        return key_tail, value_tail, inputs
