"""``kivi-xpu plan``: how many requests of a given length a KV budget holds, with KIVI pages and without, in each
engine, and the longest prompt it serves; computed without a model, by the code that admits requests.

    kivi-xpu plan llama-3.1-8b --dtype bfloat16 --kv-memory 16384 65536 --requests 4000+256 16000+512

For every budget (MiB of KV) and request length (prompt + new tokens), one row per engine and page format:

* ``transformers`` (``kivi-xpu serve --continuous-batching --kv-memory MiB``): KIVI pages, as
  :class:`~kivi_xpu.paged.budget.PageBudget` plans and admits them (``requests_held``, ``longest_prompt``); and
  transformers' own full-precision pool of the same bytes (``--cb-num-blocks``; blocks of ``--page-size`` tokens);
* ``vllm`` (``vllm serve --kv-cache-memory-bytes MiB``): KIVI pages through this package's plugin, as its start-up
  plan splits the budget (:func:`kivi_xpu.vllm.plan.plan`: packed blocks and exact units); and vLLM's own pages in
  the model dtype and in fp8 (the KV dtypes its CPU engine offers), blocks of 128 tokens.

"Requests" are requests of that length decoding at once, each holding its whole length (an engine that admits on
the prompt alone, as vLLM does, preempts beyond that); "tokens" are theirs. The model is a checkpoint directory, an
HF id, ``smollm2`` or a public shape of :mod:`kivi_xpu.tools.shapes` (``llama-3.1-8b``...): only its config is read.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass

import torch

from ..paged.budget import PageBudget, PageShape, exact_token_bytes
from .cli import kivi_option, positive_int
from .options import DTYPES, ToolError

MIB = 2**20
VLLM_BLOCK = 128  # vLLM's CPU block size (its default; the plugin's block is R tokens, also 128 by default)
VLLM_MAX_NUM_SEQS = 128  # vLLM's CPU defaults (scheduler_config)
VLLM_MAX_BATCHED_TOKENS = 2048
TRANSFORMERS_PAGE = 256  # ContinuousBatchingConfig.page_size's default
FP8 = torch.float8_e4m3fn  # vLLM's fp8 pages (e4m3 and e5m2 alike: one byte an element)


@dataclass(frozen=True)
class Row:
    """One engine and page format at one budget and request length."""

    engine: str  # "transformers" or "vllm"
    pages: str  # "KIVI 2-bit", the dtype's name, or "fp8"
    requests: int  # requests of the length held at once
    tokens: int  # their tokens
    pool_tokens: int | None  # tokens the pool's pages hold (packed ones for KIVI pages; vLLM logs it as its "KV cache
    # size"); None for KIVI pages in transformers, whose sectors hold pages or exact units as requests need
    longest_prompt: int  # the longest prompt served alone with the request's new tokens (0: none; -1: refuses to start)
    exact_prompt: int | None = None  # KIVI in vLLM: the longest prompt whose chunks all attend exact states, alone
    unit_bytes: int | None = None  # KIVI: one request's exact unit (sinks and window of every layer)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def load_config(model, max_model_len: int | None):
    """The config of ``model``: a shape name of :mod:`.shapes`, ``smollm2``, a directory, an HF id, or a config."""
    from .shapes import SHAPES, shape_config

    if not isinstance(model, str):
        return model
    if model in SHAPES:
        return shape_config(model, max_model_len or 8192)
    from transformers import AutoConfig

    from .loading import resolve_model

    try:
        return AutoConfig.from_pretrained(resolve_model(model))
    except (OSError, ValueError) as error:
        raise ToolError(f"model {model!r}: not a shape ({', '.join(SHAPES)}), a checkpoint directory or an HF id "
                        f"whose config can be read: {error}") from None  # fmt: skip


def cache_settings(kivi_settings: dict) -> dict:
    """``kivi_settings`` without the vLLM plugin's own keys: ``KiviCache``'s arguments."""
    from ..vllm.plan import PLUGIN_KEYS

    return {k: v for k, v in kivi_settings.items() if k not in PLUGIN_KEYS}


def full_precision_blocks(shape: PageShape, dtype, kv_memory: int, block_tokens: int) -> int:
    """Blocks of ``block_tokens`` tokens in ``dtype`` (keys and values of every layer) in ``kv_memory`` bytes:
    transformers' full-precision pool and vLLM's own pages."""
    return kv_memory // (exact_token_bytes(shape, dtype) * block_tokens)


def calibration_of(model, kivi_settings: dict) -> str | None:
    """The calibration ``KiviCache`` applies to ``model`` with these settings (its path; ``None``: none)."""
    from ..cache import KiviCache

    calibration = KiviCache(load_config(model, None), **cache_settings(kivi_settings)).calibration
    return None if calibration is None else str(calibration)


def model_shape(config, tp: int) -> PageShape:
    """One rank's :class:`PageShape` under ``tp``-way tensor parallelism (the KV heads split)."""
    from ..paged.cache import page_shape

    heads = page_shape(config.get_text_config()).heads
    if heads % tp:
        raise ToolError(f"--tp {tp} does not divide the model's {heads} KV heads")
    return page_shape(config.get_text_config(), tp)


def transformers_rows(config, shape: PageShape, dtype, kv_memory: int, prompt: int, new_tokens: int,
                      kivi_settings: dict, max_batch_tokens: int, page_size: int) -> list[Row]:  # fmt: skip
    """KIVI pages in transformers' batching (the server's :class:`PageBudget`) and its full-precision pool."""
    from ..paged.manager import config_layer_settings

    settings = config_layer_settings(config, dtype, cache_settings(kivi_settings))
    budget = PageBudget.plan(shape, settings, dtype, kv_memory, None)
    held = budget.requests_held(prompt, new_tokens)
    kivi = Row("transformers", "KIVI 2-bit", held, held * (prompt + new_tokens), None,
               budget.longest_prompt(new_tokens, max_batch_tokens), unit_bytes=budget.unit_bytes)  # fmt: skip
    blocks = full_precision_blocks(shape, dtype, kv_memory, page_size)
    full_held = blocks // _ceil_div(prompt + new_tokens, page_size)
    full = Row("transformers", str(dtype).removeprefix("torch."), full_held, full_held * (prompt + new_tokens),
               blocks * page_size, max(0, blocks * page_size - new_tokens))  # fmt: skip
    return [kivi, full]


def vllm_rows(config, shape: PageShape, dtype, kv_memory: int, prompt: int, new_tokens: int, kivi_settings: dict,
              max_model_len: int, max_num_seqs: int, max_batched_tokens: int) -> list[Row]:  # fmt: skip
    """KIVI pages through the plugin (its start-up plan) and vLLM's own pages in ``dtype`` and fp8."""
    from ..vllm.plan import plan

    length = prompt + new_tokens
    fits = length <= max_model_len  # vLLM refuses a longer request (HTTP 400)
    rows = []
    try:
        kivi = plan(kivi_settings, config, shape, dtype, kv_memory, max_num_seqs, max_batched_tokens, max_model_len)
    except ValueError as error:
        if "too small" not in str(error):
            raise ToolError(f"vLLM + KIVI: {error}") from None
        rows.append(Row("vllm", "KIVI 2-bit", 0, 0, 0, -1))
    else:
        held = kivi.requests_held(length) * fits
        pool_tokens = kivi.num_blocks * kivi.block_tokens
        rows.append(Row("vllm", "KIVI 2-bit", held, held * length, pool_tokens,
                        min(max_model_len, pool_tokens) - new_tokens,
                        _exact_prompt(kivi.staging_units * kivi.rows, max_batched_tokens, max_model_len),
                        kivi.unit_bytes))  # fmt: skip
    for name, page_dtype in ((str(dtype).removeprefix("torch."), dtype), ("fp8", FP8)):
        blocks = full_precision_blocks(shape, page_dtype, kv_memory, VLLM_BLOCK)
        pool_tokens = blocks * VLLM_BLOCK
        if pool_tokens < max_model_len:  # vLLM refuses to start: one request of max_model_len must fit
            rows.append(Row("vllm", name, 0, 0, pool_tokens, -1))
            continue
        held = min(max_num_seqs, blocks // _ceil_div(length, VLLM_BLOCK)) * fits
        rows.append(Row("vllm", name, held, held * length, pool_tokens, max_model_len - new_tokens))
    return rows


def _exact_prompt(staging_tokens: int, chunk: int, max_model_len: int) -> int:
    """The longest prompt prefilled alone in chunks of ``chunk`` tokens whose chunks before the last fit in
    ``staging_tokens`` exact tokens (the plugin's staging; a prompt's last chunk needs none)."""
    return min(max_model_len, (staging_tokens // chunk + 1) * chunk)


def plan_rows(model: str, dtype, kv_memory_mib: list[int], requests: list[tuple[int, int]], kivi_settings: dict,
              tp: int = 1, max_model_len: int | None = None, max_num_seqs: int = VLLM_MAX_NUM_SEQS,
              max_batched_tokens: int = VLLM_MAX_BATCHED_TOKENS, max_batch_tokens: int | None = None,
              page_size: int = TRANSFORMERS_PAGE, engines=("transformers", "vllm")) -> list[dict]:  # fmt: skip
    """Every row for every budget and request: dicts of :class:`Row`'s fields and ``kv_memory_mib``, ``prompt``,
    ``new_tokens``."""
    from ..paged.cache import DEFAULT_MAX_BATCH_TOKENS

    config = load_config(model, max_model_len)
    text = config.get_text_config()
    max_model_len = max_model_len or getattr(text, "max_position_embeddings", None) or 8192
    shape = model_shape(config, tp)
    result = []
    for mib in kv_memory_mib:
        for prompt, new_tokens in requests:
            rows = []
            try:
                if "transformers" in engines:
                    rows += transformers_rows(config, shape, dtype, mib * MIB, prompt, new_tokens, kivi_settings,
                                              max_batch_tokens or DEFAULT_MAX_BATCH_TOKENS, page_size)  # fmt: skip
                if "vllm" in engines:
                    rows += vllm_rows(config, shape, dtype, mib * MIB, prompt, new_tokens, kivi_settings,
                                      max_model_len, max_num_seqs, max_batched_tokens)  # fmt: skip
            except (TypeError, ValueError) as error:
                raise ToolError(str(error)) from None
            result += [dict(kv_memory_mib=mib, prompt=prompt, new_tokens=new_tokens, **asdict(r)) for r in rows]
    return result


# ------------------------------------------------------------------------------------------------ command line


def request_length(text: str) -> tuple[int, int]:
    """``PROMPT+NEW`` (``4000+256``)."""
    prompt, sep, new = text.partition("+")
    try:
        values = int(prompt), int(new)
    except ValueError:
        values = (0, 0)
    if not sep or values[0] < 1 or values[1] < 1:
        raise argparse.ArgumentTypeError(f"expected PROMPT+NEW tokens such as 4000+256, got {text!r}")
    return values


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default="smollm2",
                   help="a public shape (llama-3.2-1b, llama-3.2-3b, llama-3.1-8b, qwen2.5-7b), a checkpoint "
                        "directory, an HF id, or smollm2 (default); only its config is read")  # fmt: skip
    p.add_argument("--dtype", choices=tuple(DTYPES), default="bfloat16", help="the model's dtype (default bfloat16)")
    p.add_argument("--kv-memory", type=positive_int, nargs="+", default=[768], metavar="MIB",
                   help="KV budgets in MiB (default 768)")  # fmt: skip
    p.add_argument("--requests", type=request_length, nargs="+", default=[(4000, 256)], metavar="PROMPT+NEW",
                   help="request lengths (default 4000+256)")  # fmt: skip
    p.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel ranks: one rank's bytes (default 1)")
    p.add_argument("--max-model-len", type=positive_int, help="vLLM's (default: the model's max positions)")
    p.add_argument("--max-num-seqs", type=positive_int, default=VLLM_MAX_NUM_SEQS, help="vLLM's (default 128)")
    p.add_argument("--max-num-batched-tokens", type=positive_int, default=VLLM_MAX_BATCHED_TOKENS,
                   help="vLLM's chunk of a step (default 2048)")  # fmt: skip
    p.add_argument("--page-size", type=positive_int, default=TRANSFORMERS_PAGE,
                   help="transformers' full-precision block tokens (default 256)")  # fmt: skip
    p.add_argument("--kivi-option", type=lambda t: kivi_option(t, {}), action="append", default=[],
                   metavar="NAME=VALUE", help="a KiviCache setting (bits=4, preset=paper, layer_overrides=None, ...); "
                   "the default KiviCache otherwise, with the calibration shipped for the model")  # fmt: skip
    p.add_argument("--json", help="also write the rows to this JSON file")


def _held(row: dict) -> str:
    if row["longest_prompt"] < 0:
        return "refuses to start (one request of max_model_len does not fit)"
    return f"{row['requests']:>5} requests, {row['tokens']:>9,} tokens"


def report(rows: list[dict]) -> str:
    lines = []
    for (mib, prompt, new), group in _grouped(rows).items():
        lines.append(f"\n{mib} MiB of KV, requests of {prompt} + {new} tokens:")
        for row in group:
            name = f"{row['engine']:<12} {row['pages']:<10}"
            pool = "" if row["pool_tokens"] is None else f"; pages hold {row['pool_tokens']:,} tokens"
            extra = ""
            if row["longest_prompt"] >= 0:
                extra = f"; longest prompt {row['longest_prompt']:,}"
            if row["exact_prompt"] is not None:
                extra += f" (exact alone up to {row['exact_prompt']:,})"
            if row["unit_bytes"] is not None:
                extra += f"; exact unit {row['unit_bytes'] / MIB:.2f} MiB a request"
            lines.append(f"  {name} {_held(row)}{pool}{extra}")
    return "\n".join(lines)


def _grouped(rows: list[dict]) -> dict:
    groups: dict = {}
    for row in rows:
        groups.setdefault((row["kv_memory_mib"], row["prompt"], row["new_tokens"]), []).append(row)
    return groups


def command(args) -> None:
    dtype = DTYPES[args.dtype]
    settings = dict(args.kivi_option)
    rows = plan_rows(args.model, dtype, args.kv_memory, args.requests, settings, args.tp, args.max_model_len,
                     args.max_num_seqs, args.max_num_batched_tokens, page_size=args.page_size)  # fmt: skip
    print(f"kivi-xpu plan: {args.model}, {args.dtype}, tensor parallelism {args.tp} (bytes of one rank); KIVI: "
          f"{settings or 'the default KiviCache'}, calibration: {calibration_of(args.model, settings) or 'none'}"
          + report(rows))  # fmt: skip
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"model": args.model, "dtype": args.dtype, "tp": args.tp, "kivi": settings, "rows": rows}, out,
                      indent=1, default=str)  # fmt: skip


if __name__ == "__main__":
    import sys

    from .cli import tool_main

    sys.exit(tool_main("kivi_xpu.tools.plan", __doc__, add_arguments, command))
