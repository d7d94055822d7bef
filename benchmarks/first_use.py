"""First-use cost: the extra wall time of a tiny-model fused KiviCache generate over a DynamicCache one, in this
(fresh) process, with the time of each phase before it.

python benchmarks/first_use.py                     # the kernel cache under $KIVI_XPU_CACHE (else ~/.cache/kivi_xpu)
KIVI_XPU_CACHE=$(mktemp -d) python benchmarks/first_use.py   # a fresh machine: nothing compiled yet
KIVI_XPU_BACKEND=sycl python benchmarks/first_use.py         # the SYCL kernels on the CPU device

Prints one line of ``phase seconds`` pairs and ``extra`` = KiviCache generate - DynamicCache generate (a first
DynamicCache generate warms torch up, so its own first-call costs land on neither).
"""

from __future__ import annotations

import time

start = time.perf_counter()
phases: dict[str, float] = {}


def mark(name: str) -> None:
    global start
    now = time.perf_counter()
    phases[name] = now - start
    start = now


import torch  # noqa: E402

mark("import_torch")
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM  # noqa: E402

mark("import_transformers")
import kivi_xpu  # noqa: E402

mark("import_kivi_xpu")

torch.manual_seed(0)
config = LlamaConfig(
    vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2,
)  # fmt: skip
model = LlamaForCausalLM(config).eval()
kivi_xpu.use_fused_attention(model)
inputs = {"input_ids": torch.randint(0, 256, (1, 48)), "attention_mask": torch.ones(1, 48, dtype=torch.long)}
options = dict(max_new_tokens=48, min_new_tokens=48, do_sample=False)
mark("model")


def generate(cache) -> float:
    begin = time.perf_counter()
    with torch.no_grad():
        model.generate(**inputs, cache=cache, **options)
    return time.perf_counter() - begin


phases["dynamic_warmup"] = generate(DynamicCache(config=config))  # torch's own first-call costs
phases["dynamic_generate"] = generate(DynamicCache(config=config))
begin = time.perf_counter()
cache = kivi_xpu.KiviCache(config=config, bits=2, group_size=32, residual_length=32)
generate(cache)
phases["kivi_generate"] = time.perf_counter() - begin  # the cache chooses its backend when built
phases["extra"] = phases["kivi_generate"] - phases["dynamic_generate"]
begin = time.perf_counter()
generate(kivi_xpu.KiviCache(config=config, bits=2, group_size=32, residual_length=32))
phases["kivi_again"] = time.perf_counter() - begin  # steady state: what is left of `extra` is not first-use cost
print(f"backend={cache.backend.name} " + " ".join(f"{k}={v:.2f}" for k, v in phases.items()))
if cache.backend.name == "sycl":
    from kivi_xpu import runtime

    built = runtime.compiled_kernels(cache.backend.sycl_device)
    print(f"{len(built)} kernel builds: " + ", ".join(f"{name} {seconds:.2f} s" for name, seconds in built.items()))
