"""Quantization-aware training (QAT) for a KIVI cache: a training forward with exactly the cache's noise.

A model served with a :class:`~kivi_xpu.KiviCache` does not see its own keys and values at decode time: it sees
them quantize-dequantized, in a pattern that depends on the query's position (keys in blocks of ``R`` after the
sinks, values leaving a FIFO of ``R`` one at a time). Inside :func:`kivi_qat` a full-sequence forward (one call,
no cache, positions ``0..n-1``, causal) applies, for every (query ``t``, key ``j``) pair, the quantize-dequantize
that a token-by-token decode from an empty cache applies at ``t``'s decode step:

* when query ``t`` is decoded, the cache holds ``t`` tokens before the update, so it reads key ``j`` dequantized
  iff ``S <= j < S + quantized_key_count(t)`` and value ``j`` dequantized iff ``S <= j < S + quantized_value_count(t)``
  (:class:`~kivi_xpu.KiviSettings` counts; the sinks ``[0, S)``, the residual window and the new token are exact;
  the first token, a prefill of length 1, reads itself exactly);
* the dequantized key/value is the cache's: the round trip of its codecs (:meth:`kivi_xpu.codec.KindCodec.round_trip`
  on the ``"reference"`` backend, plain PyTorch), keys per channel over groups of ``key_group_size`` tokens aligned
  at ``S`` (the cache's ``R``-blocks are made of whole such groups) and values per token, with the layer's bits and
  ``meta_dtype``, in the layer's rotated basis when it has a rotation (quantize ``x @ Q``, read back
  ``dequantized @ Qᵀ``). A token's dequantized version does not depend on when it was quantized, so it is computed
  once per forward.

Sliding-window layers (which a ``KiviCache`` keeps exact) attend exactly. Gradients are straight-through: the
forward reads ``dequantize(quantize(x))`` bit for bit, the backward treats it as ``x`` (identity w.r.t. the exact
keys/values), i.e. ``x + (dequantize(quantize(x)) - x).detach()`` up to float rounding. Memory is ``O(n^2)``
per head, like eager attention (two score matrices instead of one).

Usage::

    with kivi_qat(model, group_size=32, residual_length=128, sink_tokens=4):
        loss = model(input_ids, labels=input_ids).loss
        loss.backward()
"""

from __future__ import annotations

import functools
import inspect

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .algorithm import KiviSettings
from .cache import KiviCache, config_head_dim
from .codec import KeyCodec, ValueCodec
from .layer import KiviLayer
from .ops.checks import check_float_tensor
from .ops.reference import group_queries, masked_scores
from .validation import integer

QAT_ATTENTION_NAME = "kivi_qat"
# Attribute set on every module with a `layer_idx` while kivi_qat is active: (the layer's KiviSettings, or None for a
# layer the cache keeps exact (sliding window); the prefill length).
_LAYER_ATTR = "_kivi_qat_settings"
# KiviCache arguments that make no sense here: the config comes from the model, and the fake quantization always
# runs the pure-PyTorch quantizer (bit-identical to the SYCL kernels) on the model's device, under autograd.
_NOT_OPTIONS = ("self", "config", "backend", "device", "attention")


def decode_read_masks(
    settings: KiviSettings, length: int, prefill_length: int = 0, device=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Which keys and values a decode reads dequantized.

    Returns ``(key_mask, value_mask)``, bool ``[length, length]``: ``[t, j]`` is True when, at the decode step of
    query position ``t`` (the cache holding ``t`` tokens before the update), the layer reads key/value ``j``
    dequantized rather than exact. The first ``prefill_length`` positions are one prefill (they attend to the exact
    states); the rest are decoded one token at a time. ``prefill_length`` 0 and 1 both mean a token-by-token decode
    from an empty cache.
    """
    if not isinstance(settings, KiviSettings):
        raise TypeError(f"`settings` must be a KiviSettings, got {type(settings).__name__}")
    length = integer(length, "length", minimum=0)
    prefill_length = _check_prefill_length(prefill_length)
    device = torch.device(device) if device is not None else torch.device("cpu")
    key_mask, value_mask = _read_masks(settings, length, prefill_length, device)
    return key_mask.clone(), value_mask.clone()  # the cached masks stay private: qat_attention reads them


def _check_prefill_length(prefill_length) -> int:
    return integer(prefill_length, "prefill_length", minimum=0)


@functools.lru_cache(maxsize=64)
def _read_masks(
    settings: KiviSettings, length: int, prefill_length: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    sinks, decoded = settings.sink_tokens, range(prefill_length, length)
    key_counts = torch.zeros(length, dtype=torch.long)  # prefill queries read the exact states
    value_counts = torch.zeros(length, dtype=torch.long)
    key_counts[prefill_length:] = torch.tensor([settings.quantized_key_count(t) for t in decoded], dtype=torch.long)
    value_counts[prefill_length:] = torch.tensor([settings.quantized_value_count(t) for t in decoded], dtype=torch.long)
    key_counts, value_counts = key_counts.to(device), value_counts.to(device)
    positions = torch.arange(length, device=device)
    after_sinks = positions >= sinks
    key_mask = after_sinks & (positions[None, :] < sinks + key_counts[:, None])
    value_mask = after_sinks & (positions[None, :] < sinks + value_counts[:, None])
    return key_mask, value_mask


def fake_quantized_states(
    key: torch.Tensor, value: torch.Tensor, settings: KiviSettings
) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values ``[B, H_kv, n, D]`` as the cache would dequantize them, with straight-through gradients.

    Keys ``[S, S + key_group_size * floor((n - S) / key_group_size))`` (every whole key group after the sinks) and
    values ``[S, n)`` are replaced by ``dequantize(quantize(x))`` in the forward, with the gradient of ``x``
    (straight-through: ``dequantized + (x - x.detach())``); the sinks (and a trailing partial key group, which no
    decode step reads quantized) are returned exactly.
    """
    key_target, value_target = _dequantized(key, value, settings)
    # `x - x.detach()` is exactly zero with gradient one: the forward holds the dequantized values bit for bit.
    return key_target + (key - key.detach()), value_target + (value - value.detach())


@torch.no_grad()
def _dequantized(key: torch.Tensor, value: torch.Tensor, settings: KiviSettings) -> tuple[torch.Tensor, torch.Tensor]:
    """Detached copies of ``key`` and ``value`` with the quantizable tokens (see :func:`fake_quantized_states`)
    replaced by their dequantized versions."""
    sinks, n = settings.sink_tokens, key.shape[2]
    settings = settings.for_model_dtype(key.dtype)
    key_tokens = max(0, n - sinks) // settings.key_group_size * settings.key_group_size
    key_target = key.detach().clone()
    if key_tokens:
        codec = KeyCodec.of(settings, key.shape[3], "reference")
        key_target[:, :, sinks : sinks + key_tokens] = codec.round_trip(key_target[:, :, sinks : sinks + key_tokens])
    value_target = value.detach().clone()
    if n > sinks:
        codec = ValueCodec.of(settings, value.shape[3], "reference")
        value_target[:, :, sinks:] = codec.round_trip(value_target[:, :, sinks:])
    return key_target, value_target


def _fully_masked_rows(attention_mask: torch.Tensor | None, n: int) -> torch.Tensor | None:
    """``[B, 1, n, 1]`` bool, True for query rows the mask lets attend to nothing (padding queries); None if none."""
    if attention_mask is None:
        return None
    mask = attention_mask[..., -n:]
    rows = ~mask.any(-1, keepdim=True) if mask.dtype == torch.bool else (mask == float("-inf")).all(-1, keepdim=True)
    return rows if bool(rows.any()) else None


def _check_qat_states(query, key, value) -> None:
    for name, t in (("query", query), ("key", key), ("value", value)):
        check_float_tensor(t, name)
    if key.shape[:3] != value.shape[:3] or key.shape[0] != query.shape[0] or key.shape[3] != query.shape[3]:
        raise ValueError(
            "`key` and `value` must share batch, kv heads and tokens, and `key` the batch and head_dim of `query`; "
            f"got query {tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}"
        )


def qat_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    settings: KiviSettings | None,
    attention_mask: torch.Tensor | None = None,
    scaling: float | None = None,
    dropout: float = 0.0,
    softcap: float | None = None,
    training: bool = False,
    prefill_length: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of a whole sequence with the decode-time KIVI noise of ``settings`` (``None``: exact).

    Query ``t`` scores key ``j`` against the dequantized key where :func:`decode_read_masks` says so (the exact key
    elsewhere), and its probabilities weight the dequantized value there: ``out = P @ V + (P * M_v) @ (V' - V)``
    with ``V' - V`` detached. Gradients are straight-through (see :func:`fake_quantized_states`).

    Args:
        query: ``[B, Hq, n, D]``; ``key``, ``value``: ``[B, H_kv, n, D]`` with ``Hq`` a multiple of ``H_kv``
            (GQA), positions ``0..n-1`` of a sequence starting at an empty cache.
        attention_mask: a transformers mask ``[B, 1, n, n]`` (bool, True = attend, or additive float), or
            ``None`` for plain causal attention.
        prefill_length: the first positions form one prefill that attends exactly (:func:`decode_read_masks`).
    Returns:
        ``(output [B, Hq, n, D], probabilities [B, Hq, n, n])`` in the query's dtype. Fully masked rows (padding
        queries) give zero probabilities, as torch's SDPA does.
    """
    prefill_length = _check_prefill_length(prefill_length)
    _check_qat_states(query, key, value)
    b, hq, length, _ = query.shape
    kv_heads, n = key.shape[1], key.shape[2]
    if n != length:
        raise ValueError(
            f"kivi_qat attention runs a whole sequence from an empty cache in one forward: got {length} query "
            f"positions over {n} keys. Do not pass a non-empty past_key_values (nor call generate) under kivi_qat"
        )
    if hq % kv_heads != 0:
        raise ValueError(f"query heads ({hq}) must be a multiple of the key/value heads ({kv_heads})")
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    grouped = group_queries(query, kv_heads)  # [B, H_kv, (Hq / H_kv) * n, D]

    def scores_against(keys: torch.Tensor) -> torch.Tensor:
        return (grouped @ keys.transpose(2, 3)).reshape(b, hq, length, n)

    def weighted_sum(probs: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        return (group_queries(probs, kv_heads) @ values).reshape(b, hq, length, -1)

    scores = scores_against(key)
    value_noise = None
    if settings is not None:
        key_mask, value_mask = _read_masks(settings, n, prefill_length, query.device)
        key_target, value_target = _dequantized(key, value, settings)
        if bool(key_mask.any()):
            scores = torch.where(key_mask, scores_against(key_target + (key - key.detach())), scores)
        if bool(value_mask.any()):
            value_noise = value_target - value.detach()
    scores = scores.float() * scaling
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    probs = torch.softmax(masked_scores(scores, attention_mask), dim=-1)
    # Padding queries get zero probabilities (as in torch's SDPA) instead of NaN; a NaN anywhere else stays visible.
    padding_rows = _fully_masked_rows(attention_mask, n)
    if padding_rows is not None:
        probs = probs.masked_fill(padding_rows, 0.0)
    probs = probs.to(value.dtype)
    if dropout > 0.0:
        probs = torch.nn.functional.dropout(probs, p=dropout, training=training)
    out = weighted_sum(probs, value)
    if value_noise is not None:
        out = out + weighted_sum(probs * value_mask, value_noise)
    return out, probs


def qat_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    softcap: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Transformers attention interface (``attn_implementation="kivi_qat"``): ``query [B, Hq, n, D]`` ->
    ``(output [B, n, Hq, D], probabilities [B, Hq, n, n])``. The layer's settings are those :func:`kivi_qat`
    attached to ``module``."""
    if not hasattr(module, _LAYER_ATTR):
        raise RuntimeError(
            f"attn_implementation={QAT_ATTENTION_NAME!r} needs the per-layer KIVI settings that "
            "`with kivi_xpu.qat.kivi_qat(model, ...):` attaches; it cannot be selected on its own"
        )
    settings, prefill_length = getattr(module, _LAYER_ATTR)
    out, probs = qat_attention(
        query,
        key,
        value,
        settings,
        attention_mask,
        scaling=scaling,
        dropout=dropout,
        softcap=softcap,
        training=module.training,
        prefill_length=prefill_length,
    )
    return out.transpose(1, 2).contiguous(), probs


def register() -> None:
    """Registers ``"kivi_qat"`` with transformers' attention and mask interfaces (idempotent)."""
    AttentionInterface.register(QAT_ATTENTION_NAME, qat_attention_forward)
    AttentionMaskInterface.register(QAT_ATTENTION_NAME, sdpa_mask)


def _allowed_options() -> list[str]:
    names = inspect.signature(KiviCache.__init__).parameters
    return [name for name in names if name not in _NOT_OPTIONS]


class KiviQAT:
    """Context manager returned by :func:`kivi_qat`; see there. ``layer_settings[i]`` is layer ``i``'s
    :class:`~kivi_xpu.KiviSettings` (``None`` for a layer the cache keeps exact)."""

    def __init__(self, model: torch.nn.Module, cache: KiviCache | None = None, *, prefill_length: int = 0, **options):
        self.prefill_length = _check_prefill_length(prefill_length)
        config = getattr(model, "config", None)
        if config is None or not hasattr(model, "set_attn_implementation"):
            raise TypeError(f"`model` must be a transformers PreTrainedModel, got {type(model).__name__}")
        decoder_config = config.get_text_config(decoder=True)
        if decoder_config is not config:
            raise ValueError(
                f"kivi_qat supports decoder-only models whose config is the text config; {type(model).__name__} "
                f"has a composite config ({type(config).__name__})"
            )
        if cache is not None:
            if options:
                raise ValueError(f"pass either `cache` or KiviCache options, not both (got options {sorted(options)})")
            if not isinstance(cache, KiviCache):
                raise TypeError(f"`cache` must be a KiviCache, got {type(cache).__name__}")
            if not cache.layers:
                raise ValueError("`cache` must be built from the model's config: KiviCache(config=model.config, ...)")
        else:
            unknown = sorted(set(options) - set(_allowed_options()))
            if unknown:
                raise TypeError(
                    f"unknown kivi_qat option(s) {unknown}; allowed (KiviCache options): {_allowed_options()}"
                )
            cache = KiviCache(config=decoder_config, backend="reference", **options)
        self.layer_settings: tuple[KiviSettings | None, ...] = tuple(
            self._settings_of(index, layer) for index, layer in enumerate(cache.layers)
        )
        if len(self.layer_settings) != decoder_config.num_hidden_layers:
            raise ValueError(
                f"`cache` has {len(self.layer_settings)} layers, the model {decoder_config.num_hidden_layers}"
            )
        head_dim = config_head_dim(decoder_config)
        for settings in self.layer_settings:
            if settings is not None:
                settings.check_head_dim(head_dim)  # a cache built for another model
        self.model = model
        self._previous = None
        self._modules: list[torch.nn.Module] = []

    @staticmethod
    def _settings_of(index: int, layer) -> KiviSettings | None:
        if isinstance(layer, KiviLayer):
            return layer.settings
        if layer.is_sliding:
            return None  # sliding-window layers keep their bounded window exact in a KiviCache
        raise ValueError(
            f"kivi_qat cannot emulate layer {index} ({type(layer).__name__}): it supports KIVI layers and "
            "sliding-window layers (kept exact)"
        )

    def __enter__(self) -> KiviQAT:
        model = self.model
        if any(hasattr(m, _LAYER_ATTR) for m in model.modules()):
            raise RuntimeError("kivi_qat is already active on this model")
        register()
        self._previous = model.config._attn_implementation
        for module in model.modules():
            index = getattr(module, "layer_idx", None)
            if isinstance(index, int) and 0 <= index < len(self.layer_settings):
                setattr(module, _LAYER_ATTR, (self.layer_settings[index], self.prefill_length))
                self._modules.append(module)
        try:
            if not self._modules:
                raise ValueError(f"{type(model).__name__} has no modules with a `layer_idx`: not a supported decoder")
            model.set_attn_implementation(QAT_ATTENTION_NAME)
            if model.config._attn_implementation != QAT_ATTENTION_NAME:
                raise ValueError(
                    f"{type(model).__name__} cannot switch its attention implementation (it does not use "
                    "transformers' AttentionInterface), so kivi_qat cannot run it"
                )
        except BaseException:
            self._detach()
            raise
        return self

    def _detach(self) -> None:
        for module in self._modules:
            delattr(module, _LAYER_ATTR)
        self._modules = []

    def __exit__(self, *exc) -> None:
        try:
            if self.model.config._attn_implementation != self._previous:
                self.model.set_attn_implementation(self._previous)
        finally:
            self._detach()


def kivi_qat(model: torch.nn.Module, cache: KiviCache | None = None, *, prefill_length: int = 0, **options) -> KiviQAT:
    """A context manager under which ``model``'s full-sequence forwards reproduce a KIVI cache's decode-time noise.

    Args:
        model: a transformers decoder-only model (``PreTrainedModel`` whose attention uses ``AttentionInterface``).
        cache: a :class:`~kivi_xpu.KiviCache` built with ``config=model.config`` whose per-layer settings to use
            (it is only read, never filled), or ``None`` to build one from ``options``.
        prefill_length: ``0`` (default): emulate a token-by-token decode from an empty cache (every position after
            the first reads the cache). ``P > 0``: the first ``P`` positions are a prompt prefilled in one call
            (attending to the exact states), the later ones are decoded one token at a time.
        **options: :class:`~kivi_xpu.KiviCache` quantization options (``bits``, ``group_size``,
            ``residual_length``, ``meta_dtype``, ``sink_tokens``, ``key_bits``, ``value_bits``,
            ``key_group_size``, ``value_group_size``, ``layer_overrides``), validated exactly as ``KiviCache``
            validates them.

    Inside the block the model runs ``attn_implementation="kivi_qat"`` (each layer with its own settings;
    sliding-window layers exact); on exit the previous implementation is restored. A forward must hold the
    whole sequence from position 0 (no ``past_key_values`` with content, no ``generate``).
    """
    return KiviQAT(model, cache, prefill_length=prefill_length, **options)


__all__ = [
    "QAT_ATTENTION_NAME",
    "KiviQAT",
    "decode_read_masks",
    "fake_quantized_states",
    "kivi_qat",
    "qat_attention",
    "qat_attention_forward",
    "register",
]
