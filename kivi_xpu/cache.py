""":class:`KiviCache`, the transformers ``Cache`` container: one :class:`~kivi_xpu.layer.KiviLayer` per
full-attention layer, transformers' own layers for sliding-window and shared-KV layers.

Each layer's full-precision window stays on the device of the keys that layer receives; its kernels and packed
low-bit history follow that device (the device rule, :meth:`kivi_xpu.backend.Selection.for_device`).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping, Sequence

import torch
from transformers.cache_utils import (
    Cache,
    DummyLayer,
    DynamicSlidingWindowLayer,
    get_layer_types_and_kwargs,
)

from .algorithm import KiviSettings
from .backend import select
from .layer import ATTENTION_MODES, KiviLayer
from .memory import KiviMemoryReport
from .overrides import AUTO, auto_layer_overrides, load_layer_overrides, settings_for_layer
from .validation import name_choice


def config_head_dim(config) -> int:
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
    """A KV cache storing keys and values in a few bits with the KIVI algorithm.

    Use it like any transformers cache::

        cache = KiviCache(config=model.config)  # 2-bit, G=32, R=128, 4 sinks, Hadamard-rotated history
        model.generate(**inputs, cache=cache)

    ``KiviCache(config=model.config, preset="paper")`` is the KIVI authors' algorithm exactly.

    Args:
        config: the model config (``model.config``). Layer types come from it: full-attention layers get a
            :class:`KiviLayer`; sliding-window layers keep their small bounded window in full precision
            (``DynamicSlidingWindowLayer``); layers that reuse another layer's cache get ``DummyLayer``.
            Without a config, every layer is a :class:`KiviLayer`, created on first use.
        bits: 2, 4 or 8 bits per stored element (keys and values, unless ``key_bits`` / ``value_bits`` say otherwise).
        group_size: elements per scale/zero group (tokens for keys, channels for values), unless
            ``key_group_size`` / ``value_group_size`` say otherwise; must divide head_dim.
        residual_length: ``R``, tokens kept in full precision; a multiple of the key group size, at most ``2**24``.
            Memory follows the tokens held (a 27-token cache allocates about 27 tokens' worth whatever ``R``).
        meta_dtype: dtype of the stored scales and zero points: ``torch.float16``, ``torch.bfloat16``,
            ``torch.float32``, or ``None`` (default): ``bfloat16`` for a bfloat16 model, ``float16`` otherwise.
        backend: ``"auto"`` (default: ``$KIVI_XPU_BACKEND``, else the kernels of each layer's device: native on
            the CPU, SYCL on an Intel GPU, pure PyTorch elsewhere; see :meth:`kivi_xpu.backend.Selection.for_device`),
            ``"native"``, ``"sycl"`` or ``"reference"``.
        device: SYCL device filter string (e.g. ``"opencl:cpu"``, ``"level_zero:gpu"``), default
            ``$KIVI_XPU_DEVICE`` or the first GPU (with an XPU build of torch), else the first CPU device. With a
            GPU, each layer's history and kernels go to that layer's own ``xpu:<i>`` (``device_map``, tensor
            parallelism).
        attention: ``"auto"`` (default): the layers hand the packed history to the fused KIVI attention when the
            model runs transformers' default attention (no ``attn_implementation`` chosen) or ``"kivi"``, and return
            dense keys/values to an attention the user chose (:func:`kivi_xpu.attention.attention_path`);
            ``"dense"`` always returns dense keys/values.
        key_bits / value_bits: bits of the key / value codes (default ``bits``), e.g. ``key_bits=4`` with 2-bit values.
        key_group_size / value_group_size: group sizes per kind (default ``group_size``); each divides head_dim,
            the key group also divides ``residual_length``.
        sink_tokens: ``S``, the first ``S`` tokens of the sequence stay in full precision forever ("attention
            sinks"); ``0 <= S < residual_length``; default: the preset's (4; the paper 0).
        rotation: ``"hadamard"`` stores the packed history Walsh-Hadamard rotated (keys and values, unless
            ``key_rotation`` / ``value_rotation`` say otherwise), which spreads outlier channels before they are
            quantized at no cost in stored bytes (:mod:`kivi_xpu.rotation`); ``"none"`` does not; default: the
            preset's (``"hadamard"``; the paper ``"none"``).
        key_rotation / value_rotation: the rotation per kind (default ``rotation``).
        fit: how a group's scale and zero point are chosen: ``"least_squares"`` (its min-max line refit once to its
            codes: less error, the same bytes and the same reading) or ``"minmax"`` (the paper's); default: the
            preset's (``"least_squares"``; the paper ``"minmax"``).
        preset: ``"default"`` (4 sinks, Hadamard rotation, least-squares fits) or ``"paper"`` (no sinks, no
            rotation, min-max fits: the KIVI authors' algorithm): where ``sink_tokens``, ``rotation`` and ``fit`` come
            from when not given.
        layer_overrides: per-layer changes to the settings above, as :class:`~kivi_xpu.KiviSettings` field names
            (``bits``, ``group_size``, ``residual_length``, ``meta_dtype``, ``key_bits``, ``value_bits``,
            ``key_group_size``, ``value_group_size``, ``sink_tokens``, ``rotation``, ``key_rotation``,
            ``value_rotation``, ``fit``, ``preset``): ``"auto"`` (default: the calibration shipped for this model,
            when the settings above are those it was calibrated on, the metadata dtype aside; else every layer alike,
            which is logged once per model with the ``kivi-xpu calibrate`` command that makes a calibration; see
            :func:`kivi_xpu.overrides.auto_layer_overrides`), ``None`` (every layer alike, not logged), a
            sequence with one entry per decoder layer of ``config`` (each ``None`` or a dict such as
            ``{"key_bits": 4}``), a callable ``layer_idx -> dict | None``, or the path of a JSON file of such a
            list (:func:`kivi_xpu.load_layer_overrides`; ``kivi-xpu calibrate`` writes one). Without a config only a
            callable is accepted (the number of layers is unknown, so a list could not be checked); it is then called
            when a layer is first used. Entries of sliding-window and shared-KV layers are checked but unused.

    Each KIVI layer's effective settings are ``cache.layers[i].settings``; :meth:`layer_settings` gives them for
    any layer index, also before a lazily created layer exists. ``cache.calibration`` is the path of the calibration
    ``"auto"`` applied (``None``: none).
    """

    def __init__(
        self,
        config=None,
        bits: int = 2,
        group_size: int = 32,
        residual_length: int = 128,
        meta_dtype: torch.dtype | None = None,
        backend: str | None = None,
        device: str | None = None,
        attention: str = "auto",
        *,
        key_bits: int | None = None,
        value_bits: int | None = None,
        key_group_size: int | None = None,
        value_group_size: int | None = None,
        sink_tokens: int | None = None,
        rotation: str | None = None,
        key_rotation: str | None = None,
        value_rotation: str | None = None,
        fit: str | None = None,
        preset: str = "default",
        layer_overrides=AUTO,
    ):
        self.calibration = None
        if isinstance(layer_overrides, str | os.PathLike) and layer_overrides != AUTO:  # e.g. `kivi-xpu calibrate`'s
            layer_overrides = load_layer_overrides(layer_overrides, config)
        self.settings = KiviSettings(
            bits,
            group_size,
            residual_length,
            meta_dtype,
            key_bits=key_bits,
            value_bits=value_bits,
            key_group_size=key_group_size,
            value_group_size=value_group_size,
            sink_tokens=sink_tokens,
            rotation=rotation,
            key_rotation=key_rotation,
            value_rotation=value_rotation,
            fit=fit,
            preset=preset,
        )
        name_choice(attention, "attention", ATTENTION_MODES)
        if isinstance(layer_overrides, str) and layer_overrides == AUTO:
            layer_overrides, self.calibration = auto_layer_overrides(config, self.settings)
        if layer_overrides is not None and not callable(layer_overrides):
            if isinstance(layer_overrides, str | bytes | Mapping) or not isinstance(layer_overrides, Sequence):
                raise TypeError(
                    "`layer_overrides` must be None, a sequence with one entry (None or a dict of KiviSettings "
                    f"fields) per decoder layer, or a callable layer_idx -> dict | None; got "
                    f"{type(layer_overrides).__name__}"
                )
            if config is None:
                raise ValueError(
                    "`layer_overrides` as a sequence needs `config`: without it the number of decoder layers is "
                    "unknown and the sequence's length cannot be checked; pass config=model.config or a callable "
                    "layer_idx -> dict | None"
                )
            layer_overrides = tuple(layer_overrides)
        self.layer_overrides = layer_overrides
        self.backend = select(backend, device)
        self._attention = attention
        self._record_new_layers = False
        if config is None:
            super().__init__(layer_class_to_replicate=self._new_lazy_layer)
            return
        if not hasattr(config, "get_text_config"):
            hint = ": pass model.config" if hasattr(config, "config") else ""
            raise TypeError(
                f"`config` must be a transformers PretrainedConfig or None, got {type(config).__name__}{hint}"
            )
        decoder_config = config.get_text_config(decoder=True)
        head_dim = config_head_dim(decoder_config)
        self.settings.check_head_dim(head_dim)
        layer_types, layer_kwargs = get_layer_types_and_kwargs(decoder_config)
        if isinstance(layer_overrides, tuple) and len(layer_overrides) != len(layer_types):
            raise ValueError(
                f"`layer_overrides` has {len(layer_overrides)} entries but the model has {len(layer_types)} decoder "
                "layers: give exactly one entry (None or a dict) per layer"
            )
        # KV sharing (Gemma-3n/4): later layers read the states a "store" layer's `update` returns, so such a layer
        # must return dense states even under the fused attention (which would hand out only its tail).
        sharing = getattr(decoder_config, "kv_sharing_modes", None) or [None] * len(layer_types)
        layers = []
        for index, (layer_type, kwargs) in enumerate(zip(layer_types, layer_kwargs, strict=True)):
            settings = self.layer_settings(index, head_dim)
            if layer_type == "full_attention":
                mode = "dense" if sharing[index] == "store" else attention
                layers.append(KiviLayer(settings, self.backend, mode, decoder_config))
            elif layer_type in ("sliding_attention", "chunked_attention"):
                layers.append(DynamicSlidingWindowLayer(**kwargs))
            elif layer_type == "dummy":
                layers.append(DummyLayer())
            else:
                raise ValueError(
                    f"KiviCache cannot serve layer {index} of type {layer_type!r}: it supports full attention "
                    "(quantized), sliding/chunked attention (kept dense) and shared-KV layers"
                )
        if not any(isinstance(layer, KiviLayer) for layer in layers):
            warnings.warn(
                f"KiviCache: no layer of this {type(decoder_config).__name__} uses full attention (layer types "
                f"{sorted(set(layer_types))}), so nothing will be quantized; a sliding-window model keeps only its "
                "bounded window, as DynamicCache does",
                UserWarning,
                stacklevel=2,
            )
        super().__init__(layers=layers)

    def layer_settings(self, layer_idx: int, head_dim: int | None = None) -> KiviSettings:
        """The :class:`~kivi_xpu.KiviSettings` of decoder layer ``layer_idx``: the cache's settings with that
        layer's entry of ``layer_overrides`` applied (checked against ``head_dim`` when given). Raises a
        ``ValueError`` naming the layer and the field for a bad override."""
        return settings_for_layer(self.settings, self.layer_overrides, layer_idx, head_dim)

    def _new_lazy_layer(self) -> KiviLayer:
        """A layer for the next index of a cache built without a config (transformers appends them in order)."""
        layer = KiviLayer(self.layer_settings(len(self.layers)), self.backend, self._attention)
        # Recording activated on the cache before this layer existed, and not switched off on its elder layers since.
        layer.record_past = self._record_new_layers and all(other.record_past for other in self.layers)
        return layer

    def activate_past_recording(self) -> None:
        """Makes every KIVI layer (also those a config-less cache creates later) keep what an exact ``crop`` needs."""
        self._record_new_layers = True
        super().activate_past_recording()

    def __iter__(self):
        """Per layer ``(keys, values, sliding_window_tensor)`` as ``DynamicCache`` yields them (transformers 5.23;
        DataParallel gathers caches this way): a :class:`KiviLayer`'s dense ``keys`` / ``values`` (computed on
        access, see :attr:`KiviLayer.keys`) and ``None``; a sliding-window layer's tensors and window size."""
        for layer in self.layers:
            yield layer.keys, layer.values, getattr(layer, "_sliding_window_tensor", None)

    def memory_report(self) -> KiviMemoryReport:
        """Bytes held by the KIVI layers (sliding-window and shared layers are not counted)."""
        report = KiviMemoryReport()
        for layer in self.layers:
            if isinstance(layer, KiviLayer):
                report = report + layer.memory_report()
        return report
