"""``"kivi_paged"``: the attention of continuous batching over KIVI pages.

The model calls ``KiviPagedCache.update`` and then this function with the flat batch ``query [1, Hq, sum(q_len), D]``
and the kwargs ``update`` filled (the layer's :class:`~kivi_xpu.paged.attend.LayerStep`); the engine-neutral
:func:`~kivi_xpu.paged.attend.attend` computes each request as its own :class:`~kivi_xpu.KiviCache` would, with
transformers' SDPA for the exact prompt chunks and dense appends.
"""

from __future__ import annotations

from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .attend import attend
from .cache import STEP_KEY

ATTENTION_NAME = "kivi_paged"


def kivi_paged_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                                 scaling: float | None = None, **kwargs):  # fmt: skip
    """transformers attention interface over the step of ``kwargs["kivi_paged_step"]`` (:func:`~.attend.attend`,
    with transformers' SDPA): ``query [1, Hq, M, D]`` -> ``([1, M, Hq, Dv], None)``."""
    step_of_layer = kwargs.get(STEP_KEY)
    if step_of_layer is None:
        raise RuntimeError(
            "attn_implementation 'kivi_paged' runs only under continuous batching with KIVI pages "
            "(kivi_xpu.paged.init_continuous_batching); use 'kivi' or 'sdpa' with model.generate"
        )
    if kwargs.get("softcap") is not None or kwargs.get("sliding_window") is not None:
        raise ValueError("KIVI pages do not support logit soft-capping or sliding-window layers")
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling

    def sdpa(rows, keys, values, mask, is_causal):
        return sdpa_attention_forward(module, rows, keys, values, mask, scaling=scaling, is_causal=is_causal)[0]

    return attend(step_of_layer, query, scaling, sdpa, value.shape[-1]), None


def register() -> None:
    """Registers ``"kivi_paged"`` with transformers' attention and mask interfaces (idempotent)."""
    AttentionInterface.register(ATTENTION_NAME, kivi_paged_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
