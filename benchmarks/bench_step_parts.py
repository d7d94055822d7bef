"""Where a decode step of SmolLM2-135M goes, per cache: StaticCache against KiviCache (fused), steps interleaved.

The same prefill fills both caches (as in ``bench_decode_steps.py``); then ``--steps`` single-token steps of each cache
alternate, and timers around the model's pieces sum, per step, the time of: the attention modules (``attn``; of which
the q/k/v/o projections, the cache's ``update`` and the attention function, the rest being rotary embeddings and
reshapes), the MLPs, the norms and the LM head; for KIVI also the native ``append_decode_step`` and
``decode_attention`` calls inside the update and the attention function. Medians per step in ms (the first 3 steps
untimed), then the difference Static minus KIVI. Unlike a micro-benchmark of one layer, this sees each piece as the
model runs it: between two steps of a layer the other layers' weights pass through the caches, so the Python and
the tensors of a layer's step are cold. The timers cost ~1 us each and are the same for both caches.

    python benchmarks/bench_step_parts.py --ctx 1024 --batch 1
"""

import argparse
import collections
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, DynamicCache, StaticCache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from kivi_xpu import KiviCache, assets
from kivi_xpu.integration import cache_argument
from kivi_xpu.runtime import load_native_extension
from kivi_xpu.tools.machine import lscpu_lines

p = argparse.ArgumentParser()
p.add_argument("--ctx", type=int, default=1024)
p.add_argument("--batch", type=int, default=1)
p.add_argument("--steps", type=int, default=40)
args = p.parse_args()
print(*lscpu_lines(), sep="\n")

clock = time.perf_counter
spent = collections.defaultdict(float)  # seconds per piece in the current step


def timed(fn, piece):
    def run(*a, **k):
        t0 = clock()
        try:
            return fn(*a, **k)
        finally:
            spent[piece] += clock() - t0

    return run


torch.manual_seed(0)
model = AutoModelForCausalLM.from_pretrained(assets.smollm2_checkpoint(), dtype=torch.float32).eval()
cfg = model.config
for layer in model.model.layers:
    attn = layer.self_attn
    attn.forward = timed(attn.forward, "attn")
    for proj in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj):
        proj.forward = timed(proj.forward, "attn: projections")
    layer.mlp.forward = timed(layer.mlp.forward, "mlp")
    for norm in (layer.input_layernorm, layer.post_attention_layernorm):
        norm.forward = timed(norm.forward, "norms")
model.lm_head.forward = timed(model.lm_head.forward, "lm_head")
for name in ("sdpa", "kivi"):
    ALL_ATTENTION_FUNCTIONS[name] = timed(ALL_ATTENTION_FUNCTIONS[name], "attn: attention function")
native = load_native_extension()
for op in ("append_decode_step", "decode_attention"):  # (before any cache resolves them)
    setattr(native, op, timed(getattr(native, op), f"  native {op}"))

ctx, batch = args.ctx, args.batch
with torch.inference_mode():
    ids = torch.randint(0, 30000, (batch, ctx))
    prefill = DynamicCache(config=cfg)
    model.set_attn_implementation("sdpa")
    model(input_ids=ids, **cache_argument(prefill), use_cache=True)
    kv = [(layer.keys[:, :, :ctx].clone(), layer.values[:, :, :ctx].clone()) for layer in prefill.layers]
    del prefill

kinds = ("static", "kivi")
caches = {"static": StaticCache(config=cfg, max_cache_len=ctx + args.steps + 4), "kivi": KiviCache(config=cfg)}
for cache in caches.values():
    for i, (k, v) in enumerate(kv):
        cache.update(k, v, i, {"cache_position": torch.arange(ctx)})
    cache.update = timed(cache.update, "attn: cache update")
first = torch.randint(0, 1000, (batch, 1))
tokens = {kind: first.clone() for kind in kinds}
record = {kind: collections.defaultdict(list) for kind in kinds}
with torch.inference_mode():
    for s in range(args.steps):
        pos = torch.tensor([ctx + s])
        for i in range(len(kinds)):
            kind = kinds[(s + i) % len(kinds)]
            model.set_attn_implementation("kivi" if kind == "kivi" else "sdpa")
            spent.clear()
            t0 = clock()
            out = model(input_ids=tokens[kind], **cache_argument(caches[kind]), cache_position=pos,
                        position_ids=pos.expand(batch, 1))  # fmt: skip
            total = clock() - t0
            tokens[kind] = out.logits[:, -1:].argmax(-1)
            parts = {"step": total, **spent}
            parts["attn: rest (rotary, reshapes)"] = spent["attn"] - sum(
                spent[k] for k in ("attn: projections", "attn: cache update", "attn: attention function")
            )
            parts["outside the layers"] = total - sum(spent[k] for k in ("attn", "mlp", "norms", "lm_head"))
            for piece, seconds in parts.items():
                record[kind][piece].append(seconds)


def median_ms(kind, piece):
    times = record[kind].get(piece, [])[3:]
    return statistics.median(times) * 1e3 if times else 0.0


ORDER = ("step", "attn", "attn: projections", "attn: cache update", "  native append_decode_step",
         "attn: attention function", "  native decode_attention", "attn: rest (rotary, reshapes)", "mlp", "norms",
         "lm_head", "outside the layers")  # fmt: skip
print(f"ctx {ctx}, batch {batch}, {args.steps} steps, ms per step (median) | static  kivi  static - kivi")
for piece in ORDER:
    static, kivi = median_ms("static", piece), median_ms("kivi", piece)
    print(f"  {piece:32s} {static:8.3f} {kivi:8.3f} {static - kivi:+8.3f}")
print(f"static/KIVI step: {median_ms('static', 'step') / median_ms('kivi', 'step'):.3f}x")
