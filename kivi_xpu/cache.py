"""Transformers glue: :class:`KiviLayer` (one layer's KIVI cache) and :class:`KiviCache` (the ``Cache`` container).

The full-precision residual window stays on the device where the model computes; the packed low-bit
history lives on the storage device chosen by the backend (the SYCL device when the SYCL kernels are used).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from transformers.cache_utils import (
    Cache,
    CacheLayerMixin,
    DummyLayer,
    DynamicSlidingWindowLayer,
    get_layer_types_and_kwargs,
)

from .algorithm import KiviSettings
from .attention import ATTENTION_NAME, FusedStep, attend_tail_and_history, hand_over
from .backend import Selection, select
from .storage import PackedHistory, TokenBuffer


@dataclass
class KiviMemoryReport:
    """Bytes held by a KIVI cache (or one layer of it), against the same tokens stored densely.

    ``code_bytes``, ``meta_bytes`` (scales and zero points) and ``residual_bytes`` (full-precision window)
    count the tokens actually held; ``allocated_bytes`` counts the storage reserved, including spare
    capacity for growth. ``dense_bytes`` is what a ``DynamicCache`` would hold for the same tokens in
    the model dtype.
    """

    tokens: int = 0
    code_bytes: int = 0
    meta_bytes: int = 0
    residual_bytes: int = 0
    allocated_bytes: int = 0
    dense_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        return self.code_bytes + self.meta_bytes + self.residual_bytes

    @property
    def compression_ratio(self) -> float:
        """Dense bytes / KIVI bytes for the tokens held (``inf`` for an empty cache)."""
        return self.dense_bytes / self.total_bytes if self.total_bytes else float("inf")

    def __add__(self, other: KiviMemoryReport) -> KiviMemoryReport:
        summed = {f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)}
        summed["tokens"] = max(self.tokens, other.tokens)  # tokens per layer, not a sum over layers
        return KiviMemoryReport(**summed)

    def __str__(self) -> str:
        mib = 1 << 20
        return (
            f"KIVI cache: {self.tokens} tokens, codes {self.code_bytes / mib:.2f} MiB, scales+zeros "
            f"{self.meta_bytes / mib:.2f} MiB, full-precision residual {self.residual_bytes / mib:.2f} MiB, "
            f"total {self.total_bytes / mib:.2f} MiB (allocated {self.allocated_bytes / mib:.2f} MiB) vs dense "
            f"{self.dense_bytes / mib:.2f} MiB: {self.compression_ratio:.2f}x smaller"
        )


ATTENTION_MODES = ("auto", "dense")


class KiviLayer(CacheLayerMixin):
    """One attention layer's KIVI cache.

    Holds ``n`` tokens as: keys ``[0, R*floor(n/R))`` packed per channel + the rest ``[B, H_kv, n % R, D]`` in
    full precision; values ``[0, max(0, n - R))`` packed per token + the newest ``min(n, R)`` in full
    precision (see :mod:`kivi_xpu.algorithm`). ``update`` returns dense ``[B, H_kv, n, D]`` keys and values
    for attention implementations that need them: the new tokens and the residual window exactly, the
    quantized history dequantized (a temporary, never kept). Under the fused KIVI attention it returns only the
    exact tails and the attention reads the packed history in place (see :mod:`kivi_xpu.attention`).
    """

    is_sliding = False
    is_compileable = False
    # A crop that crosses already-quantized groups restores those tokens from their codes (lossy), so a
    # rollback can leave a trace: not croppable in transformers' strict sense, although `crop` works.
    is_croppable = False

    def __init__(
        self,
        settings: KiviSettings | None = None,
        backend: Selection | None = None,
        attention: str = "auto",
        model_config=None,
    ):
        super().__init__()
        if attention not in ATTENTION_MODES:
            raise ValueError(f"`attention` must be one of {ATTENTION_MODES}, got {attention!r}")
        self.settings = settings if settings is not None else KiviSettings()
        self.backend = backend if backend is not None else select()
        # "auto": fused exactly when `model_config._attn_implementation == "kivi"` (read at every update, so it
        # follows `model.set_attn_implementation`); "dense": always return dense keys/values.
        self.attention, self.model_config = attention, model_config
        self.cumulative_length = 0

    def __repr__(self) -> str:
        s = self.settings
        return f"KiviLayer(bits={s.bits}, group_size={s.group_size}, residual_length={s.residual_length})"

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        batch, heads, _, key_dim = key_states.shape
        value_dim = value_states.shape[-1]
        self.settings.check_head_dim(key_dim)
        self.settings.check_head_dim(value_dim)
        storage = self.backend.storage_device(self.device)
        r = self.settings.residual_length
        self.key_residual = TokenBuffer(batch, heads, key_dim, self.dtype, self.device, min_rows=r)
        self.value_residual = TokenBuffer(batch, heads, value_dim, self.dtype, self.device, min_rows=2 * r)
        kernels = self.backend.kernels
        self.packed_keys = PackedHistory("keys", self.settings, batch, heads, key_dim, storage, kernels)
        self.packed_values = PackedHistory("values", self.settings, batch, heads, value_dim, storage, kernels)
        self.is_initialized = True

    @property
    def fused(self) -> bool:
        """Whether the model reads this layer through the fused KIVI attention (``attn_implementation="kivi"``)."""
        return self.attention == "auto" and getattr(self.model_config, "_attn_implementation", None) == ATTENTION_NAME

    def dense_states(self, step: FusedStep) -> tuple[torch.Tensor, torch.Tensor]:
        """Dense ``[B, H_kv, n, D]`` keys and values of a step: dequantized history (a temporary) + exact tail."""
        out = []
        for packed, count, tail in (
            (self.packed_keys, step.quantized_keys, step.keys_tail),
            (self.packed_values, step.quantized_values, step.values_tail),
        ):
            history = packed.dequantize(self.dtype, count=count).to(self.device) if count else None
            out.append(tail if history is None else torch.cat([history, tail], dim=2))
        return out[0], out[1]

    def fused_attention(self, step: FusedStep, query: torch.Tensor, attention_mask, scaling: float) -> torch.Tensor:
        """Attention of ``query [B, Hq, L, D]`` over this step's tokens straight from the packed history (on the
        storage device) and the exact tail (on the model's device). Returns ``[B, Hq, L, D]``."""
        s, kernels = self.settings, self.backend.kernels

        def key_scores(q):
            codes, scales, zeros = (b.data for b in self.packed_keys.buffers())
            q = q.to(self.packed_keys.device)
            scores = kernels.packed_key_scores(q, codes, scales, zeros, step.quantized_keys, s.group_size, s.bits)
            return scores.to(self.device)

        def value_sum(p):
            codes, scales, zeros = (b.data for b in self.packed_values.buffers())
            p = p.to(self.packed_values.device)
            out = kernels.packed_value_combine(p, codes, scales, zeros, step.quantized_values, s.group_size, s.bits)
            return out.to(self.device)

        return attend_tail_and_history(
            query,
            scaling,
            attention_mask,
            key_scores,
            step.keys_tail,
            step.values_tail,
            value_sum,
            step.quantized_values,
        )

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Appends ``key_states``/``value_states`` ``[B, H_kv, m, D]`` and returns what attention should read:
        dense ``[B, H_kv, n, D]`` keys and values (``n`` = tokens held after the update), or, when the model uses
        the fused KIVI attention, only the full-precision tails (the layer hands itself to that attention call)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.cumulative_length == 0:
            keys_out, values_out = key_states, value_states  # prefill attends to the exact states
        else:
            step = FusedStep(
                self,
                torch.cat([self.key_residual.view(), key_states], dim=2),
                torch.cat([self.value_residual.view(), value_states], dim=2),
                self.packed_keys.num_tokens,
                self.packed_values.num_tokens,
            )
            if self.fused:
                hand_over(step)
                keys_out, values_out = step.keys_tail, step.values_tail
            else:
                keys_out, values_out = self.dense_states(step)
        self.cumulative_length += key_states.shape[2]
        n = self.cumulative_length
        self._store(self.packed_keys, self.key_residual, key_states, self.settings.quantized_key_count(n))
        self._store(self.packed_values, self.value_residual, value_states, self.settings.quantized_value_count(n))
        return keys_out, values_out

    @staticmethod
    def _store(packed: PackedHistory, residual: TokenBuffer, new: torch.Tensor, quantized_target: int) -> None:
        """Appends ``new`` tokens and quantizes exactly what the KIVI rule says must leave the full-precision
        window (oldest first). New tokens that leave at once go straight to the packed store, so a long prefill
        never passes through (and never inflates) the residual buffer."""
        leaving = quantized_target - packed.num_tokens
        from_residual = min(max(leaving, 0), len(residual))
        from_new = max(leaving, 0) - from_residual
        if from_residual and from_new:
            packed.append(torch.cat([residual.view(), new[:, :, :from_new]], dim=2))
        elif from_residual:
            packed.append(residual.view()[:, :, :from_residual])
        elif from_new:
            packed.append(new[:, :, :from_new])
        residual.drop_front(from_residual)
        residual.append(new[:, :, from_new:])

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cumulative_length + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        """Drops every stored token; the next ``update`` starts from scratch (shapes may change)."""
        self.is_initialized = False
        self.cumulative_length = 0
        for name in ("key_residual", "value_residual", "packed_keys", "packed_values"):
            self.__dict__.pop(name, None)

    def crop(self, tokens_to_remove: int) -> None:
        """Removes the last ``-tokens_to_remove`` tokens (transformers 5 passes a negative count).

        Tokens that become part of the full-precision windows again under the KIVI rule, but had already
        been quantized, are restored from their codes: the quantization error they carry stays, and the
        counts of quantized and full-precision tokens are exactly those of a cache that had never held the
        removed tokens.
        """
        if tokens_to_remove > 0:
            raise ValueError(
                f"`crop` takes a negative number of tokens to remove (transformers >= 5), got {tokens_to_remove}"
            )
        if tokens_to_remove == 0 or not self.is_initialized:
            return
        n = max(0, self.cumulative_length + tokens_to_remove)
        self._truncate(self.packed_keys, self.key_residual, self.settings.quantized_key_count(n), n)
        self._truncate(self.packed_values, self.value_residual, self.settings.quantized_value_count(n), n)
        self.cumulative_length = n

    def _truncate(self, packed: PackedHistory, residual: TokenBuffer, target: int, new_length: int) -> None:
        quantized = packed.num_tokens
        if target >= quantized:
            residual.truncate(new_length - quantized)
            return
        # Dequantized from `target` (group-aligned) to the end, then cut: keys can only be read in whole groups.
        restored = packed.dequantize(self.dtype, start=target)[:, :, : min(new_length, quantized) - target]
        kept = residual.view()[:, :, : max(0, new_length - quantized)]
        window = torch.cat([restored.to(self.device), kept], dim=2)
        packed.truncate(target)
        residual.truncate(0)
        residual.append(window)

    def _select_batch(self, index: torch.Tensor) -> None:
        for holder in (self.key_residual, self.value_residual, self.packed_keys, self.packed_values):
            holder.select_batch(index)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: reorders every stored tensor (codes included) along the batch."""
        if self.is_initialized:
            self._select_batch(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            batch = self.key_residual.batch
            self._select_batch(torch.arange(batch).repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self._select_batch(torch.as_tensor(indices, dtype=torch.long))

    def offload(self):
        raise NotImplementedError("KiviCache does not support offloading: its history is already compressed")

    def prefetch(self):
        raise NotImplementedError("KiviCache does not support offloading: its history is already compressed")

    def memory_report(self) -> KiviMemoryReport:
        if not self.is_initialized:
            return KiviMemoryReport()
        report = KiviMemoryReport(tokens=self.cumulative_length)
        for packed, residual in ((self.packed_keys, self.key_residual), (self.packed_values, self.value_residual)):
            codes, meta = packed.nbytes()
            report.code_bytes += codes
            report.meta_bytes += meta
            report.residual_bytes += residual.nbytes()
            report.allocated_bytes += packed.allocated_bytes() + residual.allocated_bytes()
            element = residual.data.element_size()
            report.dense_bytes += residual.batch * residual.heads * residual.width * self.cumulative_length * element
        return report


def _head_dim(config) -> int:
    """head_dim of a (decoder) config, with clear errors when the attention fields KiviCache needs are missing."""
    missing = [f for f in ("num_hidden_layers", "num_attention_heads") if getattr(config, f, None) is None]
    if missing:
        raise ValueError(
            f"`config` ({type(config).__name__}) lacks the attention fields {missing} that KiviCache needs "
            "(num_hidden_layers, num_attention_heads, and head_dim or hidden_size)"
        )
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None)
    if head_dim is None:
        hidden = getattr(config, "hidden_size", None)
        if hidden is None:
            raise ValueError(f"`config` ({type(config).__name__}) has neither `head_dim` nor `hidden_size`")
        head_dim = hidden // heads
    return head_dim


class KiviCache(Cache):
    """A KV cache storing keys and values in ``bits`` bits with the KIVI algorithm.

    Use it like any transformers cache::

        cache = KiviCache(config=model.config, bits=2, group_size=32, residual_length=128)
        model.generate(**inputs, past_key_values=cache)

    Args:
        config: the model config (``model.config``). Layer types come from it: full-attention layers get a
            :class:`KiviLayer`; sliding-window layers keep their small bounded window in full precision
            (``DynamicSlidingWindowLayer``); layers that reuse another layer's cache get ``DummyLayer``.
            Without a config, every layer is a :class:`KiviLayer`, created on first use.
        bits: 2, 4 or 8 bits per stored element.
        group_size: elements per scale/zero group (tokens for keys, channels for values); divides head_dim.
        residual_length: tokens kept in full precision; a multiple of ``group_size``.
        meta_dtype: dtype of the stored scales and zero points (default ``torch.float16``).
        backend: ``"auto"`` (default: ``$KIVI_XPU_BACKEND`` or SYCL kernels when a SYCL device exists, else the
            pure-PyTorch reference with one warning), ``"sycl"`` or ``"reference"``.
        device: SYCL device filter string (e.g. ``"opencl:cpu"``, ``"level_zero:gpu"``), default
            ``$KIVI_XPU_DEVICE`` or the first GPU (with an XPU build of torch), else the first CPU device.
        attention: ``"auto"`` (default): the layers hand the packed history to the fused KIVI attention when the
            model runs with ``attn_implementation="kivi"`` (see :func:`kivi_xpu.use_fused_attention`), and return
            dense keys/values to any other attention; ``"dense"`` always returns dense keys/values.
    """

    def __init__(
        self,
        config=None,
        bits: int = 2,
        group_size: int = 32,
        residual_length: int = 128,
        meta_dtype: torch.dtype = torch.float16,
        backend: str | None = None,
        device: str | None = None,
        attention: str = "auto",
    ):
        self.settings = KiviSettings(bits, group_size, residual_length, meta_dtype)
        if attention not in ATTENTION_MODES:
            raise ValueError(f"`attention` must be one of {ATTENTION_MODES}, got {attention!r}")
        self.backend = select(backend, device)
        if config is None:
            super().__init__(layer_class_to_replicate=lambda: KiviLayer(self.settings, self.backend, attention))
            return
        decoder_config = config.get_text_config(decoder=True)
        self.settings.check_head_dim(_head_dim(decoder_config))
        layer_types, layer_kwargs = get_layer_types_and_kwargs(decoder_config)
        layers = []
        for index, (layer_type, kwargs) in enumerate(zip(layer_types, layer_kwargs, strict=True)):
            if layer_type == "full_attention":
                layers.append(KiviLayer(self.settings, self.backend, attention, decoder_config))
            elif layer_type in ("sliding_attention", "chunked_attention"):
                layers.append(DynamicSlidingWindowLayer(**kwargs))
            elif layer_type == "dummy":
                layers.append(DummyLayer())
            else:
                raise ValueError(
                    f"KiviCache cannot serve layer {index} of type {layer_type!r}: it supports full attention "
                    "(quantized), sliding/chunked attention (kept dense) and shared-KV layers"
                )
        super().__init__(layers=layers)

    def memory_report(self) -> KiviMemoryReport:
        """Bytes held by the KIVI layers (sliding-window and shared layers are not counted)."""
        report = KiviMemoryReport()
        for layer in self.layers:
            if isinstance(layer, KiviLayer):
                report = report + layer.memory_report()
        return report
