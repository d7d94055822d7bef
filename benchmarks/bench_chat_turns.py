"""A chat continued through the servers: time to the first token of each turn of one conversation (a document and a
question, then follow-up questions, each turn sending the whole conversation so far), streamed with the official
``openai`` client, against each server in turn (started here on 127.0.0.1 as ``bench_serve.py`` starts them):

* ``kivi``: ``kivi-xpu serve`` (sequential), which continues a kept conversation (``--reuse-memory``);
* ``kivi-fresh``: the same with ``--reuse-memory 0`` (every turn prefilled whole, as before it kept them);
* ``dynamic``: ``transformers serve`` (sequential, DynamicCache, no reuse);
* ``dynamic-cb`` / ``kivi-cb``: the continuous-batching servers (transformers' pool shares cached blocks; KIVI pages
  start a request after the cached exact units of its prompt);
* ``kivi-cb-fresh``: ``kivi-cb`` with ``--no-prefix-reuse``.

    python benchmarks/bench_chat_turns.py --model smollm2 --servers kivi kivi-fresh dynamic-cb --prompt-words 1300
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serve import Server, fp32_blocks, prompts, server_command  # noqa: E402

from kivi_xpu.tools.loading import resolve_model  # noqa: E402
from kivi_xpu.tools.machine import lscpu_lines  # noqa: E402

SERVERS = ("kivi", "kivi-fresh", "dynamic", "dynamic-cb", "kivi-cb", "kivi-cb-fresh")
FRESH_FLAGS = {"kivi-fresh": ["--reuse-memory", "0"], "kivi-cb-fresh": ["--no-prefix-reuse"]}
QUESTIONS = (
    "What is the main topic of this document? Answer in one sentence.",
    "Who are the people named in it?",
    "What happens next, according to it?",
    "Summarize it in three words.",
)


def first_token_seconds(client, model: str, messages: list[dict], max_tokens: int) -> tuple[float, str]:
    """Seconds to the first streamed content of one chat turn, and the whole answer."""
    start, first, parts = time.perf_counter(), None, []
    stream = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=max_tokens,
                                            stream=True)  # fmt: skip
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() - start if first is None else first
            parts.append(chunk.choices[0].delta.content)
    return (time.perf_counter() - start if first is None else first), "".join(parts)


def conversation(url: str, model: str, document: str, turns: int, max_tokens: int) -> list[float]:
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=600, max_retries=0)
    first_token_seconds(client, model, [{"role": "user", "content": "Hello."}], 4)  # warm-up
    messages, seconds = [], []
    for turn in range(turns):
        question = QUESTIONS[turn % len(QUESTIONS)]
        content = f"{document}\n\n{question}" if turn == 0 else question
        messages.append({"role": "user", "content": content})
        took, answer = first_token_seconds(client, model, messages, max_tokens)
        seconds.append(took)
        messages.append({"role": "assistant", "content": answer})
    return seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2", help="local model directory, or smollm2 (default)")
    p.add_argument("--servers", nargs="+", choices=SERVERS, default=["kivi", "kivi-fresh", "dynamic-cb"])
    p.add_argument("--prompt-words", type=int, default=1300, help="document words (default 1300: ~1.9k tokens)")
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=32, help="new tokens per answer (default 32)")
    p.add_argument("--kv-memory", type=int, default=512, help="MiB of the continuous-batching servers (512)")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    args = p.parse_args()
    print(*lscpu_lines(), sep="\n", flush=True)
    model = str(resolve_model(args.model))
    document = prompts(1, args.prompt_words)[0].removeprefix("Summarize this article: ")
    blocks = fp32_blocks(model, "float32", args.kv_memory, 32)  # transformers' pool at the same memory
    batching = dict(max_batch_tokens=1024, kv_memory_mib=args.kv_memory, block_size=32, max_requests=None,
                    fp32_blocks=blocks)  # fmt: skip
    results = {}
    for name in args.servers:
        command = server_command(name.removesuffix("-fresh"), model, "float32", {}, batching)
        if name in FRESH_FLAGS:
            command[command.index("serve") + 1 : command.index("serve") + 1] = FRESH_FLAGS[name]
        server = Server(command, timeout=300)
        try:
            results[name] = conversation(server.url, model, document, args.turns, args.max_tokens)
        finally:
            server.stop()
        turns = " / ".join(f"{s:.2f}" for s in results[name])
        later = " ".join(f"{s / results[name][0]:.2f}x" for s in results[name][1:])
        print(f"{name}: first token of turns 1..{args.turns}: {turns} s (later turns / turn 1: {later})", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "first_token_seconds": results}, indent=1))


if __name__ == "__main__":
    main()
