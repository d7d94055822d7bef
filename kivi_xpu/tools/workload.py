"""What the three ``kivi-xpu bench`` modes (:mod:`.bench`, :mod:`.curve`, :mod:`.budget`) share: their settings
(:class:`BenchOptions`), the model and caches a run prepares (:func:`prepare`) and the prompts it feeds them
(:func:`prompts`). The modes import this module, never each other, except that :mod:`.bench` dispatches to the
other two."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .cli import apply_process_options
from .loading import check_positions, load_model, load_tokenizer, resolve_text, text_tokens
from .options import ToolError, ToolOptions
from .specs import cache_specs, check_cache_options, unavailable_reason


@dataclass(kw_only=True)
class BenchOptions(ToolOptions):
    """The settings of ``kivi-xpu bench`` (see :mod:`kivi_xpu.tools.bench`)."""

    contexts: list[int] = field(default_factory=lambda: [512, 1024, 2048, 4096])  # prompt lengths
    batch_sizes: list[int] = field(default_factory=lambda: [1, 4])
    new_tokens: int = 64  # greedy tokens per run; the prefill yields the first
    warmup: int = 2  # untimed decode steps at the start of a run
    repeats: int = 3  # runs per configuration, medians reported
    text: str | None = None  # prompts from this text file, "wikipedia" or "news" instead of random ids
    plot: str | None = None  # PNG path
    contend: int = 0  # CPU-bound competitor processes running during every measured run
    phases: bool = False  # time the phases of the native fused attention's calls (kivi_xpu.tools.timing)
    curve: bool = False  # the long-context curve on a tiny random Llama (kivi_xpu.tools.curve) instead
    kv_budget: float | None = None  # MiB: decode throughput at equal KV memory (kivi_xpu.tools.budget) instead
    max_batch: int = 256  # the largest batch --kv-budget tries
    layers: int | None = None  # with a named shape: its first N decoder layers only (the model's own count if None)


def prepare(options: BenchOptions) -> tuple:
    """The process options applied, the model loaded and checked for the longest run, the KIVI options checked:
    ``(model, model_path, runnable cache specs, skipped entries for the caches that cannot run here)``."""
    apply_process_options(options)
    model, model_path = load_model(options.model, options.dtype, options.device)
    check_positions(model, max(options.contexts) + options.new_tokens, "context + new tokens")
    specs = cache_specs(options)
    check_cache_options(specs, model.config, options)
    unavailable = {spec: reason for spec in specs if (reason := unavailable_reason(spec))}
    skipped = [{"cache": s.label, "context": None, "batch": None, "reason": r} for s, r in unavailable.items()]
    return model, model_path, [s for s in specs if s not in unavailable], skipped


def prompts(options: BenchOptions, model, model_path: str, total: int) -> Callable[[int, int], torch.Tensor]:
    """A function ``(batch, context) -> ids [batch, context]`` on the model's device: random ids (seeded) or
    consecutive text slices."""
    if options.text is None:
        # Drawn on the CPU and then moved, so that every --device gets the same prompts.
        generator = torch.Generator().manual_seed(0)
        vocab = model.config.get_text_config(decoder=True).vocab_size
        return lambda batch, context: torch.randint(0, vocab, (batch, context), generator=generator).to(model.device)
    path = resolve_text(options.text)
    ids = text_tokens(load_tokenizer(model_path, options.model), path, total).to(model.device)
    if len(ids) < total:
        raise ToolError(
            f"--text {options.text!r} has {len(ids)} tokens; the largest batch x context needs {total}: use a longer "
            "text or smaller --contexts/--batch-sizes"
        )
    return lambda batch, context: ids[: batch * context].view(batch, context)
