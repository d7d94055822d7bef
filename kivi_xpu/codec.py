"""The codecs: how one kind's exact tokens become packed codes and back.

:class:`KeyCodec` (per channel, groups of ``key_group_size`` tokens, channel-major) and :class:`ValueCodec` (per token,
groups of ``value_group_size`` channels, token-major) hold a kind's bits, group, rotation, metadata dtype and backend.
They give the layout of the packed history (:meth:`KindCodec.layout`), write codes into it (:meth:`KindCodec.pack`) or
into pages (:meth:`KeyCodec.quantize`, :meth:`ValueCodec.quantize_into`), and read them back (:meth:`KindCodec.unpack`,
:meth:`KindCodec.dense`). This is the only module outside :mod:`kivi_xpu.ops` that calls the quantize and dequantize
ops: the dense cache (:mod:`kivi_xpu.stream`), the paged writer (:mod:`kivi_xpu.paged.store`), the dense states of the
attention and QAT (:mod:`kivi_xpu.qat`, on the ``"reference"`` backend, whose ops are plain PyTorch functions that
autograd sees through) all go through it.

With a rotation (:mod:`kivi_xpu.rotation`) the codes are those of ``x @ Q``, and everything read back is rotated back.
"""

from __future__ import annotations

import warnings
from typing import ClassVar

import torch

from .algorithm import KiviSettings
from .ops import kernel
from .ops.checks import codes_per_byte
from .ops.operands import DecodeInputs, KindOperands
from .rotation import rotate, rotation_matrix, unrotate
from .storage import PackedHistory, PackedLayout, growth_tokens


class KindCodec:
    """One kind's quantization: ``bits``, ``group`` (elements sharing a scale and zero point), ``rotation_name``,
    ``meta_dtype`` (of the scales and zero points), ``head_dim``, ``backend`` (the name whose kernels run) and ``fit``
    (how a group's line is fitted: :data:`~kivi_xpu.ops.checks.FITS`). Made by
    :meth:`of` from a layer's settings; immutable in use, pickled with its stream (no tensor: the rotation matrix is
    the process's, :func:`~kivi_xpu.rotation.rotation_matrix`)."""

    kind: ClassVar[str]  # "keys" / "values": the ops' names and the messages
    quantize_op: ClassVar[str]
    dequantize_op: ClassVar[str]

    def __init__(self, bits: int, group: int, rotation_name: str, meta_dtype, head_dim: int, backend: str,
                 fit: str = "minmax"):  # fmt: skip
        self.bits, self.group, self.rotation_name = bits, group, rotation_name
        self.meta_dtype, self.head_dim, self.backend, self.fit = meta_dtype, head_dim, backend, fit

    @classmethod
    def of(cls, settings: KiviSettings, head_dim: int, backend: str) -> KindCodec:
        """This kind's codec of a layer with ``settings`` (``meta_dtype`` resolved)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(bits={self.bits}, group={self.group}, rotation={self.rotation_name!r}, "
                f"meta_dtype={self.meta_dtype}, head_dim={self.head_dim}, backend={self.backend!r}, "
                f"fit={self.fit!r})")  # fmt: skip

    def rotation(self, device) -> torch.Tensor | None:
        """The rotation ``Q [D, D]`` float32 on ``device`` (``None`` without one): a shared matrix, kept outside the
        cache (so it is neither copied with it nor counted as its memory)."""
        return rotation_matrix(self.rotation_name, self.head_dim, device)

    def layout(self, residual_length: int) -> PackedLayout:
        """The layout of this kind's packed history (reserving :func:`~kivi_xpu.storage.growth_tokens`)."""
        raise NotImplementedError

    def pack(self, history: PackedHistory, x: torch.Tensor) -> None:
        """Quantizes ``x [B, H, n, D]`` and appends it to ``history``."""
        raise NotImplementedError

    def unpack(self, history: PackedHistory, out_dtype: torch.dtype, start: int = 0, count: int | None = None):
        """Held tokens ``[start, count)`` (default: all) of ``history`` as ``[B, H, count - start, D]`` in
        ``out_dtype``; ``start`` is group-aligned for keys."""
        count = history.num_tokens if count is None else count
        rotation = self.rotation(history.device)
        return self.unpacked(*history.parts_from(start), count - start, self.group, self.bits, rotation, out_dtype,
                             backend=self.backend)  # fmt: skip

    @classmethod
    def unpacked(cls, codes, scales, zeros, count: int, group: int, bits: int, rotation, out_dtype: torch.dtype,
                 device=None, *, backend: str) -> torch.Tensor:  # fmt: skip
        """``count`` packed tokens as ``[B, H, count, D]`` in ``out_dtype`` (moved to ``device`` when given): the
        backend's dequantize op, then ``@ rotation.T`` when the codes hold rotated tokens (``rotation`` ``[D, D]``
        float32 or ``None``; dequantized in float32 then, so the rotation back is exact)."""
        work_dtype = out_dtype if rotation is None else torch.float32
        x = kernel(cls.dequantize_op, backend)(codes, scales, zeros, count, group, bits, work_dtype)
        return unrotate(x if device is None else x.to(device), rotation, out_dtype)

    @classmethod
    def dense(cls, operands: KindOperands, backend: str) -> torch.Tensor:
        """Dense ``[B, Hkv, S + count + T, D]`` of operands of this kind: exact sinks + the packed history dequantized
        (a temporary, rotated back when stored rotated) + exact tail, in the tail's dtype on the tail's device."""
        parts = [operands.sinks] if operands.sinks.shape[2] else []
        if operands.count:
            o = operands
            parts.append(cls.unpacked(o.codes, o.scales, o.zeros, o.count, o.group, o.bits, o.rotation, o.tail.dtype,
                                      o.tail.device, backend=backend))  # fmt: skip
        parts.append(operands.tail)
        # Always a new tensor: the tail may be a view of the layer's window, which the next append overwrites.
        return torch.cat(parts, dim=2) if len(parts) > 1 else parts[0].clone()

    def round_trip(self, x: torch.Tensor) -> torch.Tensor:
        """``x [B, H, n, D]`` as this codec stores and reads it back, whole (for keys ``n`` is a multiple of the
        group), in ``x``'s dtype. On the ``"reference"`` backend the ops are plain PyTorch functions: QAT's mode."""
        rotation = self.rotation(x.device)
        exact = rotate(x, rotation).contiguous()
        quantize = kernel(self.quantize_op, self.backend)
        codes, scales, zeros = quantize(exact, self.group, self.bits, self.meta_dtype, self.fit)
        return self.unpacked(codes, scales, zeros, x.shape[2], self.group, self.bits, rotation, x.dtype,
                             backend=self.backend)  # fmt: skip


class KeyCodec(KindCodec):
    """Keys: per channel over groups of ``key_group_size`` tokens, channel-major codes ``[B, H, D, T/P]`` and
    metadata ``[B, H, D, T/G]``; packed in whole groups (a block of R at a time)."""

    kind = "keys"
    quantize_op, dequantize_op = "quantize_keys", "dequantize_keys"

    @classmethod
    def of(cls, settings: KiviSettings, head_dim: int, backend: str) -> KeyCodec:
        return cls(settings.key_bits, settings.key_group_size, settings.key_rotation, settings.meta_dtype, head_dim,
                   backend, settings.fit)  # fmt: skip

    def layout(self, residual_length: int) -> PackedLayout:
        d, growth = self.head_dim, growth_tokens(residual_length)
        return PackedLayout(3, codes_per_byte(self.bits), self.group, d, d, self.meta_dtype, growth)

    def quantize(self, x: torch.Tensor, device=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Codes, scales and zeros of ``x [B, H, n, D]`` (``n`` a multiple of the group), rotated on ``x``'s device
        (once per G tokens: not worth folding into the op), quantized on ``device`` (default: ``x``'s)."""
        x = rotate(x, self.rotation(x.device))
        x = x.contiguous() if device is None else x.to(device).contiguous()
        parts = kernel(self.quantize_op, self.backend)(x, self.group, self.bits, self.meta_dtype, self.fit)
        if self.meta_dtype == torch.float16 and x.dtype != torch.float16:
            warn_on_metadata_overflow(x, parts[1], self.kind)  # only then can it overflow
        return parts

    def pack(self, history: PackedHistory, x: torch.Tensor) -> None:
        history.append_parts(*self.quantize(x, history.codes.device))


class ValueCodec(KindCodec):
    """Values: per token over groups of ``value_group_size`` channels, token-major codes ``[B, H, T, D/P]`` and
    metadata ``[B, H, T, D/G]``; quantized straight into the storage rows, rotated by the op itself."""

    kind = "values"
    quantize_op, dequantize_op = "quantize_values", "dequantize_values"

    @classmethod
    def of(cls, settings: KiviSettings, head_dim: int, backend: str) -> ValueCodec:
        return cls(settings.value_bits, settings.value_group_size, settings.value_rotation, settings.meta_dtype,
                   head_dim, backend, settings.fit)  # fmt: skip

    def layout(self, residual_length: int) -> PackedLayout:
        d = self.head_dim
        code_width, meta_width = d // codes_per_byte(self.bits), d // self.group
        return PackedLayout(2, 1, 1, code_width, meta_width, self.meta_dtype, growth_tokens(residual_length))

    def quantize_into(self, x: torch.Tensor, codes, scales, zeros, row: int) -> None:
        """Quantizes ``x [B, H, n, D]`` into token rows ``[row, row + n)`` of ``codes`` / ``scales`` / ``zeros``
        (token-major, batch ``B``), the rotation folded into the op."""
        rotation = self.rotation(x.device)
        quantize_into = kernel("quantize_values_into", self.backend)
        quantize_into(x, codes, scales, zeros, row, self.group, self.bits, rotation, self.fit)

    def pack(self, history: PackedHistory, x: torch.Tensor) -> None:
        # Straight into the storage rows: one op call and no temporaries for a decode step's departing token.
        n, x = x.shape[2], x.to(history.codes.device)
        history.reserve(n)
        self.quantize_into(x, history.codes.data, history.scales.data, history.zeros.data, history.codes.end)
        history.commit(n)
        # Checked for blocks only (prefill, appends of several tokens): a per-token check would cost a reduction per
        # layer and step, and keys, from the same activations, are checked every R tokens. The op quantizes x @ Q in
        # float32 when rotated.
        quantized = x.dtype if self.rotation_name == "none" else torch.float32
        if n > 1 and self.meta_dtype == torch.float16 and quantized != torch.float16:
            scales = history.scales.rows(history.scales.end - n, history.scales.end)
            warn_on_metadata_overflow(x, scales, self.kind, self.rotation(x.device))


def dense_states(inputs: DecodeInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense ``[B, Hkv, n, D]`` keys and values of a hand-over (for attention that cannot read packed codes)."""
    return KeyCodec.dense(inputs.keys, inputs.backend), ValueCodec.dense(inputs.values, inputs.backend)


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
