"""Public model shapes with random weights, for benchmarks of the models people run without their weights.

``kivi-xpu bench --model llama-3.1-8b`` builds the named architecture from the dimensions of its public config and
fills its weights with random numbers: decode speed depends on the shapes, not on the values. Building is fast at
any size: the parameters are allocated without transformers' per-weight initialisation (minutes at 8B on two
cores) and filled by copies of one block of random numbers.
"""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
from transformers.initialization import no_init_weights

POOL = 1 << 20 | 7  # random numbers drawn once; odd, so that rows of a matrix do not repeat in step


def _llama_3(**fields) -> tuple:
    """A Llama 3 shape: the fields the family shares (8 kv heads, its vocabulary and RoPE base) and ``fields``."""
    return LlamaConfig, LlamaForCausalLM, dict(num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, **fields)


# Dimensions from each model's public config.json (the fields that shape a decode step).
# fmt: off
SHAPES = {
    "llama-3.2-1b": _llama_3(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                             head_dim=64, tie_word_embeddings=True),
    "llama-3.2-3b": _llama_3(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
                             head_dim=128, tie_word_embeddings=True),
    "llama-3.1-8b": _llama_3(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                             head_dim=128, tie_word_embeddings=False),
    "qwen2.5-7b": (Qwen2Config, Qwen2ForCausalLM, dict(
        hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
        vocab_size=152064, rope_theta=1000000.0, tie_word_embeddings=False,
    )),
}
# fmt: on


def shape_config(name: str, max_positions: int, layers: int | None = None):
    """The config of the named shape, with room for ``max_positions`` positions (and only ``layers`` decoder
    layers when given)."""
    if name not in SHAPES:
        raise ValueError(f"`name` must be one of {tuple(SHAPES)}, got {name!r}")
    config_class, _, fields = SHAPES[name]
    if layers is not None:
        if layers < 1:
            raise ValueError(f"`layers` must be a positive number of decoder layers, got {layers!r}")
        fields = fields | {"num_hidden_layers": layers}
    return config_class(**fields, max_position_embeddings=max(max_positions, 8192))


@torch.no_grad()
def shape_model(
    name: str,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    max_positions: int = 8192,
    layers: int | None = None,
):
    """A model of the named shape (a key of :data:`SHAPES`; its first ``layers`` decoder layers when given) with
    random weights, in ``dtype`` on ``device``, in eval mode; weights drawn from a seeded generator, so two builds
    are equal."""
    config = shape_config(name, max_positions, layers)
    model_class = SHAPES[name][1]
    with no_init_weights(), torch.device(device):
        model = model_class._from_config(config, dtype=dtype)
    # Matrices from one seeded block of normal numbers, repeated (drawing 8B numbers would take minutes); vectors
    # (norm weights, biases) 1.
    block = torch.randn(POOL, generator=torch.Generator().manual_seed(0)).mul_(0.02).to(device, dtype)
    for parameter in model.parameters():
        parameter.requires_grad_(False)
        if parameter.dim() < 2:
            parameter.fill_(1.0)
            continue
        flat = parameter.view(-1)
        for start in range(0, flat.numel(), POOL):
            piece = flat[start : start + POOL]
            piece.copy_(block[: piece.numel()])
    return model.eval()


def parameter_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())
