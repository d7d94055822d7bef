"""Load generator for the OpenAI-compatible servers: the same N chat requests against `kivi-xpu serve` (sequential
generation with the KIVI cache), `transformers serve` (sequential, DynamicCache), `transformers serve
--continuous-batching` (its paged full-precision cache) and `kivi-xpu serve --continuous-batching` (transformers'
batching on KIVI pages), one server at a time.

    python benchmarks/bench_serve.py --model smollm2 --servers kivi dynamic dynamic-cb \\
        --requests 8 --concurrency 4 --max-tokens 64 --prompt-words 300
    python benchmarks/bench_serve.py --model smollm2 --servers dynamic-cb kivi-cb --kv-memory 768 \\
        --requests 16 --concurrency 16 --max-tokens 256 --prompt-words 3000

--kv-memory MIB (default 1024) gives both continuous-batching servers the same KV budget: `kivi-xpu serve
--kv-memory`, and `transformers serve --cb-num-blocks` of as many full-precision blocks (--cb-block-size tokens of
keys and values of every layer) as fit in it; both get --cb-max-batch-tokens. The requests each budget can hold at
once (prompt + --max-tokens tokens each) are printed beside the throughput.

Each server is started here (`python -m kivi_xpu serve` / `python -m transformers.cli.transformers serve` on
127.0.0.1, port 0, the model preloaded, --device cpu), warmed up with one request, sent the N requests (fixed
prompts: the first --prompt-words words of news articles from kivi_xpu.assets.news_text(), greedy, --max-tokens
each) from --concurrency client threads with the official `openai` client, and stopped. Printed per server:
requests/s, completion tokens/s (from the responses' `usage`), the mean request latency and the prompt tokens the
server found cached (`usage.prompt_tokens_details.cached_tokens`, where it reports them); `--url` measures an already
running server instead. `--shared-document`: every request is the first prompt's document and a question of its own
(the workload that prefix reuse serves; the continued chat is `bench_chat_turns.py`).

KV memory, not asked of the servers (they have no such endpoint): the last request is generated once more here, in
process, with the same chat template and token count, into a KiviCache with the same settings and into a
DynamicCache, and their bytes are counted with kivi-xpu's own accounting (kivi_xpu.tools.memory.accounted_bytes).
A sequential server holds one request's cache at a time; continuous batching holds a paged pool for all running
requests (sized by its --cb-* options, not measured here).

The KIVI options are kivi-xpu serve's (--bits, --group-size, --residual-length, --meta-dtype, --kivi-option, ...):
they configure the kivi server and the memory count alike.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from kivi_xpu.integration import cache_kwargs
from kivi_xpu.tools.cli import positive_int
from kivi_xpu.tools.loading import resolve_model
from kivi_xpu.tools.machine import lscpu_lines
from kivi_xpu.tools.memory import MIB, accounted_bytes
from kivi_xpu.tools.plan import full_precision_blocks, load_config, model_shape, plan_rows
from kivi_xpu.tools.serve import add_arguments as add_kivi_arguments
from kivi_xpu.tools.serve import cache_config

SERVERS = ("kivi", "dynamic", "dynamic-cb", "kivi-cb", "vllm", "vllm-kivi")
VLLM = Path(__file__).resolve().parents[1] / ".venv-vllm" / "bin" / "vllm"  # `make vllm-env`
# What vLLM logs of its pool, and the plugin of its split: printed beside the throughput.
VLLM_CAPACITY = re.compile(
    r"(KV cache size: [\d,]+ tokens|Maximum concurrency for .*|KIVI pages: [\d.]+ MiB of KV = .*)"
)
# cache_config key -> kivi-xpu serve flag (the rest go through --kivi-option NAME=VALUE).
FLAGS = {
    "bits": "--bits",
    "group_size": "--group-size",
    "residual_length": "--residual-length",
    "meta_dtype": "--meta-dtype",
    "backend": "--backend",
    "device": "--sycl-device",
}


def server_command(name: str, model: str, dtype: str, kivi: dict, batching: dict) -> list[str]:
    """The command line that starts server ``name`` (one of SERVERS) with ``model`` preloaded on 127.0.0.1:0;
    ``batching``: ``block_size``, ``max_batch_tokens``, ``kv_memory_mib``, ``fp32_blocks`` and ``max_requests`` (or
    None) of the continuous-batching servers."""
    if name in ("vllm", "vllm-kivi"):
        return vllm_command(name, model, dtype, kivi, batching)
    common = [model, "--device", "cpu", "--dtype", dtype, "--host", "127.0.0.1", "--port", "0"]
    cb = ["--continuous-batching", "--cb-max-batch-tokens", str(batching["max_batch_tokens"])]
    if name in ("kivi", "kivi-cb"):
        flags = []
        for key, value in kivi.items():
            flags += [FLAGS[key], str(value)] if key in FLAGS else ["--kivi-option", f"{key}={value!r}"]
        if name == "kivi-cb":
            flags += [*cb, "--kv-memory", str(batching["kv_memory_mib"])]
            if batching["max_requests"]:
                flags += ["--max-requests", str(batching["max_requests"])]
        return [sys.executable, "-m", "kivi_xpu", "serve", *flags, *common]
    transformers_serve = [sys.executable, "-m", "transformers.cli.transformers", "serve", *common]
    if name == "dynamic-cb":
        transformers_serve += [*cb, "--cb-block-size", str(batching["block_size"])]
        transformers_serve += ["--cb-num-blocks", str(batching["fp32_blocks"])]
    return transformers_serve


def vllm_command(name: str, model: str, dtype: str, kivi: dict, batching: dict) -> list[str]:
    """`vllm serve` of .venv-vllm at its own defaults (compiled model, chunked prefill, prefix caching), the KV budget
    ``batching["kv_memory_mib"]``; ``vllm-kivi`` adds the plugin with ``kivi``'s settings (and ``max_requests``)."""
    if not VLLM.exists():
        raise SystemExit(f"{VLLM} is missing: run `make vllm-env` first")
    with socket.socket() as probe:  # vLLM takes no port 0
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [str(VLLM), "serve", model, "--dtype", dtype, "--host", "127.0.0.1", "--port", str(port),
               "--kv-cache-memory-bytes", f"{batching['kv_memory_mib']}M",
               "--enable-prompt-tokens-details"]  # fmt: skip
    if name == "vllm-kivi":
        options = {k: v for k, v in kivi.items() if k != "device"}
        if batching["max_requests"]:
            options["max_requests"] = batching["max_requests"]
        command += ["--additional-config", json.dumps({"kivi": options})]
    return command


def capacities(model_path: str, dtype: str, kivi: dict, batching: dict, prompt_tokens: int, new_tokens: int) -> dict:
    """Requests of ``prompt_tokens + new_tokens`` tokens each budget holds at once, as ``kivi-xpu plan`` computes them
    (the servers do not report it): transformers' full-precision pool of ``fp32_blocks``, KIVI pages in transformers'
    batching (capped by ``max_requests``), and vLLM's own pages and vLLM + KIVI at their defaults."""
    settings = {k: v for k, v in cache_kwargs(kivi).items() if k not in ("backend", "device")}
    rows = plan_rows(model_path, getattr(torch, dtype), [batching["kv_memory_mib"]], [(prompt_tokens, new_tokens)],
                     settings, page_size=batching["block_size"])  # fmt: skip
    held = {(row["engine"], row["pages"] == "KIVI 2-bit"): row["requests"] for row in rows if row["pages"] != "fp8"}
    cap = batching["max_requests"]
    kivi_requests = held["transformers", True] if cap is None else min(cap, held["transformers", True])
    return {"fp32_requests": held["transformers", False], "kivi_requests": kivi_requests,
            "vllm_requests": held["vllm", False], "vllm_kivi_requests": held["vllm", True]}  # fmt: skip


def fp32_blocks(model_path: str, dtype: str, kv_memory_mib: int, block_size: int) -> int:
    """Full-precision blocks (``block_size`` tokens of keys and values of every layer) in ``kv_memory_mib`` MiB."""
    shape = model_shape(load_config(model_path, None), 1)
    return full_precision_blocks(shape, getattr(torch, dtype), kv_memory_mib * MIB, block_size)


class Server:
    """A server subprocess; its URL is read from uvicorn's start line; stopped by :meth:`stop`."""

    def __init__(self, command: list[str], timeout: float):
        env = os.environ | {"HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_UPDATE_CHECK": "1"}
        # vLLM's CPU worker binds its OpenMP threads: every core of this machine.
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{os.cpu_count() - 1}")
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self.lines: list[str] = []
        self.url: str | None = None
        started = threading.Event()

        def drain():
            for line in self.process.stdout:
                self.lines.append(line)
                found = re.search(r"(?:Uvicorn running|Starting vLLM server) on (http://[\d.]+:\d+)", line)
                self.url = found.group(1) if found else self.url
                if self.url and ("Uvicorn running" in line or "Application startup complete" in line):
                    started.set()
            started.set()

        threading.Thread(target=drain, daemon=True).start()
        try:
            ready = started.wait(timeout) and self.url is not None
        except BaseException:  # SIGTERM (SystemExit) or Ctrl-C while the server starts
            self.stop()
            raise
        if not ready:
            self.stop()
            raise RuntimeError(f"{' '.join(command)} did not start within {timeout} s:\n{''.join(self.lines[-40:])}")

    def stop(self):
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def prompts(count: int, words: int) -> list[str]:
    """``count`` fixed prompts: "Summarize this article:" and the first ``words`` words of one news article each, or,
    when too few articles are that long, of consecutive ``words``-word windows of the articles run together."""
    from kivi_xpu.assets import news_text

    articles = [a.split() for a in news_text().read_text(encoding="utf-8").split("\n\n")]
    long_enough = [a for a in articles if len(a) >= words]
    if len(long_enough) >= count:
        return [f"Summarize this article: {' '.join(article[:words])}" for article in long_enough[:count]]
    corpus = [word for article in articles for word in article]
    if len(corpus) < count * words:
        raise ValueError(f"--requests {count} of {words} words (--prompt-words): the corpus has {len(corpus)} words")
    return [f"Summarize this text: {' '.join(corpus[i * words : (i + 1) * words])}" for i in range(count)]


def load(url: str, model: str, texts: list[str], concurrency: int, max_tokens: int) -> dict:
    """Sends one warm-up request, then ``texts`` from ``concurrency`` threads; the throughput and the last usage."""
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=3600, max_retries=0)

    def ask(text: str):
        start = time.perf_counter()
        response = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": text}], temperature=0, max_tokens=max_tokens
        )
        return response.usage, time.perf_counter() - start

    ask(texts[0])
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        results = list(pool.map(ask, texts))
    wall = time.perf_counter() - start
    tokens = sum(usage.completion_tokens for usage, _ in results)
    details = [usage.prompt_tokens_details for usage, _ in results]
    return {
        "prompt_tokens": sum(usage.prompt_tokens for usage, _ in results),
        "cached_tokens": sum((d.cached_tokens or 0) if d is not None else 0 for d in details),
        "requests_per_s": len(texts) / wall,
        "completion_tokens_per_s": tokens / wall,
        "mean_latency_s": sum(seconds for _, seconds in results) / len(results),
        "wall_s": wall,
        "completion_tokens": tokens,
        "last_usage": results[-1][0].model_dump(),
    }


def kv_bytes(model_path: str, dtype: str, text: str, new_tokens: int, kivi: dict) -> dict:
    """KV bytes of one request (the chat turn ``text``, ``new_tokens`` greedy tokens) in a KiviCache with ``kivi``
    and in a DynamicCache, generated in this process."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

    from kivi_xpu import KiviCache

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype), attn_implementation="kivi")
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, return_dict=True, return_tensors="pt"
    )
    result = {"prompt_tokens": inputs["input_ids"].shape[1], "new_tokens": new_tokens}
    for name, cache in (
        ("kivi", KiviCache(config=model.config, **cache_kwargs(kivi))),
        ("dynamic", DynamicCache(config=model.config)),
    ):
        model.generate(**inputs, cache=cache, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        result[f"{name}_bytes"] = accounted_bytes(cache)[0]
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="local model directory, or smollm2 (default)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--servers", nargs="+", choices=SERVERS, default=list(SERVERS), help="servers to start")
    parser.add_argument("--url", help="measure this running server instead of starting --servers")
    parser.add_argument("--requests", type=positive_int, default=16, help="N requests (default 16)")
    parser.add_argument("--concurrency", type=positive_int, default=4, help="client threads (default 4)")
    parser.add_argument("--max-tokens", type=positive_int, default=64, help="new tokens per request (default 64)")
    parser.add_argument("--prompt-words", type=positive_int, default=400, help="article words per prompt (400)")
    parser.add_argument(
        "--shared-document",
        action="store_true",
        help="every request: the same document (the first prompt) and a question of its own",
    )
    parser.add_argument("--startup-timeout", type=float, default=300, help="seconds to wait for a server (300)")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    parser.add_argument("--cb-block-size", type=positive_int, default=32, help="full-precision CB block tokens (32)")
    parser.add_argument("--cb-max-batch-tokens", type=positive_int, default=1024, help="CB batch tokens (1024)")
    add_kivi_arguments(parser)
    args = parser.parse_args(argv)
    machine = lscpu_lines()
    print("\n".join(machine), flush=True)
    # SIGTERM as an exit, so that the `finally` below stops the server this process started.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    kivi = cache_config(args)
    model = resolve_model(args.model)
    texts = prompts(args.requests, args.prompt_words)
    if args.shared_document:  # one document, a question of its own each
        document = texts[0]
        texts = [f"{document}\n\nQuestion {i + 1}: what is said about topic {i + 1}?" for i in range(args.requests)]

    runs = {}
    batching = {
        "block_size": args.cb_block_size,
        "max_batch_tokens": args.cb_max_batch_tokens,
        "kv_memory_mib": args.kv_memory,
        "max_requests": args.max_requests,
        "fp32_blocks": fp32_blocks(model, args.dtype, args.kv_memory, args.cb_block_size),
    }
    targets = [(name, server_command(name, model, args.dtype, kivi, batching)) for name in args.servers]
    if args.url:
        targets = [("url", None)]
    for name, command in targets:
        try:
            server = Server(command, args.startup_timeout) if command else None
        except RuntimeError as err:  # such as vLLM refusing a budget that cannot hold one request of its length
            runs[name] = {"error": str(err).splitlines()[-1]}
            print(f"{name:<11} did not start: {runs[name]['error']}", flush=True)
            continue
        try:
            runs[name] = load(server.url if server else args.url, model, texts, args.concurrency, args.max_tokens)
        finally:
            if server:
                server.stop()
        run = runs[name]
        if server:  # what vLLM (and the plugin) logged of the pool: the requests each holds
            found = [m for line in server.lines for m in VLLM_CAPACITY.findall(line)]
            run["capacity_log"] = list(dict.fromkeys(found))  # each process logs the plugin's plan
            for found in run["capacity_log"]:
                print(f"{name:<11} {found}", flush=True)
        print(
            f"{name:<11} {run['requests_per_s']:.3f} requests/s  {run['completion_tokens_per_s']:.1f} tokens/s  "
            f"mean latency {run['mean_latency_s']:.1f} s  ({args.requests} requests, concurrency {args.concurrency}, "
            f"{run['completion_tokens']} tokens in {run['wall_s']:.1f} s; prompt tokens found cached: "
            f"{run['cached_tokens']} of {run['prompt_tokens']})",
            flush=True,
        )
    served = [run for run in runs.values() if "error" not in run]
    if not served:
        return 1
    last_tokens = served[0]["last_usage"]["completion_tokens"]
    memory = kv_bytes(model, args.dtype, texts[-1], last_tokens, kivi)
    kivi_mib, dynamic_mib = memory["kivi_bytes"] / MIB, memory["dynamic_bytes"] / MIB
    print(
        f"KV of the last request ({memory['prompt_tokens']} prompt + {memory['new_tokens']} new tokens): KiviCache "
        f"{kivi_mib:.2f} MiB ({kivi or 'defaults'}), DynamicCache {dynamic_mib:.2f} MiB ({dynamic_mib / kivi_mib:.2f}x)"
    )
    held = capacities(model, args.dtype, kivi, batching, memory["prompt_tokens"], last_tokens)
    print(
        f"requests of {memory['prompt_tokens'] + last_tokens} tokens held at once in {batching['kv_memory_mib']} MiB "
        f"(continuous batching): full-precision pool {held['fp32_requests']} ({batching['fp32_blocks']} blocks of "
        f"{args.cb_block_size}), KIVI pages {held['kivi_requests']}; vLLM {held['vllm_requests']}, vLLM + KIVI "
        f"{held['vllm_kivi_requests']} (kivi-xpu plan)"
    )
    if args.json:
        settings = {k: v for k, v in vars(args).items() if k != "kivi_options"} | {"kivi": kivi}
        record = {"settings": settings, "machine": machine, "runs": runs, "kv": memory, "capacity": held,
                  "batching": batching}  # fmt: skip
        Path(args.json).write_text(json.dumps(record, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
