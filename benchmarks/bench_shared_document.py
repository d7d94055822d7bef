"""Requests sharing a document, submitted at once: wall time of continuous batching on KIVI pages with and without
prefix reuse, and of transformers' own pool with and without its block sharing, at the same KV memory; and how many
such requests the KIVI pool holds at once.

    python benchmarks/bench_shared_document.py --requests 8 16
    python benchmarks/bench_shared_document.py --capacity --requests 64 --document-tokens 3000 --new-tokens 128 \\
        --kv-memory 768 --engines kivi kivi-fresh

Each request is the same document (the first --document-tokens tokens of a Wikipedia article from kivi_xpu.assets)
followed by its own question, greedy, --new-tokens each; all are added at once to one manager (KIVI pages:
kivi_xpu.paged.init_continuous_batching; transformers: model.generate_batch with ContinuousBatchingConfig(num_blocks)
of as many fp32 blocks of 32 tokens as fit in --kv-memory). Printed per engine: wall time from the first request
added to the last answer, the prompt tokens found cached (KIVI), the most requests in flight at once (KIVI, polled
every 5 ms), and the ratio to each other engine. The engines run one after another in one process (the effects
measured are several-fold; run it twice to see the spread). `--check N` compares the first N answers of each KIVI
engine with the request's own generate with KiviCache.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serve import fp32_blocks  # noqa: E402

from kivi_xpu import KiviCache, use_fused_attention  # noqa: E402
from kivi_xpu.assets import wikipedia_text  # noqa: E402
from kivi_xpu.paged import init_continuous_batching  # noqa: E402
from kivi_xpu.tools.loading import resolve_model  # noqa: E402
from kivi_xpu.tools.machine import lscpu_lines  # noqa: E402

ENGINES = ("kivi", "kivi-fresh", "transformers", "transformers-fresh")
TOPICS = ("the dates", "the places", "the people", "the numbers", "the causes", "the results", "the title", "a summary")


def greedy(new_tokens: int) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)


def shared_document_prompts(tokenizer, count: int, document_tokens: int) -> list[list[int]]:
    """``count`` prompts: one document, then a question of its own each."""
    text = wikipedia_text().read_text()[:200_000]
    document = tokenizer(text).input_ids[:document_tokens]
    questions = [f"\n\nQuestion {i + 1}: what does the text say about {TOPICS[i % len(TOPICS)]}?" for i in range(count)]
    return [document + tokenizer(q, add_special_tokens=False).input_ids for q in questions]


def own_generate(model, prompt, new_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    """The request's own greedy generate with KiviCache: its tokens and the logits of each step."""
    out = model.generate(torch.tensor([prompt]), cache=KiviCache(config=model.config), generation_config=greedy(
        new_tokens), output_scores=True, return_dict_in_generate=True)  # fmt: skip
    return out.sequences[0, len(prompt) :].tolist(), [s[0].float() for s in out.scores]


def difference(own, answer) -> tuple[int, float] | None:
    """``None`` when ``answer`` is the own generate's tokens; else the first differing step and the own generate's
    logit margin there between its token and the answer's."""
    tokens, logits = own
    if tokens == answer:
        return None
    step = next(i for i, (a, b) in enumerate(zip(tokens, answer, strict=False)) if a != b)
    return step, float(logits[step][tokens[step]] - logits[step][answer[step]])


def run_kivi(model, prompts, new_tokens: int, kv_memory: int, reuse: bool) -> dict:
    config = ContinuousBatchingConfig(allow_block_sharing=reuse)
    manager = init_continuous_batching(model, greedy(new_tokens), config, kv_memory=kv_memory)
    manager.start()
    try:
        while manager.cache is None:
            time.sleep(0.005)
        cache = manager.cache
        started = time.perf_counter()
        ids = [manager.add_request(p, f"q{i}", max_new_tokens=new_tokens) for i, p in enumerate(prompts)]
        answers, most = {}, 0
        while len(answers) < len(ids):
            most = max(most, cache.requests_in_flight)
            result = manager.get_result(timeout=0.005)
            if result is not None and result.is_finished():
                if result.error is not None:
                    raise RuntimeError(result.error)
                answers[result.request_id] = result.generated_tokens
        seconds = time.perf_counter() - started
        prefixes = cache.holdings.prefixes
        held_without_sharing = cache.budget.requests_held(max(map(len, prompts)), new_tokens)
        return dict(seconds=seconds, answers=[answers[i] for i in ids], most_in_flight=most,
                    cached_tokens=prefixes.cached_tokens, prompt_tokens=prefixes.prompt_tokens,
                    held_without_sharing=held_without_sharing)  # fmt: skip
    finally:
        manager.stop(block=True, timeout=60)


def run_transformers(model, prompts, new_tokens: int, kv_memory_mib: int, path, sharing: bool) -> dict:
    blocks = fp32_blocks(str(path), str(model.dtype).removeprefix("torch."), kv_memory_mib, 32)
    config = ContinuousBatchingConfig(num_blocks=blocks, page_size=32, max_batch_tokens=1024,
                                      allow_block_sharing=sharing)  # fmt: skip
    model.set_attn_implementation("sdpa")
    started = time.perf_counter()
    results = model.generate_batch(prompts, generation_config=greedy(new_tokens), continuous_batching_config=config,
                                   max_new_tokens=new_tokens, warmup=False)  # fmt: skip
    seconds = time.perf_counter() - started
    if len(results) != len(prompts) or any(r.error is not None for r in results.values()):
        raise RuntimeError("transformers' continuous batching lost requests")
    return dict(seconds=seconds)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="local model directory, or smollm2 (default)")
    parser.add_argument("--requests", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--document-tokens", type=int, default=1900)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--kv-memory", type=int, default=1024, help="MiB for every engine (1024)")
    parser.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES))
    parser.add_argument("--capacity", action="store_true", help="also print what the pool holds without sharing")
    parser.add_argument("--check", type=int, default=0, metavar="N", help="compare N answers with own generate")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    print("\n".join(lscpu_lines()), flush=True)
    torch.set_num_threads(torch.get_num_threads())
    path = resolve_model(args.model)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    record = {"settings": vars(args), "machine": lscpu_lines(), "runs": {}}
    for count in args.requests:
        prompts = shared_document_prompts(tokenizer, count, args.document_tokens)
        rows = {}
        for engine in args.engines:
            if engine.startswith("kivi"):
                row = run_kivi(model, prompts, args.new_tokens, args.kv_memory * 2**20, engine == "kivi")
            else:
                row = run_transformers(model, prompts, args.new_tokens, args.kv_memory, path, engine == "transformers")
            rows[engine] = row
            extra = ""
            if "most_in_flight" in row:
                extra = (f", {row['cached_tokens']} of {row['prompt_tokens']} prompt tokens found cached, at most "
                         f"{row['most_in_flight']} requests in flight")  # fmt: skip
            print(f"{count} requests of {len(prompts[0])}+ tokens, {engine}: {row['seconds']:.1f} s{extra}", flush=True)
            if args.capacity and "held_without_sharing" in row:
                print(f"  the pool holds {row['held_without_sharing']} such requests at once without sharing (its "
                      "admission's count)", flush=True)  # fmt: skip
        for engine, row in rows.items():
            ratios = ", ".join(f"{row['seconds'] / other['seconds']:.2f}x {name}" for name, other in rows.items()
                               if name != engine)  # fmt: skip
            print(f"  {engine}: {ratios}", flush=True)
        if args.check:
            use_fused_attention(model)
            own = [own_generate(model, prompt, args.new_tokens) for prompt in prompts[: args.check]]
            for engine, row in rows.items():
                if "answers" in row:
                    row["check"] = [difference(o, a) for o, a in zip(own, row["answers"], strict=False)]
                    equal = sum(d is None for d in row["check"])
                    differences = "; ".join(f"request {i}: step {d[0]}, margin {d[1]:.3f}"
                                            for i, d in enumerate(row["check"]) if d is not None)  # fmt: skip
                    print(f"  {engine}: {equal}/{len(own)} answers equal their own generate {differences}", flush=True)
        for row in rows.values():
            row.pop("answers", None)
        record["runs"][str(count)] = rows
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
