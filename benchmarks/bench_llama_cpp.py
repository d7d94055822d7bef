"""The engine a CPU user would pick instead: llama.cpp (through ``llama-cpp-python``) on SmolLM2's GGUF file with
its f16 / q8_0 / q4_0 KV caches, beside transformers with ``DynamicCache`` and the default ``KiviCache`` (fused),
on the same text, the same contexts and the same threads.

What differs besides the cache: llama.cpp runs the GGUF's Q4_1 weights (~8x smaller than our fp32 weights, so its
weight reads per token are ~8x cheaper), with its own thread pool and flash attention. The comparison that is
about the cache is the slope: decode ms/token added per 1k tokens of context, which the weights do not change.

For each context the engines take turns (``--rounds`` times): a fresh context is prefilled with the text's first
``context`` tokens (timed: the prefill) and ``--steps`` single-token decode steps follow (timed; each step feeds the
token the previous one chose, greedy). Each llama.cpp run is a process of its own, so that its thread pool (which
spins between calls) is gone before torch's runs. Medians over the rounds. Not a test: run it on a quiet machine.

    pip install --no-binary llama-cpp-python "llama-cpp-python>=0.3"   # builds llama.cpp for this CPU (~30 min)
    python benchmarks/bench_llama_cpp.py --contexts 1024 4096 --steps 32
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from kivi_xpu import KiviCache, assets
from kivi_xpu.integration import cache_argument
from kivi_xpu.tools.loading import text_tokens
from kivi_xpu.tools.machine import lscpu_lines

try:
    import llama_cpp
except ImportError:
    install = 'pip install --no-binary llama-cpp-python "llama-cpp-python>=0.3"'
    raise SystemExit(f"needs llama-cpp-python: {install}") from None

KV_TYPES = {"f16": llama_cpp.GGML_TYPE_F16, "q8_0": llama_cpp.GGML_TYPE_Q8_0, "q4_0": llama_cpp.GGML_TYPE_Q4_0}

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096])
p.add_argument("--steps", type=int, default=32, help="decode steps timed per run (32)")
p.add_argument("--rounds", type=int, default=2)
p.add_argument("--threads", type=int, default=os.cpu_count())
p.add_argument("--llama-run", nargs=2, metavar=("KV", "CONTEXT"), help=argparse.SUPPRESS)  # one run, in a child
args = p.parse_args()
torch.set_num_threads(args.threads)

path = assets.smollm2_checkpoint()
tokenizer = AutoTokenizer.from_pretrained(path)
text = text_tokens(tokenizer, assets.wikipedia_text(), max(args.contexts)).tolist()


def llama_run(kv: str, context: int) -> tuple[float, float]:
    """(prefill seconds, decode ms/token) of llama.cpp with the ``kv`` cache type, in a child process."""
    command = [sys.executable, __file__, "--llama-run", kv, str(context), "--threads", str(args.threads)]
    command += ["--steps", str(args.steps), "--contexts", str(context)]
    result = subprocess.run(command, capture_output=True, text=True, check=True)
    prefill, decode = json.loads(result.stdout.splitlines()[-1])
    return prefill, decode


def llama_child(kv: str, context: int) -> None:
    llm = llama_cpp.Llama(
        model_path=str(assets.smollm2_gguf()), n_ctx=context + args.steps + 8, n_batch=512, n_threads=args.threads,
        n_threads_batch=args.threads, flash_attn=True, type_k=KV_TYPES[kv], type_v=KV_TYPES[kv], verbose=False,
    )  # fmt: skip
    start = time.perf_counter()
    llm.eval(text[:context])
    prefill = time.perf_counter() - start
    token = llm.sample(top_k=1, temp=0.0)  # greedy
    start = time.perf_counter()
    for _ in range(args.steps):
        llm.eval([token])
        token = llm.sample(top_k=1, temp=0.0)
    print(json.dumps([prefill, (time.perf_counter() - start) / args.steps * 1e3]))


if args.llama_run is not None:
    llama_child(args.llama_run[0], int(args.llama_run[1]))
    sys.exit(0)
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()  # no attn_implementation: the default


@torch.inference_mode()
def transformers_run(cache_name: str, context: int) -> tuple[float, float]:
    cache = DynamicCache() if cache_name == "DynamicCache" else KiviCache(config=model.config)
    ids = torch.tensor([text[:context]])
    start = time.perf_counter()
    logits = model(ids, **cache_argument(cache), logits_to_keep=1).logits
    prefill = time.perf_counter() - start
    token = logits[:, -1].argmax(-1, keepdim=True)
    start = time.perf_counter()
    for _ in range(args.steps):
        token = model(token, **cache_argument(cache)).logits[:, -1].argmax(-1, keepdim=True)
    return prefill, (time.perf_counter() - start) / args.steps * 1e3


ENGINES = {f"llama.cpp Q4_1, KV {kv}": (llama_run, kv) for kv in KV_TYPES}
ENGINES |= {f"transformers fp32, {name}": (transformers_run, name) for name in ("DynamicCache", "KiviCache")}

for run, arg in ENGINES.values():  # untimed: first-touch allocations, kernel caches
    run(arg, 256)
results = {(name, c): [] for name in ENGINES for c in args.contexts}
for context in args.contexts:
    for r in range(args.rounds):
        names = list(ENGINES)
        for name in names[r % len(names) :] + names[: r % len(names)]:
            run, arg = ENGINES[name]
            results[name, context].append(run(arg, context))

for line in lscpu_lines():
    print(line)
print(f"llama-cpp-python {llama_cpp.__version__}, torch {torch.__version__}, {args.threads} threads, SmolLM2-135M, ")
print(f"{args.steps} decode steps after each prefill, medians of {args.rounds} interleaved rounds")
header = "".join(f"{'ctx ' + str(c) + ' prefill s':>18}{'decode ms':>11}" for c in args.contexts)
print(f"{'engine':34}{header}{'ms per 1k ctx':>15}")
for name in ENGINES:
    cells, decodes = "", []
    for context in args.contexts:
        prefill = statistics.median(p for p, _ in results[name, context])
        decode = statistics.median(d for _, d in results[name, context])
        decodes.append(decode)
        cells += f"{prefill:18.2f}{decode:11.1f}"
    span = (args.contexts[-1] - args.contexts[0]) / 1000
    slope = f"{(decodes[-1] - decodes[0]) / span:15.2f}" if span else ""
    print(f"{name:34}{cells}{slope}")
