"""transformers adapter: its full-attention allocator over KIVI pages (the block tables and pool of
``PagedAttentionCache``, the pages' bytes those of :class:`~kivi_xpu.paged.pages.BlockLayout`)."""

from __future__ import annotations

import torch
from transformers.generation.continuous_batching.cache_allocators import FullAttentionCacheAllocator

from .pages import BlockLayout, LayerPages


class KiviPageAllocator(FullAttentionCacheAllocator):
    """transformers' full-attention allocator (block tables, pool, read/write indices unchanged) over 2-bit pages:
    ``bytes_per_page`` is a :class:`PageLayout`'s, and the layers' pages are :class:`LayerPages` views. The pages are
    written and read by :class:`~kivi_xpu.paged.cache.KiviPagedCache`, never through this class's ``update``."""

    supports_block_sharing = False  # a packed page depends on when it was packed: no prefix sharing
    supports_block_table = False  # no flash block-table path: every step goes through the cache's update

    def __init__(self, index: int, layout: BlockLayout, layer_indices: list[int]):
        if len(layout.pages) != len(layer_indices):
            raise ValueError(f"a block of {len(layout.pages)} pages for {len(layer_indices)} layers")
        self.head_dim, self.num_key_value_heads, self.layout = layout.pages[0].head_dim, layout.heads, layout
        self.cache_dtype = torch.uint8
        self._before_cache_tensor_init(
            index=index,
            layer_indices=layer_indices,
            tokens_per_page=layout.tokens,
            bytes_per_page=layout.block_bytes // len(layer_indices),
            allow_block_sharing=False,
        )

    def register_cache_tensor(self, bytes_per_sector: int, non_trash_bytes: int, cache_tensor, pool) -> None:
        blocks = cache_tensor[: non_trash_bytes // self.bytes_per_block * self.bytes_per_block]
        blocks = blocks.view(-1, self.bytes_per_block)
        self._copy_view = blocks
        self._after_cache_tensor_init(non_trash_bytes, bytes_per_sector, cache_tensor, pool)
        layout = self.layout
        self.pages = {
            layer: LayerPages(blocks, page, start)
            for layer, page, start in zip(self.layer_indices, layout.pages, layout.page_starts, strict=True)
        }

    def update(self, *args, **kwargs):
        raise RuntimeError("KiviPageAllocator pages are written by KiviPagedCache.update, not by the allocator")

    def get_cache_for_block_table(self, layer_idx: int):
        raise RuntimeError("KIVI pages have no flash block-table view: the decode fast path must stay off")
