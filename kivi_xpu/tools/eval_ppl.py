"""Perplexity of a model on a text with the KV cache in the loop, for several caches side by side.

    kivi-xpu eval-ppl --model smollm2 --text wikipedia --eval-mode decode --prefill 512 --decode-steps 256 --windows 4
    kivi-xpu eval-ppl --model smollm2 --text wikipedia --eval-mode streaming --max-tokens 2048
    python -m kivi_xpu.tools.eval_ppl ...  (the same options)

``--eval-mode decode``: ``--windows`` consecutive, non-overlapping windows of ``P + D + 1`` tokens from the start of
the text (``P = --prefill``, ``D = --decode-steps``). Each window prefills its first P tokens into an empty cache
(attention on the exact states, as in generation), then feeds its next D tokens one at a time (teacher forcing);
step i scores the prediction of token ``P + i + 1`` from the cache. Only those D decode predictions are scored: the
prefill's own prediction never reads a quantized cache. The windows run as one batch (``--window-batch`` splits
them).

``--eval-mode streaming``: the text (its first ``--max-tokens`` tokens) is fed token by token from an empty cache,
every token after the first scored: the cache holds the whole history from the first step on, as in the KIVI
authors' streaming evaluation. The spread is over consecutive segments of ``--segment-length`` scored tokens.

Perplexity = exp(mean negative log-likelihood over all scored tokens); per window (or segment) the same over its
tokens; deltas are against ``DynamicCache`` (full precision) on the same tokens, overall and paired per window.
The text is tokenized without special tokens. Cache choices are those of ``kivi-xpu bench``.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F

from ..integration import cache_argument
from .cli import (
    add_cache_arguments,
    add_model_arguments,
    add_output_arguments,
    apply_process_options,
    positive_int,
    progress,
    tool_main,
)
from .io import check_output_path, write_json
from .loading import load_model, load_tokenizer, model_limit, resolve_text, text_tokens
from .machine import report_header
from .memory import accounted_bytes
from .options import ToolError, ToolOptions
from .report import ppl_table
from .specs import cache_specs, check_cache_options, make_cache, third_party_failure, unavailable_reason

MODES = ("decode", "streaming")
TEXT_HELP = (
    "UTF-8 text file, or a text obtained through pip from the gensim 4.4.0 wheel: 'wikipedia' (default), ~100 "
    "Wikipedia articles (kivi_xpu.assets.wikipedia_text), or 'news', 300 Australian news articles of the Lee "
    "corpus (kivi_xpu.assets.news_text)"
)


@dataclass(kw_only=True)
class EvalOptions(ToolOptions):
    """The settings of ``kivi-xpu eval-ppl`` (see the module docstring)."""

    text: str = "wikipedia"  # a UTF-8 text file, "wikipedia" or "news"
    eval_mode: str = "decode"  # one of MODES
    prefill: int = 512  # decode mode: P
    decode_steps: int = 256  # decode mode: D
    windows: int = 4  # decode mode: K
    window_batch: int | None = None  # decode mode: windows per batch (None: all)
    max_tokens: int | None = None  # streaming mode: the first N tokens (None: the whole text)
    segment_length: int = 256  # streaming mode: scored tokens per segment


DEFAULTS = EvalOptions()


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``kivi-xpu eval-ppl`` / ``python -m kivi_xpu.tools.eval_ppl``."""
    add_model_arguments(p)
    p.add_argument(
        "--text",
        default=DEFAULTS.text,
        help=TEXT_HELP,
    )
    p.add_argument("--eval-mode", choices=MODES, default=DEFAULTS.eval_mode, help="decode (default) or streaming")
    p.add_argument(
        "--prefill", type=positive_int, default=DEFAULTS.prefill, help="decode mode: P, tokens prefilled per window"
    )
    p.add_argument(
        "--decode-steps",
        type=positive_int,
        default=DEFAULTS.decode_steps,
        help="decode mode: D, teacher-forced steps scored",
    )
    p.add_argument("--windows", type=positive_int, default=DEFAULTS.windows, help="decode mode: number of windows")
    p.add_argument("--window-batch", type=positive_int, help="decode mode: windows per batch (default: all)")
    p.add_argument(
        "--max-tokens",
        type=positive_int,
        help="streaming mode: the first N tokens of the text (default: the whole text, which must then fit in "
        "the model's max_position_embeddings)",
    )
    p.add_argument(
        "--segment-length",
        type=positive_int,
        default=DEFAULTS.segment_length,
        help="streaming mode: scored tokens per segment (256)",
    )
    add_cache_arguments(p)
    add_output_arguments(p)


@dataclass
class PplRow:
    cache: str
    name: str
    bits: int | None
    mode: str
    perplexity: float
    mean_nll: float
    scored_tokens: int
    window_perplexities: list[float]  # decode windows, or streaming segments
    window_mean: float
    window_std: float  # sample standard deviation (0 for one window)
    window_min: float
    window_max: float
    kv_bytes: int  # bytes the cache held at the end (first window batch in decode mode)
    delta_vs_dynamic: float | None = None  # perplexity - DynamicCache's
    relative_delta_vs_dynamic: float | None = None  # perplexity / DynamicCache's - 1
    window_deltas_vs_dynamic: list[float] = field(default_factory=list)  # paired, per window
    window_delta_mean: float | None = None
    window_delta_std: float | None = None
    memory_vs_dynamic: float | None = None


def _std(values: list[float]) -> float:
    return statistics.stdev(values) if len(values) > 1 else 0.0


@torch.no_grad()
def decode_nll(model, spec, windows: torch.Tensor, prefill: int, window_batch: int, options, bar) -> tuple:
    """Negative log-likelihoods ``[K, D]`` of the D teacher-forced decode predictions of each window
    (``windows [K, P + D + 1]``), and the KV bytes the first batch's cache held at the end."""
    model.set_attn_implementation(spec.attn_implementation)
    nll, held = [], None
    for chunk in windows.split(window_batch):
        cache = make_cache(spec, model.config, options, windows.shape[1])
        model(chunk[:, :prefill], **cache_argument(cache), use_cache=True, logits_to_keep=1)
        losses = []
        for i, logits in enumerate(decode_logits(model, cache, chunk, prefill)):
            losses.append(F.cross_entropy(logits, chunk[:, prefill + i + 1], reduction="none"))
            bar.update(1)
        nll.append(torch.stack(losses, dim=1))
        held = accounted_bytes(cache)[0] if held is None else held
        del cache
    model.set_attn_implementation("sdpa")
    return torch.cat(nll), held


@torch.no_grad()
def decode_logits(model, cache, chunk: torch.Tensor, prefill: int):
    """The teacher-forced decode steps of windows ``chunk [B, P + D + 1]`` once ``cache`` holds their first
    ``P = prefill`` tokens: yields, for step i = 0..D-1, the float32 logits ``[B, vocab]`` after feeding token
    ``P + i``, which predict token ``P + i + 1``."""
    for position in range(prefill, chunk.shape[1] - 1):
        yield model(chunk[:, position : position + 1], **cache_argument(cache), use_cache=True).logits[:, -1].float()


@torch.no_grad()
def streaming_nll(model, spec, tokens: torch.Tensor, options, bar) -> tuple:
    """Negative log-likelihoods ``[N - 1]`` of tokens 1..N-1 of ``tokens [N]``, fed one at a time from an empty
    cache, and the KV bytes the cache held at the end."""
    model.set_attn_implementation(spec.attn_implementation)
    cache = make_cache(spec, model.config, options, tokens.numel())
    ids = tokens.view(1, -1)
    losses = []
    for position in range(ids.shape[1] - 1):
        logits = model(ids[:, position : position + 1], **cache_argument(cache), use_cache=True).logits[:, -1]
        losses.append(F.cross_entropy(logits.float(), ids[:, position + 1], reduction="none"))
        bar.update(1)
    model.set_attn_implementation("sdpa")
    return torch.cat(losses), accounted_bytes(cache)[0]


def make_row(spec, mode: str, nll: torch.Tensor, window_nll: list[torch.Tensor], held: int) -> PplRow:
    mean = nll.double().mean().item()
    per_window = [math.exp(w.double().mean().item()) for w in window_nll]
    return PplRow(
        cache=spec.label,
        name=spec.name,
        bits=spec.bits,
        mode=mode,
        perplexity=math.exp(mean),
        mean_nll=mean,
        scored_tokens=nll.numel(),
        window_perplexities=per_window,
        window_mean=statistics.fmean(per_window),
        window_std=_std(per_window),
        window_min=min(per_window),
        window_max=max(per_window),
        kv_bytes=held,
    )


def add_deltas(rows: list[PplRow]) -> None:
    base = next((r for r in rows if r.name == "dynamic"), None)
    if base is None:
        return
    for row in rows:
        row.delta_vs_dynamic = row.perplexity - base.perplexity
        row.relative_delta_vs_dynamic = row.perplexity / base.perplexity - 1
        row.window_deltas_vs_dynamic = [
            w - b for w, b in zip(row.window_perplexities, base.window_perplexities, strict=True)
        ]
        row.window_delta_mean = statistics.fmean(row.window_deltas_vs_dynamic)
        row.window_delta_std = _std(row.window_deltas_vs_dynamic)
        row.memory_vs_dynamic = base.kv_bytes / row.kv_bytes if row.kv_bytes else None


def evaluation_tokens(options: EvalOptions, model, model_path: str) -> torch.Tensor:
    """``[K, P + D + 1]`` windows (decode mode) or ``[N]`` tokens (streaming mode), with clear errors when the text
    is too short or the lengths exceed the model's context."""
    limit = model_limit(model)
    path = resolve_text(options.text)
    tokenizer = load_tokenizer(model_path, options.model)
    if options.eval_mode == "decode":
        if limit is not None and options.prefill + options.decode_steps > limit:
            raise ToolError(
                f"--prefill + --decode-steps = {options.prefill + options.decode_steps} positions exceed the model's "
                f"max_position_embeddings ({limit})"
            )
        length = options.prefill + options.decode_steps + 1
        needed = options.windows * length
        ids = text_tokens(tokenizer, path, needed)
        if len(ids) < needed:
            raise ToolError(
                f"--text {options.text!r} has {len(ids)} tokens, fewer than --windows {options.windows} x (--prefill "
                f"{options.prefill} + --decode-steps {options.decode_steps} + 1) = {needed}"
            )
        return ids.view(options.windows, length)
    if options.max_tokens is not None and limit is not None and options.max_tokens > limit:
        raise ToolError(f"--max-tokens {options.max_tokens} exceeds the model's max_position_embeddings ({limit})")
    # Without --max-tokens: the whole text, of which one token more than the limit is enough to reject it.
    wanted = options.max_tokens if options.max_tokens is not None else (limit + 1 if limit is not None else None)
    ids = text_tokens(tokenizer, path, wanted)
    if options.max_tokens is None and limit is not None and len(ids) > limit:
        raise ToolError(
            f"--text {options.text!r} has more tokens than the model's max_position_embeddings ({limit}): pass "
            "--max-tokens N to evaluate its first N tokens"
        )
    if options.max_tokens is not None and len(ids) < options.max_tokens:
        raise ToolError(f"--text {options.text!r} has {len(ids)} tokens, fewer than --max-tokens {options.max_tokens}")
    if len(ids) < 2:
        raise ToolError(f"--text {options.text!r} has {len(ids)} token(s): at least 2 are needed to score one")
    return ids


def evaluate(options: EvalOptions) -> dict:
    """Runs the evaluation the options describe and returns the JSON payload (``rows``, ``skipped``, ...)."""
    check_output_path(options.json, "--json")
    apply_process_options(options)
    model, model_path = load_model(options.model, options.dtype, options.device)
    specs = cache_specs(options)
    check_cache_options(specs, model.config, options)
    tokens = evaluation_tokens(options, model, model_path).to(model.device)
    skipped = [{"cache": s.label, "reason": r} for s in specs if (r := unavailable_reason(s))]
    runnable = [s for s in specs if unavailable_reason(s) is None]
    decode = options.eval_mode == "decode"
    window_batch = options.window_batch or options.windows
    steps_per_cache = math.ceil(options.windows / window_batch) * options.decode_steps if decode else len(tokens) - 1
    rows = []
    with progress(not options.no_progress, total=len(runnable) * steps_per_cache, desc="eval-ppl", unit="step") as bar:
        for spec in runnable:
            bar.set_description_str(f"{options.eval_mode} {spec.label}")
            start = bar.n
            if decode:
                result, reason = third_party_failure(
                    spec, decode_nll, model, spec, tokens, options.prefill, window_batch, options, bar
                )
            else:
                result, reason = third_party_failure(spec, streaming_nll, model, spec, tokens, options, bar)
            if reason:
                model.set_attn_implementation("sdpa")
                skipped.append({"cache": spec.label, "reason": reason})
                bar.update(start + steps_per_cache - bar.n)  # the steps it will not run
                continue
            nll, held = result
            windows = list(nll) if decode else list(nll.split(options.segment_length))
            rows.append(make_row(spec, options.eval_mode, nll.flatten(), windows, held))
    add_deltas(rows)
    scored = {
        "decode": {"windows": options.windows, "prefill": options.prefill, "decode_steps": options.decode_steps},
        "streaming": {"tokens": len(tokens), "segment_length": options.segment_length},
    }[options.eval_mode]
    return report_header("kivi-xpu eval-ppl", options, model_path=model_path) | {
        "text": options.text,
        "mode": options.eval_mode,
        "evaluated": scored,
        "rows": [asdict(r) for r in rows],
        "skipped": skipped,
    }


def command(args) -> None:
    """``kivi-xpu eval-ppl``: run, print the table, write --json."""
    options = EvalOptions.from_namespace(args)
    payload = evaluate(options)
    print(ppl_table(payload), flush=True)
    if options.json:
        write_json(options.json, payload)


def main(argv=None) -> int:
    return tool_main("kivi_xpu.tools.eval_ppl", __doc__, add_arguments, command, argv)


if __name__ == "__main__":
    sys.exit(main())
