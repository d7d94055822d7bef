"""Model loading shared by the examples: SmolLM2 through pip, any HF id/directory, or a tiny offline model."""

from __future__ import annotations

import argparse

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from kivi_xpu.assets import byte_tokenizer
from kivi_xpu.tools.loading import model_device
from kivi_xpu.tools.options import ToolError

TINY_VOCAB = 256  # one token per byte


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="HF model id or local directory (default: SmolLM2-135M-Instruct via pip)")
    parser.add_argument("--tiny", action="store_true", help="a tiny random Llama + byte tokenizer (smoke test)")
    parser.add_argument(
        "--device", default="cpu", help="where the model runs: cpu (default), xpu (Intel GPU), cuda, ... (the cache "
        "follows it: native kernels on cpu, SYCL on xpu, pure PyTorch elsewhere)"
    )  # fmt: skip
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="float32", help="model dtype (default float32)")
    parser.add_argument("--backend", choices=("auto", "native", "sycl", "reference"), default=None)
    parser.add_argument("--sycl-device", help="SYCL device filter for the KIVI kernels, e.g. opencl:cpu")


def add_sharded_model_arguments(parser: argparse.ArgumentParser) -> None:
    """``--model`` / ``--tiny [architecture]`` (one of them is required) and ``--dtype`` of the tensor-parallel
    examples. They have no ``--device``: each rank runs on the device transformers' tensor parallelism gives it (the
    CPU under gloo, one GPU per rank under xccl or nccl)."""
    parser.add_argument("--model", help="local model directory, or smollm2 (transformers' TP loads it)")
    parser.add_argument(
        "--tiny", nargs="?", const="llama", choices=tuple(TINY_ARCHITECTURES),
        help="a tiny random model (default llama; 4 query, 2 KV heads) + byte tokenizer, offline",
    )  # fmt: skip
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="float32", help="model dtype (default float32)")


def cache_options(args) -> dict:
    """The KiviCache arguments the example flags choose (kernels)."""
    return {"backend": args.backend, "device": args.sycl_device}


def new_token_options(args) -> dict:
    """``max_new_tokens`` for generate; with ``--tiny`` also ``min_new_tokens``, because random weights may emit an
    early end-of-text token and shorten the run the tests check."""
    return {"max_new_tokens": args.max_new_tokens, "min_new_tokens": args.max_new_tokens if args.tiny else None}


TINY_ARCHITECTURES = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}


def tiny_model(architecture: str = "llama", num_hidden_layers: int = 2, seed: int = 0, **config):
    """A tiny random model of ``architecture`` (a key of :data:`TINY_ARCHITECTURES`): 4 query heads over 2 KV
    heads, head_dim 32, a byte vocabulary."""
    if architecture not in TINY_ARCHITECTURES:
        raise ValueError(f"`architecture` must be one of {tuple(TINY_ARCHITECTURES)}, got {architecture!r}")
    config_class, model_class = TINY_ARCHITECTURES[architecture]
    torch.manual_seed(seed)
    config = config_class(
        vocab_size=TINY_VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        **config,
    )
    return model_class(config).eval()


def tiny_llama(num_hidden_layers: int = 2, seed: int = 0, **config) -> LlamaForCausalLM:
    return tiny_model("llama", num_hidden_layers, seed, **config)


def model_path(args) -> str:
    if args.model is None:
        from kivi_xpu.assets import smollm2_checkpoint

        args.model = str(smollm2_checkpoint())
    return args.model


def load(args, **model_kwargs):
    """``(model, tokenizer)`` for ``--tiny`` / ``--model`` / the default SmolLM2 checkpoint, on ``--device`` in
    ``--dtype``."""
    device = check_device(args.device)
    if args.tiny:
        return tiny_llama(**model_kwargs).to(device, DTYPES[args.dtype]), byte_tokenizer()
    path = model_path(args)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[args.dtype], device_map=device, **model_kwargs)
    return model.eval(), AutoTokenizer.from_pretrained(path)


def check_device(device: str) -> torch.device:
    """``--device`` as a torch device, checked as the kivi-xpu tools check it: one ``error:`` line when it is
    malformed or this torch cannot use it."""
    try:
        return model_device(device)
    except ToolError as error:
        raise SystemExit(f"error: {error}") from None


def chat_inputs(tokenizer, messages: list[dict], device="cpu") -> dict:
    """Token ids of a conversation on ``device``: the tokenizer's chat template, or plain "role: text" lines without
    one."""
    if tokenizer.chat_template:
        inputs = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
    else:
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "
        inputs = tokenizer(text, return_tensors="pt")
    return {name: tensor.to(device) for name, tensor in inputs.items()}
