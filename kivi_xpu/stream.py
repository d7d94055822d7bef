"""One kind (keys or values) of one KIVI cache layer, with the streaming rule applied: :class:`KeyStream` and
:class:`ValueStream` over one template, :class:`KindStream`; and :class:`SteadyRun`, a layer's decode steps in one
native call each while the rule moves the same tokens at every step.

A layer is two streams that receive the same tokens. They differ only in how many of them a split packs
(:meth:`KiviSettings.split <kivi_xpu.algorithm.KiviSettings.split>`, read once per append and never worked out
again), in their window's rows, in their steady plan and in their codec (:mod:`kivi_xpu.codec`), which writes the
packed history (:mod:`kivi_xpu.storage`). A token goes down one way: layer -> stream -> codec -> ops, storage.

Counts have one owner each: a stream owns its ``length``; its buffers own their rows (the sinks and the window their
``start`` / ``end``, the packed history its ``num_tokens``). :meth:`KindStream.commit_step` is the stream's fast path
of a steady step, through the buffers' own ``commit``.
"""

from __future__ import annotations

from collections.abc import Callable
from operator import attrgetter
from typing import ClassVar, NamedTuple

import torch

from .algorithm import KiviSettings, TokenSplit
from .codec import KeyCodec, KindCodec, ValueCodec
from .memory import KiviMemoryReport
from .ops import direct_kernel
from .ops.operands import DecodeInputs, KindOperands
from .storage import DepartedTokens, PackedHistory, TokenBuffer


class StepPlan(NamedTuple):
    """One stream's share of the next steady decode steps (:meth:`KindStream.steady`)."""

    leaving: int  # tokens leaving the window at each step (0 or 1), into packed rows reserved already
    steps: int  # decode steps, this one first, that hold that (the rule, and the rows reserved)
    inference: bool  # whether the buffers written are inference tensors: steady only while inference mode lasts


class KindStream:
    """The ``length`` tokens of one kind held by a layer, in sequence order:

    * ``sinks``: the first ``min(length, S)`` tokens exact (``S = settings.sink_tokens``), ``[B, H, <=S, D]``;
    * ``packed``: the next :meth:`packed_in` ``(split)`` tokens as codes on the storage device, written and read
      by ``codec``;
    * ``window``: the rest exact (the full-precision window, on the model's device);
    * ``departed``: while the layer records its past, exact copies of the tokens that left the window for
      ``packed`` since the last ``forget_departed`` (what an exact :meth:`truncate` needs);
    * ``rotation``: the codec's rotation on the model's device (what attention reads; the process's shared matrix,
      never copied or pickled with the stream).

    ``like [B, H, *, D]`` gives batch, heads, head_dim, dtype and device; ``backend`` names the kernels.
    Subclasses say what differs between the kinds: ``codec_type``, :meth:`window_rows`, ``packed_in``,
    ``steady_appends`` and ``packs_in_steady_steps``.
    """

    codec_type: ClassVar[type[KindCodec]]
    # Tokens of this kind a TokenSplit packs (one of its fields).
    packed_in: ClassVar[Callable[[TokenSplit], int]]
    # (settings, length) -> one-token appends from `length` on, the first included, during which the packed count
    # grows alike (the rule's KiviSettings.steady_key_appends / steady_value_appends).
    steady_appends: ClassVar[Callable[[KiviSettings, int], int]]
    packs_in_steady_steps: ClassVar[bool]  # whether tokens may leave the window during a steady run

    def __init__(self, settings: KiviSettings, like: torch.Tensor, storage_device, backend: str):
        batch, heads, _, head_dim = like.shape
        self.settings = settings
        self.dtype, self.device = like.dtype, like.device
        self.codec = self.codec_type.of(settings, head_dim, backend)
        r = settings.residual_length
        self.sinks = TokenBuffer(batch, heads, head_dim, self.dtype, self.device, bound=settings.sink_tokens)
        self.window = TokenBuffer(batch, heads, head_dim, self.dtype, self.device, bound=self.window_rows(r))
        self.packed = PackedHistory(self.codec.layout(r), batch, heads, storage_device)
        self.departed = DepartedTokens()
        self.length = 0
        self.rotation = self.codec.rotation(self.device)

    # ------------------------------------------------------------------ what differs between the kinds

    @staticmethod
    def window_rows(residual_length: int) -> int:
        """Rows the window grows to (its buffer's bound)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ the template

    @property
    def kind(self) -> str:
        return self.codec.kind

    @property
    def batch(self) -> int:
        return self.window.batch

    @property
    def heads(self) -> int:
        return self.window.heads

    @property
    def head_dim(self) -> int:
        return self.window.width

    def operands(self, sinks: torch.Tensor, count: int, tail: torch.Tensor | None) -> KindOperands:
        """What attention reads: ``sinks``, the first ``count`` packed tokens (the whole buffers: the op reads only
        ``count``) and the exact ``tail``."""
        packed, codec = self.packed, self.codec
        return KindOperands(sinks, packed.codes.data, packed.scales.data, packed.zeros.data, count, codec.group,
                            codec.bits, tail, self.rotation)  # fmt: skip

    def held(self) -> KindOperands:
        """All ``length`` tokens as attention reads them: the sinks, the whole packed history and the window as the
        tail (:meth:`dense` gives them dense)."""
        return self.operands(self.sinks.view(), self.packed.num_tokens, self.window.view())

    def dense(self) -> torch.Tensor:
        """All ``length`` tokens dense, ``[B, H, length, D]`` (a new tensor: the history dequantized)."""
        return self.codec.dense(self.held(), self.codec.backend)

    def append(self, new: torch.Tensor, record: bool) -> None:
        """Appends ``new [B, H, m, D]``: the first tokens of the sequence fill the sinks, then exactly the tokens
        the rule says must leave the window are quantized (oldest first); with ``record``, exact copies of them
        are kept. Tokens that leave at once go straight to the packed store, so a long prefill never passes
        through (and never inflates) the window."""
        self._append(new, self.settings.split(self.length + new.shape[2]), record)

    def append_and_read(self, new: torch.Tensor, record: bool) -> tuple[torch.Tensor, KindOperands]:
        """Appends ``new [B, H, m, D]`` (as :meth:`append`) and returns what attention reads for it: the exact tail
        ``[window | new]``, which still holds the tokens this append just quantized (attention reads them exact, as
        the dense path does), and the operands without it (the sinks, the history packed before this append).

        A decode step (sinks full, ``m <= R``) appends into the window first and hands out a view of it: no copy
        of the window. The view stays valid until the next append (the rows it shows are only moved or
        overwritten then)."""
        m = new.shape[2]
        after = self.settings.split(self.length + m)
        count, sinks = self.packed.num_tokens, self.sinks.view()  # as before this append
        if self.length < self.settings.sink_tokens or m > self.settings.residual_length:
            # Tokens of `new` bound for the sinks are in the tail, which is in order: the window is empty until
            # the sinks are full.
            tail = torch.cat([self.window.view(), new], dim=2)
            self._append(new, after, record)
            return tail, self.operands(sinks, count, None)
        self.window.append(new)
        tail = self.window.view()
        self.length = after.length
        leaving = self.packed_in(after) - count
        if leaving:
            self._pack(tail[:, :, :leaving], record)
            self.window.drop_front(leaving)
        return tail, self.operands(sinks, count, None)

    def _append(self, new: torch.Tensor, after: TokenSplit, record: bool) -> None:
        """:meth:`append` once the split ``after`` it is known."""
        to_sinks = after.sinks - len(self.sinks)
        if to_sinks > 0:
            self.sinks.append(new[:, :, :to_sinks])
            new = new[:, :, to_sinks:]
        self.length = after.length
        leaving = max(self.packed_in(after) - self.packed.num_tokens, 0)
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

    def _pack(self, block: torch.Tensor, record: bool) -> None:
        self.codec.pack(self.packed, block)
        if record:  # an exact copy (the window rows will be overwritten)
            self.departed.append(block.to(self.dtype, copy=True))

    def steady(self) -> StepPlan | None:
        """Prepares the one-call decode steps (:class:`SteadyRun`) of one new token each: makes room for the next in
        the window and, when tokens leave it at every step, for them in the packed storage. ``None`` when this
        append needs :meth:`append_and_read`: sinks not full yet, or tokens leaving a stream that packs none in
        steady steps (a key block, once every R steps)."""
        settings, length = self.settings, self.length
        if length < settings.sink_tokens:
            return None
        leaving = self.packed_in(settings.split(length + 1)) - self.packed.num_tokens
        if leaving and not self.packs_in_steady_steps:
            return None
        steps = self.steady_appends(settings, length)
        self.window.reserve(1)
        if leaving:
            self.packed.reserve(leaving)
        # Steps, this one first, that move `leaving` tokens each (the rule) into rows reserved already, so that the
        # buffers they write hold that many more rows without moving or growing. Buffers made under
        # torch.inference_mode refuse in-place writes outside it (TokenBuffer.reserve copies them then): their steps
        # are steady only while it lasts.
        window, packed = self.window, self.packed
        written = (window, *packed.buffers()) if leaving else (window,)
        inference = any(b.data.is_inference() for b in written)
        steps = min(steps, window.capacity - window.end)
        if leaving:  # (token-major rows: one per token)
            steps = min(steps, *((b.capacity - b.end) // leaving for b in packed.buffers()))
        return StepPlan(leaving, steps, inference)

    def commit_step(self, leaving: int) -> None:
        """The owner's fast path of a steady decode step, which ``append_decode_step`` wrote in place: one token
        joined the window and ``leaving`` tokens left it for the packed rows :meth:`steady` reserved."""
        self.window.commit(1)
        if leaving:
            self.window.drop_front(leaving)
            self.packed.commit(leaving)
        self.length += 1

    def truncate(self, length: int) -> None:
        """Keeps the first ``length`` tokens, split as the rule splits ``length`` tokens. Tokens that return to
        the window are restored exactly when recorded in ``departed``, otherwise dequantized from their codes
        (from the rule's count on, which is group-aligned for keys: keys are read in whole groups)."""
        split = self.settings.split(length)
        self.sinks.truncate(split.sinks)
        after_sinks = length - split.sinks
        target, quantized = self.packed_in(split), self.packed.num_tokens
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
            restored = self.codec.unpack(self.packed, self.dtype, start=target, count=exact_from)
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

    def __getstate__(self) -> dict:
        return {**self.__dict__, "rotation": None}  # the shared matrix, resolved again on load

    def __setstate__(self, state: dict) -> None:
        """Also reads the pickles of kivi-xpu <= 0.3 (bc2f283): one ``KindStream`` class that named its kind, its
        packed history holding what the codec now holds (see :meth:`PackedHistory.__setstate__
        <kivi_xpu.storage.PackedHistory.__setstate__>`)."""
        state = dict(state)
        if "codec" not in state:
            self.__class__ = STREAM_OF_KIND[state.pop("kind")]
            old = state["packed"].__dict__.pop("legacy")
            state["codec"] = self.codec_type.of(old["settings"], old["head_dim"], old["backend"])
        self.__dict__.update(state)
        self.rotation = self.codec.rotation(self.device)


class KeyStream(KindStream):
    """Keys: the window holds fewer than R tokens; a block of R leaves it at once, packed per channel (the general
    path: steady runs never pack keys)."""

    codec_type = KeyCodec
    packs_in_steady_steps = False

    @staticmethod
    def window_rows(residual_length: int) -> int:
        return residual_length

    packed_in = attrgetter("packed_keys")
    steady_appends = staticmethod(KiviSettings.steady_key_appends)


class ValueStream(KindStream):
    """Values: the window is a FIFO of R tokens; once full, the oldest leaves it at every step, packed per token
    (inside steady runs, by ``append_decode_step``)."""

    codec_type = ValueCodec
    packs_in_steady_steps = True

    @staticmethod
    def window_rows(residual_length: int) -> int:
        # The FIFO holds R and one more during a decode step. Its R / 4 spare rows let it move its live rows back to
        # the front once every R / 4 steps (R rows copied: under 1 % of a step's reads of the history at 4k tokens)
        # instead of reserving R more.
        return residual_length + max(1, residual_length // 4)

    packed_in = attrgetter("packed_values")
    steady_appends = staticmethod(KiviSettings.steady_value_appends)


STREAM_OF_KIND = {"keys": KeyStream, "values": ValueStream}  # the kinds' names in pickles of kivi-xpu <= 0.3


class SteadyRun:
    """The one-call decode steps of a layer's streams while both are steady (:meth:`KindStream.steady`: no key
    leaves the window, ``leaving`` value tokens leave it at every step, into rows the buffers already hold): each
    step appends one token to both windows and packs ``leaving`` value tokens in one call of ``kernel`` (the
    ``append_decode_step`` op), then counts that in the streams (:meth:`KindStream.commit_step`).

    The run plans its steps itself (:meth:`_plan`) when its budget is out: ``key_steps`` and ``value_steps``, the
    steps each stream's :class:`StepPlan` holds; the plan left to one stream is kept, so its rule is not looked at
    again. The layer keeps the run between steps and drops it whenever anything else changes its streams.

    A plan resolves the kernel's operands by name, and the operands it hands to attention, so that a step costs a
    few attribute reads instead of a dozen Python calls: in the model, where the weights of the other layers pass
    through the caches between two steps of a layer, each such call costs as much as the step's own work. The run
    holds the layer's buffers: hence the layer drops it on any other change."""

    __slots__ = ("keys", "values", "backend", "kernel", "leaving", "key_steps", "value_steps", "key_inference",
                 "value_inference", "inference", "key_rows", "value_rows", "value_codes", "value_scales",
                 "value_zeros", "value_group", "value_bits", "value_fit", "storage_rotation", "key_operands",
                 "value_operands")  # fmt: skip

    def __init__(self, keys: KeyStream, values: ValueStream, backend: str):
        self.keys, self.values, self.backend = keys, values, backend
        self.kernel = direct_kernel("append_decode_step", backend, keys.window.data)
        self._forget()

    def _forget(self) -> None:
        """No plan, and no reference to a buffer (an append on the general path may replace them)."""
        self.key_steps = self.value_steps = self.leaving = 0
        self.key_inference = self.value_inference = self.inference = False
        self.key_operands = self.value_operands = self.key_rows = self.value_rows = None
        self.value_codes = self.value_scales = self.value_zeros = self.storage_rotation = None

    def decode(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple:
        """One decode step of one token ``[B, H, 1, D]`` of each kind, not recorded: :meth:`step`, or the general
        path (:func:`append_and_read`) when no plan holds, after which the run plans again. Returns the key and value
        tails and the :class:`~kivi_xpu.ops.operands.DecodeInputs` without them."""
        step = self.step(key_states, value_states)
        if step is None:
            self._forget()
            step = append_and_read(self.keys, self.values, key_states, value_states, False, self.backend)
        return step

    def step(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple | None:
        """Appends one token ``[B, H, 1, D]`` of each kind; returns the key and value tails (views of the windows)
        and the :class:`~kivi_xpu.ops.operands.DecodeInputs` (of ``backend``) without them, or ``None`` (nothing
        done) when this step needs the general path (:meth:`KindStream.append_and_read`)."""
        if not (self.key_steps and self.value_steps) or (self.inference and not torch.is_inference_mode_enabled()):
            if not self._plan():
                return None
        keys, values, leaving = self.keys, self.values, self.leaving
        key_window, value_window = keys.window, values.window
        key_count, value_count = keys.packed.num_tokens, values.packed.num_tokens  # as before this append
        key_tail, value_tail = self.kernel(
            key_states, value_states,
            self.key_rows, key_window.start, key_window.end,
            self.value_rows, value_window.start, value_window.end,
            self.value_codes, self.value_scales, self.value_zeros, value_count,
            leaving, self.value_group, self.value_bits, self.storage_rotation, self.value_fit,
        )  # fmt: skip
        keys.commit_step(0)
        values.commit_step(leaving)
        self.key_steps -= 1
        self.value_steps -= 1
        inputs = DecodeInputs(
            self.key_operands.with_count(key_count, keys.rotation),
            self.value_operands.with_count(value_count, values.rotation),
            self.backend,
        )
        return key_tail, value_tail, inputs

    def _plan(self) -> bool:
        """Plans the next steps; False when the next step needs the general path (sinks not full, a key block
        leaving)."""
        key_plan = self._left(0, self.key_steps, self.key_inference) or self.keys.steady()
        if key_plan is None:
            return False
        value_plan = self._left(self.leaving, self.value_steps, self.value_inference) or self.values.steady()
        if value_plan is None:
            return False
        keys, values = self.keys, self.values
        self.key_steps, self.key_inference = key_plan.steps, key_plan.inference
        self.leaving, self.value_steps, self.value_inference = value_plan
        self.inference = self.key_inference or self.value_inference
        # append_decode_step's operands that stay while the plan holds (the buffers neither move nor grow)
        packed, codec = values.packed, values.codec
        self.key_rows, self.value_rows = keys.window.data, values.window.data
        self.value_codes, self.value_scales, self.value_zeros = packed.codes.data, packed.scales.data, packed.zeros.data
        self.value_group, self.value_bits, self.value_fit = codec.group, codec.bits, codec.fit
        self.storage_rotation = codec.rotation(packed.device)
        # What attention reads, but the counts and tails: rebuilt only when a buffer changed since the last plan (a
        # view costs as much dispatch as a step's own work).
        self.key_operands = self._kept(keys, self.key_operands)
        self.value_operands = self._kept(values, self.value_operands)
        return True

    @staticmethod
    def _left(leaving: int, steps: int, inference: bool) -> StepPlan | None:
        """A stream's plan left in this run, or ``None``."""
        if not steps or (inference and not torch.is_inference_mode_enabled()):
            return None
        return StepPlan(leaving, steps, inference)

    @staticmethod
    def _kept(stream: KindStream, kept: KindOperands | None) -> KindOperands:
        """``stream``'s operands with its sinks, no count, no tail and no rotation: ``kept`` when it still shows the
        stream's buffers."""
        packed = stream.packed
        if (
            kept is None
            or kept.codes is not packed.codes.data
            or kept.scales is not packed.scales.data
            or kept.zeros is not packed.zeros.data
        ):
            kept = stream.operands(stream.sinks.view(), 0, None)._replace(rotation=None)
        return kept


def append_and_read(keys: KeyStream, values: ValueStream, key_states: torch.Tensor, value_states: torch.Tensor,
                    record: bool, backend: str) -> tuple[torch.Tensor, torch.Tensor, DecodeInputs]:  # fmt: skip
    """A layer's append of ``key_states`` / ``value_states [B, H, m, D]`` on the general path
    (:meth:`KindStream.append_and_read` of both streams): the key and value tails and the
    :class:`~kivi_xpu.ops.operands.DecodeInputs` of ``backend`` without them."""
    key_tail, key_operands = keys.append_and_read(key_states, record)
    value_tail, value_operands = values.append_and_read(value_states, record)
    return key_tail, value_tail, DecodeInputs(key_operands, value_operands, backend)
