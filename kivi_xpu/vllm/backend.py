"""The attention backend that vLLM's CPU engine runs in place of ``CPU_ATTN`` when ``"kivi"`` is configured.

* :meth:`KiviAttentionBackend.customize_spec`: a layer's page of a block is the KIVI page of ``T`` packed tokens
  (:class:`~kivi_xpu.paged.pages.PageLayout`; one state of ``page_bytes`` per block), so vLLM's pool, block tables,
  scheduler and "KV cache size" count 2-bit pages;
* :class:`KiviMetadataBuilder`: once per forward, the requests of the batch (:mod:`.requests`) and their decode plan;
* :class:`KiviAttentionImpl`: each layer stores its new tokens with the core's
  :class:`~kivi_xpu.paged.store.PageWriter` and attends with :func:`~kivi_xpu.paged.attend.attend`, exactly as the
  transformers engine does.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch
from vllm.config import get_current_vllm_config
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
)
from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheLayout

from ..backend import select
from ..codec import KeyCodec, ValueCodec
from ..paged.attend import LayerStep, attend, chunk_attention
from ..paged.pages import LayerPages
from ..paged.store import DecodePlan, PageWriter, Request
from . import state


class KiviAttentionBackend(AttentionBackend):
    forward_includes_kv_cache_update: bool = True  # the store and the attention of a layer are one step
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto"]

    @staticmethod
    def get_name() -> str:
        return "CPU_ATTN"  # the slot it fills (vLLM's CPU platform asks for no other)

    @staticmethod
    def get_impl_cls():
        return KiviAttentionImpl

    @staticmethod
    def get_builder_cls():
        return KiviMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int]:
        return [state.current_plan().block_tokens]  # a block is one page: never split

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return [32, 64, 80, 96, 128, 160, 192, 256]

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        return (KVCacheLayout.LBHNC,)

    @classmethod
    def customize_spec(cls, spec: AttentionSpec) -> AttentionSpec:
        plan = state.current_plan()
        if spec.block_size != plan.block_tokens:
            raise ValueError(f"KIVI pages: block_size {spec.block_size}, the plan's is {plan.block_tokens}")
        itemsize = spec.dtype.itemsize
        return dataclasses.replace(spec, num_head_slots=1, tokens_per_state=plan.block_tokens,
                                   state_content_bytes=plan.page_bytes // itemsize * itemsize)  # fmt: skip


@dataclasses.dataclass
class KiviMetadata:
    """One forward's requests (:class:`~kivi_xpu.paged.store.Request`, rows of the flat batch), split into decode
    rows (one plan for every layer) and the others."""

    num_actual_tokens: int
    decode: DecodePlan | None
    others: list[Request]


class KiviMetadataBuilder(AttentionMetadataBuilder[KiviMetadata]):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.requests = state.worker_requests(vllm_config)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False):
        meta = common_attn_metadata
        requests = self.requests.plan_forward(meta.query_start_loc_cpu.tolist(), meta.seq_lens.tolist(),
                                              meta.block_table_tensor)  # fmt: skip
        decode, others = [], []
        for r in requests:
            (decode if r.decode_row else others).append(r)
        plan = self.requests.plan
        decode_plan = DecodePlan.of(decode, plan.settings[0], plan.block_tokens, self.requests.units,
                                    torch.device("cpu")) if decode else None  # fmt: skip
        return KiviMetadata(meta.num_actual_tokens, decode_plan, others)


class KiviAttentionImpl(AttentionImpl):
    def __init__(self, num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window, kv_cache_dtype,
                 logits_soft_cap=None, attn_type=AttentionType.DECODER, kv_sharing_target_layer_name=None,
                 sinks=None):  # fmt: skip
        refused = {
            "alibi_slopes": alibi_slopes is not None,
            "sliding_window": sliding_window is not None,
            "logits_soft_cap": bool(logits_soft_cap),
            "attention sinks (s_aux)": sinks is not None,
            "KV sharing": kv_sharing_target_layer_name is not None,
            f"attention type {attn_type}": attn_type != AttentionType.DECODER,
        }
        wrong = [name for name, bad in refused.items() if bad]
        if wrong:
            raise ValueError(f"KIVI pages in vLLM serve plain causal decoder attention; this layer has {wrong}")
        self.num_heads, self.head_size, self.scale, self.num_kv_heads = num_heads, head_size, float(scale), num_kv_heads
        vllm_config = get_current_vllm_config()
        self.requests = state.worker_requests(vllm_config)
        self.backend = select(self.requests.plan.backend, None).for_device(torch.device("cpu")).name
        self._layer = None  # (pages, writer), made on the first forward with a cache

    def _layer_state(self, layer, kv_cache: torch.Tensor) -> tuple[int, LayerPages, PageWriter]:
        if self._layer is None or self._layer[1].key_codes.data_ptr() != kv_cache.data_ptr():
            plan = self.requests.plan
            index = extract_layer_index(layer.layer_name)
            settings = plan.settings[index]
            blocks = kv_cache.view(torch.uint8).view(kv_cache.shape[0], -1)
            pages = LayerPages(blocks, plan.block.pages[index], 0)
            head_dim = plan.shape.head_dim
            codecs = KeyCodec.of(settings, head_dim, self.backend), ValueCodec.of(settings, head_dim, self.backend)
            rotations = tuple(codec.rotation(kv_cache.device) for codec in codecs)
            writer = PageWriter(settings, plan.block_tokens, self.requests.units, *codecs, rotations)
            self._layer = (index, pages, writer)
            self.requests.add_layer(index, blocks, pages, writer)
        return self._layer

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):  # fmt: skip
        """``query [N, Hq, D]``, ``key`` / ``value [N, H, D]``, ``output [N, Hq, D]`` (the first
        ``num_actual_tokens`` rows are real)."""
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("KIVI pages: fused output quantization is not supported")
        if attn_metadata is None:  # vLLM's warm-up
            return output
        n = attn_metadata.num_actual_tokens
        index, pages, writer = self._layer_state(layer, kv_cache)
        keys, values = key[:n].transpose(0, 1).unsqueeze(0), value[:n].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        plan = attn_metadata.decode
        decode = None if plan is None else writer.decode_rows(plan, index, pages, keys, values)
        steps = [writer.request_step(index, pages, r, keys, values) for r in attn_metadata.others]
        step = LayerStep(self.backend, decode, steps, (writer.key_rotation, writer.value_rotation))
        queries = query[:n].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
        output[:n] = attend(step, queries, self.scale, self._sdpa, output.shape[-1])[0]
        return output

    def _sdpa(self, rows, keys, values, mask, is_causal):
        if mask is None:
            result = torch.nn.functional.scaled_dot_product_attention(rows, keys, values, is_causal=is_causal,
                                                                      scale=self.scale, enable_gqa=True)  # fmt: skip
        else:  # attend's masks are those of a chunk after the rest of the keys
            result = chunk_attention(rows, keys, values, self.scale)
        return result.transpose(1, 2)
