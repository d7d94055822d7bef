"""The 2-bit pages of continuous batching: their byte layout and the allocator that hands them out.

A **page** holds ``T`` consecutive packed tokens of one request in one layer (``T = key_group_size`` when every
layer has the same), keys and values, in the layouts of :mod:`kivi_xpu.ops` with the page as the batch axis (``H``
kv heads, ``D`` head_dim, ``P`` codes per byte, ``Gk`` / ``Gv`` the key / value group size; key metadata group-major,
so that one group's ``D`` channels are contiguous)::

    key codes    uint8 [H, D, T/P]   key scales, zeros   meta [H, T/Gk, D]   (T/Gk key groups of Gk tokens)
    value codes  uint8 [H, T, D/P]   value scales, zeros meta [H, T, D/Gv]

A **block** is one page per layer (:class:`BlockLayout`): transformers' unit of allocation (``block_table[request] =
[block, ...]``), so its scheduler, pool, free counts and byte-sized sectors run unchanged on pages 9-10x smaller than
its fp32 ones (vLLM's block too, :mod:`kivi_xpu.vllm`). Layers may differ in bits and group sizes (per-layer
settings, e.g. a calibration), so their pages may differ in bytes; every layer's page holds the same ``T`` tokens,
whole key groups of that layer.
Block ``b`` of a request holds its packed tokens ``[S + b*T, S + (b+1)*T)`` (``S`` sink tokens): a request of ``n``
tokens owns ``ceil(n / T)`` blocks, more than it ever packs (the sinks and the newest tokens stay exact, in its
:mod:`~kivi_xpu.paged.windows` unit). Pages share the cache's sectors with those units (:mod:`.budget`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from math import lcm

import torch

from ..algorithm import KiviSettings
from ..ops.checks import codes_per_byte
from ..ops.reference import gather_pages

_ALIGN = 64  # bytes: every section of a page starts on a cache line


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


@dataclass(frozen=True)
class PageLayout:
    """Byte layout of one layer's page (see the module docstring)."""

    heads: int
    head_dim: int
    tokens: int  # T, a multiple of the key group size
    key_group: int
    key_bits: int
    value_bits: int
    value_group: int
    meta_dtype: torch.dtype

    @classmethod
    def for_settings(cls, settings: KiviSettings, heads: int, head_dim: int, tokens: int | None = None) -> PageLayout:
        """The page of ``tokens`` tokens (default: one key group) of a layer with ``settings``."""
        return cls(
            heads,
            head_dim,
            settings.key_group_size if tokens is None else tokens,
            settings.key_group_size,
            settings.key_bits,
            settings.value_bits,
            settings.value_group_size,
            settings.meta_dtype,
        )

    def shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Each section's per-page shape and dtype, in page order."""
        h, d, t, meta = self.heads, self.head_dim, self.tokens, self.meta_dtype
        return {
            "key_codes": ((h, d, t // codes_per_byte(self.key_bits)), torch.uint8),
            "key_scales": ((h, t // self.key_group, d), meta),
            "key_zeros": ((h, t // self.key_group, d), meta),
            "value_codes": ((h, t, d // codes_per_byte(self.value_bits)), torch.uint8),
            "value_scales": ((h, t, d // self.value_group), meta),
            "value_zeros": ((h, t, d // self.value_group), meta),
        }

    def offsets(self) -> dict[str, int]:
        """Byte offset of each section in the page."""
        offsets, at = {}, 0
        for name, (shape, dtype) in self.shapes().items():
            offsets[name] = at
            at += _aligned(torch.Size(shape).numel() * dtype.itemsize)
        return offsets

    @property
    def page_bytes(self) -> int:
        shape, dtype = self.shapes()["value_zeros"]
        return self.offsets()["value_zeros"] + _aligned(torch.Size(shape).numel() * dtype.itemsize)


@dataclass(frozen=True)
class BlockLayout:
    """Byte layout of a block: one :class:`PageLayout` per layer, the pages one after another. ``block_bytes`` is
    their sum, rounded up (only when the layers' pages differ) to a multiple of the number of layers, as transformers'
    allocator counts a block in equal pages, and of the cache line."""

    pages: tuple[PageLayout, ...]

    @classmethod
    def for_settings(cls, settings: Sequence[KiviSettings], heads: int, head_dim: int) -> BlockLayout:
        """The layout for ``settings`` (one per layer, in layer order, sharing ``residual_length``): pages of ``T``
        tokens, the least common multiple of the layers' key group sizes, so that each layer's page holds whole key
        groups. (Every key group size divides ``R``, so ``T`` does: keys leave the window ``R`` at a time, in whole
        pages.)"""
        tokens = lcm(*(s.key_group_size for s in settings))
        return cls(tuple(PageLayout.for_settings(s, heads, head_dim, tokens) for s in settings))

    @property
    def tokens(self) -> int:
        """``T``, the tokens of every page."""
        return self.pages[0].tokens

    @property
    def heads(self) -> int:
        return self.pages[0].heads

    @property
    def window_step(self) -> int:
        """How many rows a request's exact values move down at once in its window (:mod:`.windows`), once every that
        many steps: the smallest key group size (the key group size when the layers share it)."""
        return min(page.key_group for page in self.pages)

    @property
    def page_starts(self) -> list[int]:
        """Byte offset of each layer's page in the block."""
        starts, at = [], 0
        for page in self.pages:
            starts.append(at)
            at += page.page_bytes
        return starts

    @property
    def block_bytes(self) -> int:
        total = sum(page.page_bytes for page in self.pages)
        return -(-total // lcm(len(self.pages), _ALIGN)) * lcm(len(self.pages), _ALIGN)


class LayerPages:
    """One layer's pages as six tensors whose first axis is the block id, views into the cache's flat byte tensor
    (``key_codes [num_blocks, H, D, T/P]`` etc., see :class:`PageLayout`)."""

    def __init__(self, blocks: torch.Tensor, layout: PageLayout, page_start: int):
        """``blocks``: uint8 ``[num_blocks, bytes_per_block]``; this layer's page starts at byte ``page_start``."""
        for name, offset in layout.offsets().items():
            shape, dtype = layout.shapes()[name]
            nbytes = torch.Size(shape).numel() * dtype.itemsize
            section = blocks[:, page_start + offset : page_start + offset + nbytes]
            setattr(self, name, section.view(dtype).view(blocks.shape[0], *shape))

    def keys(self, pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The packed keys of ``pages`` (int64 block ids, in token order) as one history: codes
        ``[1, H, D, n*T/P]``, scales and zeros ``[1, H, D, n]`` (copies)."""
        return gather_pages("keys", self.key_codes, self.key_scales, self.key_zeros, pages)

    def values(self, pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The packed values of ``pages`` as one history: codes ``[1, H, n*T, D/P]``, scales and zeros
        ``[1, H, n*T, D/Gv]`` (copies)."""
        return gather_pages("values", self.value_codes, self.value_scales, self.value_zeros, pages)

    def store_keys(self, pages: torch.Tensor, codes, scales, zeros) -> None:
        """Writes packed keys of ``len(pages)`` whole pages (codes ``[1, H, D, n*T/P]``, metadata ``[1, H, D,
        n*T/G]``; the pages hold metadata group-major, ``[H, T/G, D]``)."""
        n = pages.numel()
        h, d, width = codes.shape[1], codes.shape[2], codes.shape[3] // n
        self.key_codes.index_copy_(0, pages, codes[0].view(h, d, n, width).permute(2, 0, 1, 3))
        groups = scales.shape[3] // n
        for pool, part in ((self.key_scales, scales), (self.key_zeros, zeros)):
            pool.index_copy_(0, pages, part[0].view(h, d, n, groups).permute(2, 0, 3, 1))
