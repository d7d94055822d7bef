"""Backend choice without a SYCL device (and, for `auto`, without the native CPU extension): the reference path with
one clear warning, or a clear error when SYCL was required. Run in subprocesses, because the SYCL runtime reads
OCL_ICD_FILENAMES once per process."""

import os
import subprocess
import sys

SCRIPT = """
import sys
sys.modules["kivi_xpu._cpu"] = None  # an install without the native CPU extension: importing it fails
import warnings
warnings.simplefilter("always")
import torch
torch.manual_seed(0)  # random weights: seeded, and min_new_tokens, so an early EOS cannot shorten the output
from transformers import LlamaConfig, LlamaForCausalLM
from kivi_xpu import KiviCache
config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=2, num_key_value_heads=1)
model = LlamaForCausalLM(config).eval()
caches = [KiviCache(config=config, group_size=16, residual_length=16) for _ in range(2)]
print("backend:", caches[0].backend.name)
out = model.generate(torch.randint(0, 64, (1, 20)), cache=caches[0], max_new_tokens=30,
                     min_new_tokens=30, do_sample=False)
print("generated:", out.shape[1])
"""


def run_without_sycl_device(backend: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OCL_ICD_FILENAMES="/nonexistent/libintelocl.so", KIVI_XPU_BACKEND=backend)
    env.pop("KIVI_XPU_DEVICE", None)
    return subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=300)


def test_without_a_device_auto_falls_back_to_the_reference_with_one_warning():
    result = run_without_sycl_device("auto")
    assert result.returncode == 0, result.stderr
    assert "backend: reference" in result.stdout and "generated: 50" in result.stdout
    assert result.stderr.count("using the reference (pure PyTorch) kernels") == 1, result.stderr


def test_without_a_device_a_required_sycl_backend_is_a_clear_error():
    result = run_without_sycl_device("sycl")
    assert result.returncode != 0
    assert "backend 'sycl' requested but unavailable" in result.stderr
