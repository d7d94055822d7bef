"""The KIVI algorithm's settings and streaming policy, independent of storage, kernels and transformers.

KIVI (Liu et al., 2024) keeps the newest tokens of each layer in full precision and the older ones as
low-bit codes: keys per channel (a group is ``group_size`` consecutive tokens of one channel), values per
token (a group is ``group_size`` consecutive channels of one token). As the authors implement it
(jy-yuan/KIVI, ``models/llama_kivi.py``), for a layer holding ``n`` tokens after an update:

* keys: the first ``R * floor(n / R)`` tokens are quantized, the last ``n % R`` stay full precision
  (new keys gather in a full-precision buffer which is quantized as one block when it reaches ``R``);
* values: the first ``max(0, n - R)`` tokens are quantized, the last ``min(n, R)`` stay full precision
  (a FIFO of ``R`` tokens; the oldest leaves it quantized).

Prefill, single-token decode and multi-token appends (multi-turn chat, chunked prefill, assisted decoding)
all follow from these two counts, which is how :class:`kivi_xpu.cache.KiviLayer` applies them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .ops.checks import META_DTYPES, check_bits, check_group_size, check_meta_dtype


@dataclass(frozen=True)
class KiviSettings:
    """Quantization settings of one cache layer.

    Args:
        bits: bits per quantized element, one of (2, 4, 8).
        group_size: ``G``, elements sharing one scale and zero point (tokens for keys, channels for values).
            Must divide ``head_dim`` and be a multiple of ``8 // bits``.
        residual_length: ``R``, tokens kept in full precision; a multiple of ``group_size``.
        meta_dtype: dtype of the stored scales and zero points. ``float16`` (default) costs 1 bit per element
            at G=32 (2-bit codes + fp16 metadata = 3 bits/element); ``float32`` costs 2.
    """

    bits: int = 2
    group_size: int = 32
    residual_length: int = 128
    meta_dtype: torch.dtype = torch.float16

    def __post_init__(self):
        check_bits(self.bits)
        check_group_size(self.group_size, self.bits)
        r = self.residual_length
        if isinstance(r, bool) or not isinstance(r, int) or r <= 0:
            raise ValueError(f"`residual_length` must be a positive integer, got {r!r}")
        if r % self.group_size != 0:
            raise ValueError(
                f"`residual_length` ({r}) must be a multiple of `group_size` ({self.group_size}): "
                "keys are quantized in blocks of residual_length tokens, each made of whole groups"
            )
        check_meta_dtype(self.meta_dtype)

    def check_head_dim(self, head_dim: int) -> None:
        if head_dim % self.group_size != 0:
            raise ValueError(
                f"`group_size` ({self.group_size}) must divide the model's head_dim ({head_dim}); "
                f"choose a divisor of {head_dim} that is a multiple of {8 // self.bits}"
            )

    def quantized_key_count(self, total_tokens: int) -> int:
        """Keys held as codes when the layer holds ``total_tokens``: whole blocks of ``residual_length``."""
        return total_tokens // self.residual_length * self.residual_length

    def quantized_value_count(self, total_tokens: int) -> int:
        """Values held as codes when the layer holds ``total_tokens``: all but the newest ``residual_length``."""
        return max(0, total_tokens - self.residual_length)

    def bits_per_element(self) -> float:
        """Storage cost of one quantized element including its share of the scale and zero point."""
        meta_bits = 2 * torch.finfo(self.meta_dtype).bits
        return self.bits + meta_bits / self.group_size


__all__ = ["KiviSettings", "META_DTYPES"]
