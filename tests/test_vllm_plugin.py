"""The vLLM plugin (kivi_xpu.vllm): its start-up plan here, and vLLM's CPU engine with KIVI pages in the vLLM
environment (.venv-vllm, made by `make vllm-env`; tests/vllm/run_engine.py runs the engine there, eager, on a tiny
random Llama written by this test): each answer equals the request's own `generate` with `KiviCache`, under chunked
prefill, up to near-ties whose margins are stated."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kivi_xpu import KiviCache
from kivi_xpu.paged.budget import PageShape
from kivi_xpu.vllm.plan import PLUGIN_KEYS, SETTINGS_KEYS, check_vllm_version, kivi_options, plan

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
NEAR_TIE = 0.15  # logit margin under which a different greedy token is a near-tie (fp32 rounding can flip it)
MiB = 2**20


class _Config:
    def __init__(self, kivi):
        self.additional_config = {"kivi": kivi}


def test_settings_keys_are_kivicache_arguments():
    """The "kivi" keys are KiviCache's keyword arguments, less those that mean nothing in vLLM."""
    import inspect

    arguments = set(inspect.signature(KiviCache.__init__).parameters) - {"self", "config", "device", "attention"}
    assert set(SETTINGS_KEYS) == arguments


def test_bad_options_are_named():
    with pytest.raises(ValueError, match=r"unknown keys \['bitz'\]"):
        kivi_options(_Config({"bitz": 2}))
    with pytest.raises(ValueError, match="must be an object"):
        kivi_options(_Config([2]))
    assert kivi_options(type("C", (), {"additional_config": {}})()) is None
    with pytest.raises(RuntimeError, match="built for vLLM 0.32.0"):
        check_vllm_version("0.33.0")
    check_vllm_version("0.32.0+cpu")
    config = LlamaConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    shape = PageShape(2, 32, 2)
    with pytest.raises(ValueError, match='"max_requests" must be a positive integer'):
        plan({"max_requests": 0}, config, shape, torch.float32, 64 * MiB, 128, 2048, 1024)
    with pytest.raises(ValueError, match="too small for KIVI pages"):
        plan({}, config, shape, torch.float32, 1 * MiB, 128, 2048, 4096)
    with pytest.raises(ValueError, match="bits"):
        plan({"bits": 3}, config, shape, torch.float32, 64 * MiB, 128, 2048, 1024)


def test_plan_counts_every_byte():
    """The units and the pages vLLM is told fit in the budget; the pages of a block are the layers' largest."""
    shape = dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64)
    config = LlamaConfig(**shape)
    budget = 768 * MiB
    result = plan({}, config, PageShape(3, 64, 30), torch.float32, budget, 128, 2048, 4096)
    assert result.unit_pool_bytes + result.page_budget <= budget
    assert result.num_blocks * result.page_bytes * 30 <= result.page_budget
    fp32_tokens = budget // (30 * 2 * 3 * 64 * 4)
    # packed tokens: 10x vLLM's fp32 tokens in less than two thirds of the bytes
    assert result.num_blocks * result.block_tokens > 6 * fp32_tokens
    assert set(PLUGIN_KEYS) == {"max_requests", "staging_tokens"}


def _model(path: Path) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096,
                         tie_word_embeddings=False, initializer_range=0.2)  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(path)
    return model


def _run_engine(tmp_path: Path, spec: dict) -> dict:
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(json.dumps(spec))
    cores = f"0-{os.cpu_count() - 1}"  # the worker's OpenMP threads on every core
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=os.environ.get("VLLM_CPU_OMP_THREADS_BIND", cores),
               KIVI_XPU_BACKEND="native", VLLM_PLUGINS="kivi")  # fmt: skip
    env.pop("KIVI_XPU_REQUIRE_SYCL", None)  # the vLLM environment runs the native kernels (no SYCL runtime there)
    done = subprocess.run([str(VLLM_PYTHON), str(ROOT / "tests" / "vllm" / "run_engine.py"), str(spec_file)],
                          capture_output=True, text=True, timeout=900, env=env, cwd=tmp_path)  # fmt: skip
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, f"vLLM engine failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    return json.loads(lines[-1][len("RESULT ") :])


@pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="no .venv-vllm (make vllm-env)")
def test_vllm_answers_equal_own_generate(tmp_path):
    """Three prompts (45, 300 and 700 tokens) in chunks of at most 256 tokens, 16 new tokens each: every answer
    equals the request's own generate with KiviCache, the same settings, or differs first at a near-tie."""
    model = _model(tmp_path / "model")
    prompts = [[(i * 13) % 500 + 1 for i in range(45)], list(range(1, 300)), [(i * 7) % 500 + 1 for i in range(700)]]
    new_tokens = 16
    engine = {"kv_cache_memory_bytes": 64 * MiB, "max_model_len": 1024, "max_num_batched_tokens": 256}
    spec = {"model": str(tmp_path / "model"), "dtype": "float32", "max_tokens": new_tokens, "prompts": prompts,
            "engine": engine, "kivi": {"staging_tokens": 1024}}  # fmt: skip
    result = _run_engine(tmp_path, spec)
    assert result["block_size"] == 128
    for prompt, answer in zip(prompts, result["answers"], strict=True):
        ids = torch.tensor([prompt])
        cache = KiviCache(model.config, backend="native")  # the kernels the vLLM environment runs
        own = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, cache=cache)
        expected = own[0, len(prompt) :].tolist()
        got = answer["tokens"]
        if got != expected:
            first = next(i for i, (a, b) in enumerate(zip(got, expected, strict=True)) if a != b)
            margin = answer["margins"][first]
            assert margin <= NEAR_TIE, f"{len(prompt)}-token prompt differs at token {first} (margin {margin:.3f})"
    # The same budget as vLLM's own fp32 pages holds many times the tokens.
    own_pages = _run_engine(tmp_path, dict(spec, kivi=None, prompts=prompts[:1], max_tokens=1))
    assert result["num_blocks"] * 128 >= 6 * own_pages["num_blocks"] * own_pages["block_size"]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
