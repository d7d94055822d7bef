"""What a user gets without choosing anything: ``generate`` timings of the ways people pass a KiviCache, against
``DynamicCache``, on a model loaded plainly (no ``attn_implementation``).

Ways: ``dynamic`` (``DynamicCache``), ``readme`` (``cache=KiviCache(config=model.config)``, the README's snippet),
``no-config`` (``cache=KiviCache()``), ``cache-implementation`` (``cache_implementation="kivi"``) and ``sdpa-chosen``
(the README snippet on the same weights loaded with ``attn_implementation="sdpa"``: the dense path a user who chose
SDPA keeps). Each round runs every way once, in turn, the order rotating: one ``generate`` with ``--new-tokens``
whose streamer reads the clock at the first new token (time to first token: the prefill) and at the end (decode
ms/token over the other new tokens). Medians over ``--rounds``, ratios to ``dynamic`` from the same run (above 1:
faster than ``DynamicCache``). Not a test: run it on a quiet machine.

    python benchmarks/bench_default_paths.py --context 4096 --new-tokens 64 --rounds 3
    python benchmarks/bench_default_paths.py --device cuda --dtype float16
"""

import argparse
import statistics

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from kivi_xpu import KiviCache, assets
from kivi_xpu.tools.loading import text_tokens
from kivi_xpu.tools.machine import lscpu_lines
from kivi_xpu.tools.options import DTYPES
from kivi_xpu.tools.timing import GenerateClock

WAYS = ("dynamic", "readme", "no-config", "cache-implementation", "sdpa-chosen")

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--context", type=int, default=4096, help="prompt tokens (consecutive Wikipedia text)")
p.add_argument("--new-tokens", type=int, default=64)
p.add_argument("--rounds", type=int, default=3)
p.add_argument("--ways", nargs="+", choices=WAYS, default=list(WAYS))
p.add_argument("--device", default="cpu", help="where the model runs: cpu, xpu, cuda, ...")
p.add_argument("--dtype", choices=tuple(DTYPES), default="float32")
args = p.parse_args()

path = assets.smollm2_checkpoint()
load = dict(dtype=DTYPES[args.dtype], device_map=args.device)
plain = AutoModelForCausalLM.from_pretrained(path, **load).eval()
chosen = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa", **load).eval()
tokenizer = AutoTokenizer.from_pretrained(path)
ids = text_tokens(tokenizer, assets.wikipedia_text(), args.context)[None].to(args.device)


def run(way: str, new_tokens: int) -> tuple[float, float, torch.Tensor]:
    """(time to first token s, decode ms/token, new tokens) of one ``generate`` in ``way``."""
    model = chosen if way == "sdpa-chosen" else plain
    kwargs = {
        "dynamic": lambda: {"cache": DynamicCache()},
        "readme": lambda: {"cache": KiviCache(config=model.config)},
        "no-config": lambda: {"cache": KiviCache()},
        "cache-implementation": lambda: {"cache_implementation": "kivi"},
        "sdpa-chosen": lambda: {"cache": KiviCache(config=model.config)},
    }[way]()
    clock = GenerateClock()
    with torch.inference_mode():
        out = model.generate(
            ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, streamer=clock, **kwargs
        )
    return clock.first - clock.start, clock.decode_ms_per_token(new_tokens), out[0, ids.shape[1] :]


for way in args.ways:  # untimed: kernel compilation, first-touch allocations
    run(way, 3)
first, decode, tokens = ({w: [] for w in args.ways} for _ in range(3))
for r in range(args.rounds):
    order = args.ways[r % len(args.ways) :] + args.ways[: r % len(args.ways)]
    for way in order:
        ttft, ms, tokens[way] = run(way, args.new_tokens)
        first[way].append(ttft)
        decode[way].append(ms)

for line in lscpu_lines():
    print(line)
print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, SmolLM2-135M {args.dtype} on {args.device}, ")
print(f"context {ids.shape[1]}, {args.new_tokens} new tokens, {args.rounds} interleaved rounds (medians)")
print(f"{'way':22} {'TTFT s':>8} {'vs dyn':>7} {'decode ms/tok':>14} {'vs dyn':>7}  same tokens as dynamic")
base_first = statistics.median(first[args.ways[0]])
base_decode = statistics.median(decode[args.ways[0]])
for way in args.ways:
    ttft, ms = statistics.median(first[way]), statistics.median(decode[way])
    agree = int((tokens[way] == tokens[args.ways[0]]).cumprod(0).sum())
    print(
        f"{way:22} {ttft:8.2f} {ttft / base_first:6.3f}x {ms:14.1f} {base_decode / ms:6.2f}x  "
        f"{agree}/{args.new_tokens} first tokens"
    )
