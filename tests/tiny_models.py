"""The tiny random Llama the test files build (fp32, eval mode), with per-test overrides of its config fields."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

TINY_LLAMA = dict(
    vocab_size=256,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)


def tiny_llama_config(**overrides) -> LlamaConfig:
    """2 layers, 4 query heads over 2 kv heads (GQA), head_dim 32, a 256-token vocabulary; ``overrides`` replace
    any field."""
    return LlamaConfig(**(TINY_LLAMA | overrides))


def tiny_llama(seed: int | None = 0, **overrides) -> LlamaForCausalLM:
    """A random :func:`tiny_llama_config` model; ``seed=None`` draws from the current RNG state."""
    if seed is not None:
        torch.manual_seed(seed)
    return LlamaForCausalLM(tiny_llama_config(**overrides)).eval()
