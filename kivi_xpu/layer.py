"""One attention layer's KIVI cache: :class:`KiviLayer`, the transformers ``CacheLayerMixin`` protocol over a
:class:`~kivi_xpu.stream.KeyStream` and a :class:`~kivi_xpu.stream.ValueStream`."""

from __future__ import annotations

import torch
from transformers.cache_utils import CacheLayerMixin

from .algorithm import KiviSettings
from .attention.hand_over import hand_over
from .attention.path import fuses, log_attention_path
from .backend import Selection, select
from .codec import dense_states
from .memory import KiviMemoryReport
from .ops.checks import check_float_tensor
from .storage import STORAGE_FORMAT
from .stream import KeyStream, KindStream, SteadyRun, ValueStream, append_and_read
from .validation import integer, name_choice

ATTENTION_MODES = ("auto", "dense")


class KiviLayer(CacheLayerMixin):
    """One attention layer's KIVI cache: transformers' layer protocol over two :class:`~kivi_xpu.stream.KindStream`
    (``keys_stream`` a :class:`~kivi_xpu.stream.KeyStream`, ``values_stream`` a :class:`~kivi_xpu.stream.ValueStream`;
    ``None`` until the first ``update``), which split the tokens into exact
    sinks, packed history and exact window by the rule of :mod:`kivi_xpu.algorithm`. The mixin's ``keys`` /
    ``values`` (the dense tensors of transformers' own layers) are read-only properties here: dense
    ``[B, H_kv, n, D]`` computed at each access (see :attr:`keys`), never stored.

    ``update`` returns dense ``[B, H_kv, n, D]`` keys and values ``[sinks | dequantized history | exact tail]`` for
    attention implementations that need them (the history dequantized into a temporary, never kept). Under the
    fused KIVI attention it returns only the exact tails and hands a :class:`~kivi_xpu.ops.operands.DecodeInputs` to
    the attention call, which reads the sinks, the packed history in place and the tails.

    ``settings`` (a :class:`~kivi_xpu.KiviSettings`) is this layer's configuration (per-layer overrides applied;
    a ``meta_dtype`` of ``None`` is resolved for the model's dtype at the first update);
    ``backend`` the :class:`~kivi_xpu.backend.Selection` whose kernels (by name) read and write the codes: from the
    first update on, those of the layer's device (:meth:`~kivi_xpu.backend.Selection.for_device`).

    Rollback: while ``record_past`` is True (``activate_past_recording()``, as transformers' assisted decoding
    does), the layer also keeps exact copies of the tokens that left the full-precision windows since the last
    ``crop``; a ``crop`` that removes no more than the tokens appended since the previous ``crop`` then leaves the
    layer bit-identical to one that never received the removed tokens (``is_croppable`` is True exactly while
    recording). Every ``crop`` (including ``crop(0)``) releases those copies.
    """

    is_sliding = False
    is_compileable = False
    _logged_path = None  # whether the attention path last logged for this layer was fused (log_attention_path)

    def __init__(
        self,
        settings: KiviSettings | None = None,
        backend: Selection | str | None = None,
        attention: str = "auto",
        model_config=None,
    ):
        # (not CacheLayerMixin.__init__, which assigns the read-only `keys` / `values`)
        self.is_initialized = False
        name_choice(attention, "attention", ATTENTION_MODES)
        if settings is not None and not isinstance(settings, KiviSettings):
            raise TypeError(f"`settings` must be a KiviSettings or None, got {type(settings).__name__}")
        if backend is not None and not isinstance(backend, Selection | str):
            raise TypeError(f"`backend` must be a backend name, a kivi_xpu.backend.select(...) result or None, got "
                            f"{type(backend).__name__}")  # fmt: skip
        self.settings = settings if settings is not None else KiviSettings()
        self._given_settings = self.settings  # `settings` is this, `meta_dtype` resolved, from the first update on
        # The backend asked for; `backend` becomes the kernels of the layer's device at the first update (the
        # device rule, Selection.for_device).
        self.requested_backend = backend if isinstance(backend, Selection) else select(backend)
        self.backend = self.requested_backend
        # "auto": fused when kivi_xpu.attention.attention_path says so for `model_config` (read at every update, so
        # it follows `model.set_attn_implementation`); "dense": always return dense keys/values. `attention_seen`:
        # whether the model's attention has read this layer through a kivi_xpu attention function.
        self.attention, self.model_config, self.attention_seen = attention, model_config, False
        self.keys_stream: KeyStream | None = None
        self.values_stream: ValueStream | None = None
        self._record_past = False
        self._checked_states = None  # see update
        self._steady_run: SteadyRun | None = None  # see _steady_step; dropped by every other change of the streams

    def __repr__(self) -> str:
        s = self.settings
        return (
            f"KiviLayer(key_bits={s.key_bits}, value_bits={s.value_bits}, key_group_size={s.key_group_size}, "
            f"value_group_size={s.value_group_size}, residual_length={s.residual_length}, sink_tokens={s.sink_tokens}, "
            + (
                f"rotation={s.key_rotation}, "
                if s.key_rotation == s.value_rotation
                else f"key_rotation={s.key_rotation}, value_rotation={s.value_rotation}, "
            )
            + f"fit={s.fit})"
        )

    def _streams(self) -> tuple[KindStream, ...]:
        """(keys, values) streams, or () before the first update."""
        return () if self.keys_stream is None else (self.keys_stream, self.values_stream)

    @property
    def keys(self) -> torch.Tensor | None:
        """The keys held, dense ``[B, H_kv, n, D]`` in the model's dtype on the layer's device (``None`` before the
        first update), as transformers' layers expose them: exact sinks and window, the packed history
        dequantized. Computed at each access (a dequantization of the whole history, as the dense path does per
        step) and never kept; writing into it does not change the cache."""
        return None if self.keys_stream is None else self.keys_stream.dense()

    @property
    def values(self) -> torch.Tensor | None:
        """The values held, dense ``[B, H_kv, n, D]``; computed at each access like :attr:`keys`."""
        return None if self.values_stream is None else self.values_stream.dense()

    @property
    def cumulative_length(self) -> int:
        """Tokens held (each stream holds them all)."""
        return 0 if self.keys_stream is None else self.keys_stream.length

    @property
    def record_past(self) -> bool:
        """Whether the layer keeps exact copies of newly quantized tokens for an exact ``crop`` (see the class doc).
        Setting it to False releases those copies."""
        return self._record_past

    @record_past.setter
    def record_past(self, value: bool) -> None:
        self._record_past = bool(value)
        if not value:
            for stream in self._streams():
                stream.forget_departed()

    def activate_past_recording(self) -> None:
        """Called by transformers before speculative steps that it may roll back with ``crop``."""
        self.record_past = True

    @property
    def is_croppable(self) -> bool:
        """``crop`` leaves no trace exactly while recording: otherwise restoring already-quantized tokens
        from their codes keeps their quantization error."""
        return self.record_past

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.settings = self._given_settings.for_model_dtype(self.dtype)
        self.settings.check_head_dim(key_states.shape[-1], "keys")
        self.settings.check_head_dim(value_states.shape[-1], "values")
        self.backend = self.requested_backend.for_device(self.device)
        storage, name = self.backend.storage_device(self.device), self.backend.name
        self.keys_stream = KeyStream(self.settings, key_states, storage, name)
        self.values_stream = ValueStream(self.settings, value_states, storage, name)
        self.is_initialized = True

    @property
    def fused(self) -> bool:
        """Whether the model reads this layer through the fused KIVI attention: under ``attn_implementation="kivi"``,
        or transformers' default attention once the model's attention has read this layer through kivi_xpu's
        function (:func:`kivi_xpu.attention.attention_path`). Read from ``model_config``, which that function sets to
        the model's own config at its first call when the cache was built without it (or with another config
        object)."""
        return self.attention == "auto" and fuses(self.model_config, self.attention_seen)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Appends ``key_states``/``value_states`` ``[B, H_kv, m, D]`` and returns what attention should read:
        dense ``[B, H_kv, n, D]`` keys and values (``n`` = tokens held after the update), or, when the model uses
        the fused KIVI attention, only the full-precision tails (handing the rest over to that attention call)."""
        k, v = key_states, value_states
        # A clear error for states the layer cannot append, instead of a shape error deep inside the buffers or a
        # layer whose keys and values silently fall out of step. States like the last ones that passed (same type,
        # shapes, dtypes, devices: every decode step) pass at once.
        plain = type(k) is type(v) is torch.Tensor
        signature = (k.shape, v.shape, k.dtype, v.dtype, k.device, v.device) if plain else None
        if signature is None or signature != self._checked_states:
            self._check_new_states(k, v)
            self._checked_states = signature
        one_call = k.shape[2] == 1 and not self._record_past and self.cumulative_length  # a decode step
        step = self._steady_step(k, v) if one_call else None
        keys_out, values_out, inputs = step if step is not None else self._append(k, v)
        if inputs is not None:
            fused = self.fused
            if fused is not self._logged_path:
                log_attention_path(self)
                self._logged_path = fused
            if not fused:
                (keys_out, values_out), inputs = dense_states(inputs.with_tails(keys_out, values_out)), None
        if self.attention == "auto":  # (also when dense: the kivi attention then tells the layer to fuse)
            hand_over(self, keys_out, values_out, inputs)
        return keys_out, values_out

    def _steady_step(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple | None:
        """A decode step's cache work (one new token, not recording) by the layer's
        :class:`~kivi_xpu.stream.SteadyRun` (made at the first such step, kept for the next ones): one
        ``append_decode_step`` call while its plan holds, the general path otherwise. Returns the key and value tails
        and the :class:`~kivi_xpu.ops.operands.DecodeInputs` without them (``update`` takes the general path itself
        where this gives ``None``)."""
        run = self._steady_run
        if run is None:
            run = self._steady_run = SteadyRun(self.keys_stream, self.values_stream, self.backend.name)
        return run.decode(key_states, value_states)

    def _append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple:
        """``update`` on the general path: returns the key and value tails (the states themselves for a prefill)
        and the :class:`~kivi_xpu.ops.operands.DecodeInputs` without them (``None`` for a prefill, which attends to
        the exact states)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._steady_run = None  # (it must not keep a buffer alive that this append replaces)
        if self.cumulative_length == 0:
            self.keys_stream.append(key_states, self.record_past)
            self.values_stream.append(value_states, self.record_past)
            return key_states, value_states, None
        return append_and_read(self.keys_stream, self.values_stream, key_states, value_states, self.record_past,
                               self.backend.name)  # fmt: skip

    def _check_new_states(self, key_states, value_states) -> None:
        check_float_tensor(key_states, "key_states")
        check_float_tensor(value_states, "value_states")
        k, v = key_states, value_states
        if k.shape[:3] != v.shape[:3] or k.dtype != v.dtype or k.device != v.device:
            raise ValueError(
                "`key_states` and `value_states` must share batch, kv_heads, tokens, dtype and device; got "
                f"{tuple(k.shape)} {k.dtype} on {k.device} and {tuple(v.shape)} {v.dtype} on {v.device}"
            )
        if not self.is_initialized:
            return
        keys, values = self.keys_stream, self.values_stream
        held = (keys.batch, keys.heads, keys.head_dim, values.head_dim)
        got = (k.shape[0], k.shape[1], k.shape[3], v.shape[3])
        if got != held or k.dtype != self.dtype or k.device != self.device:
            raise ValueError(
                f"this layer holds states of batch {held[0]}, {held[1]} kv heads, head_dim {held[2]}/{held[3]} "
                f"(keys/values), {self.dtype} on {self.device}; got batch {got[0]}, {got[1]} kv heads, head_dim "
                f"{got[2]}/{got[3]}, {k.dtype} on {k.device}: call cache.reset() before changing them"
            )

    def __getstate__(self) -> dict:
        """Copies and pickles leave out the steady run (it holds a function of the native extension; the next decode
        step builds it again) and carry the layout of the packed history (``storage.STORAGE_FORMAT``)."""
        return {**self.__dict__, "_steady_run": None, "storage_format": STORAGE_FORMAT}

    def __setstate__(self, state: dict) -> None:
        state = dict(state)
        saved = state.pop("storage_format", 1)  # pickles made before the format was recorded: format 1
        if saved != STORAGE_FORMAT:
            raise ValueError(
                f"KiviLayer: this cache was saved with packed storage format {saved!r}; this kivi-xpu reads format "
                f"{STORAGE_FORMAT} only: load it with the kivi-xpu that saved it, or rebuild the cache from the prompt"
            )
        self.__dict__.update(state)

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cumulative_length + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        """Drops every stored token; the next ``update`` starts from scratch (shapes may change)."""
        self.is_initialized = False
        self.keys_stream = self.values_stream = None
        self._checked_states = self._steady_run = None

    def crop(self, tokens_to_remove: int) -> None:
        """Removes the last ``-tokens_to_remove`` tokens (transformers 5 passes a negative count).

        Afterwards the counts of sinks, quantized and full-precision tokens are exactly those of a cache that had
        never held the removed tokens. Tokens that return to the full-precision windows are restored exactly when
        the layer recorded them (``record_past``, for tokens quantized since the previous ``crop``), otherwise from
        their codes (keeping their quantization error). Every call, ``crop(0)`` included, releases the recorded
        copies.
        """
        tokens_to_remove = integer(tokens_to_remove, "crop(tokens_to_remove)")  # also numpy / 0-d tensor integers
        if tokens_to_remove > 0:
            raise ValueError(
                f"`crop` takes a negative number of tokens to remove (transformers >= 5), got {tokens_to_remove}"
            )
        length = max(0, self.cumulative_length + tokens_to_remove)
        self._steady_run = None
        for stream in self._streams():
            if tokens_to_remove < 0:
                stream.truncate(length)
            stream.forget_departed()

    def _select_batch(self, index: torch.Tensor) -> None:
        self._checked_states = self._steady_run = None  # (the batch may change; the buffers do)
        for stream in self._streams():
            stream.select_batch(index)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: reorders every stored tensor (codes included) along the batch."""
        self._select_batch(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self._select_batch(torch.arange(self.keys_stream.batch).repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select_batch(torch.as_tensor(indices, dtype=torch.long))

    def offload(self):
        raise NotImplementedError("KiviCache does not support offloading: its history is already compressed")

    def prefetch(self):
        raise NotImplementedError("KiviCache does not support offloading: its history is already compressed")

    def memory_report(self) -> KiviMemoryReport:
        """Bytes of this layer; ``residual_bytes`` counts the exact sinks and windows, ``allocated_bytes`` also the
        copies kept for an exact rollback while recording."""
        report = KiviMemoryReport()
        for stream in self._streams():
            report = report + stream.memory_report()
        return report
