"""The vLLM plugin (kivi_xpu.vllm): its start-up plan here, and vLLM's CPU engine with KIVI pages in the vLLM
environment (.venv-vllm, made by `make vllm-env`; kivi_xpu.vllm.offline and tests/vllm/run_faults.py run the engine
there, eager, on a tiny random Llama written by this test): each answer equals the request's own `generate` with
`KiviCache`, under chunked prefill, up to near-ties whose margins are stated; faults leave the pool as it was."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kivi_xpu import KiviCache
from kivi_xpu.paged.budget import PageShape
from kivi_xpu.tools.plan import plan_rows
from kivi_xpu.vllm import offline
from kivi_xpu.vllm.plan import PLUGIN_KEYS, SETTINGS_KEYS, check_vllm_version, kivi_options, plan

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = offline.VLLM_PYTHON
NEAR_TIE = 0.15  # logit margin under which a different greedy token is a near-tie (fp32 rounding can flip it)
MiB = 2**20
# The tiny model's blocks at this budget: 70, of which 4 windows take 56 (14 each); 4 requests of 100 + 420 tokens
# want 20 of the other 13 for their pages.
KV_FOR_PREEMPTION = 70 * 2 * 6144


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
        plan({}, config, shape, torch.float32, MiB // 2, 128, 2048, 4096)
    with pytest.raises(ValueError, match='"staging_tokens" \\(4000\\) does not fit'):
        plan({"staging_tokens": 4000}, config, shape, torch.float32, MiB, 128, 2048, 4096)
    assert plan({}, config, shape, torch.float32, MiB, 128, 2048, 4096).staging_units == 1  # as much as fits
    with pytest.raises(ValueError, match="bits"):
        plan({"bits": 3}, config, shape, torch.float32, 64 * MiB, 128, 2048, 1024)


def test_plan_counts_every_byte():
    """vLLM is told the whole budget: its blocks hold the pages and, a whole number of blocks each, the exact units;
    a request holds its pages and its window's unit, so at 4k tokens the budget holds 6x vLLM's fp32 tokens."""
    shape = dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64)
    config = LlamaConfig(**shape)
    budget = 768 * MiB
    result = plan({}, config, PageShape(3, 64, 30), torch.float32, budget, 128, 2048, 4096)
    assert result.num_blocks * result.page_bytes * 30 <= budget
    assert result.unit_blocks * result.page_bytes * 30 >= result.unit_bytes
    assert result.staging_units * result.rows >= 4095  # every prompt of max_model_len stays exact
    fp32_tokens = budget // (30 * 2 * 3 * 64 * 4)
    assert result.requests_held(4052) * 4052 >= 6 * fp32_tokens
    assert set(PLUGIN_KEYS) == {"max_requests", "staging_tokens"}


def _model(path: Path) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096,
                         tie_word_embeddings=False, initializer_range=0.2)  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(path)
    return model


def _run_engine(tmp_path: Path, spec: dict, script: str | None = None) -> dict:
    """Runs ``kivi_xpu.vllm.offline`` (or ``tests/vllm/<script>``) on ``spec`` in .venv-vllm; its RESULT."""
    return offline.run(spec, None if script is None else ROOT / "tests" / "vllm" / script, timeout=900)


def _assert_own_answer(model, prompt: list[int], answer: dict) -> None:
    """vLLM's ``answer`` (its tokens, and per step its margins when it has log-probabilities) equals the prompt's own
    greedy generate with KiviCache, or differs first at a near-tie: of vLLM's margins, else of the own logits."""
    new_tokens = len(answer["tokens"])
    cache = KiviCache(model.config, backend="native")  # the kernels the vLLM environment runs
    own = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                         do_sample=False, cache=cache, output_scores=True, return_dict_in_generate=True)  # fmt: skip
    expected, got = own.sequences[0, len(prompt) :].tolist(), answer["tokens"]
    if got != expected:
        first = next(i for i, (a, b) in enumerate(zip(got, expected, strict=True)) if a != b)
        if "margins" in answer:
            margin = answer["margins"][first]
        else:
            top = own.scores[first][0].topk(2).values
            margin = float(top[0] - top[1])
        assert margin <= NEAR_TIE, f"{len(prompt)}-token prompt differs at token {first} (margin {margin:.3f})"


@pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="no .venv-vllm (make vllm-env)")
def test_vllm_answers_equal_own_generate(tmp_path):
    """Three prompts (45, 300 and 700 tokens) in chunks of at most 256 tokens, 16 new tokens each, then two that
    start with the 700 (prefix-cache hits: the whole 700 and 100 more, its prompt ending in the hit's chunk; its first
    600 and 300 more, a chunk later): every answer equals the request's own generate with KiviCache, the same
    settings, or differs first at a near-tie."""
    model = _model(tmp_path / "model")
    document = [(i * 7) % 500 + 1 for i in range(700)]
    prompts = [[(i * 13) % 500 + 1 for i in range(45)], list(range(1, 300)), document]
    then = [document + [(i * 11) % 500 + 1 for i in range(100)], document[:600] + list(range(3, 303))]
    new_tokens = 16
    engine = {"kv_cache_memory_bytes": 64 * MiB, "max_model_len": 1024, "max_num_batched_tokens": 256}
    spec = {"model": str(tmp_path / "model"), "dtype": "float32", "max_tokens": new_tokens, "prompts": prompts,
            "then": then, "engine": engine, "kivi": {"staging_tokens": 1024}}  # fmt: skip
    result = _run_engine(tmp_path, spec)
    assert result["block_size"] == 128
    for prompt, answer in zip(prompts + then, result["answers"], strict=True):
        _assert_own_answer(model, prompt, answer)
    # The 700's pages 0-3 were complete when its prompt was stored, page 4 when vLLM freed it (its window packed):
    # a hit reads whole blocks whose pages were written after the same sinks' worth of tokens.
    assert [answer["cached"] for answer in result["answers"]] == [0, 0, 0, 640, 512]
    # The same budget as vLLM's own fp32 pages holds many times the tokens.
    own_pages = _run_engine(tmp_path, dict(spec, kivi=None, prompts=prompts[:1], then=[], max_tokens=1))
    assert result["num_blocks"] * 128 >= 6 * own_pages["num_blocks"] * own_pages["block_size"]
    # `kivi-xpu plan` says what both pools hold.
    planned = plan_rows(str(tmp_path / "model"), torch.float32, [64], [(700, 16)], spec["kivi"], max_model_len=1024,
                        max_batched_tokens=256, engines=("vllm",))  # fmt: skip
    pool_tokens = {row["pages"]: row["pool_tokens"] for row in planned}
    assert pool_tokens["KIVI 2-bit"] == result["num_blocks"] * result["block_size"]
    assert pool_tokens["float32"] == own_pages["num_blocks"] * own_pages["block_size"]


@pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="no .venv-vllm (make vllm-env)")
def test_two_ranks_answer_as_own_generate_with_half_the_bytes_each(tmp_path):
    """Tensor parallelism at 2 ranks on this host (gloo and shared memory, a core each): each rank stores its KV
    heads' pages and units, half the bytes of one rank's, and the answers are still their own generate's, a
    prefix-cache hit's too."""
    model = _model(tmp_path / "model")
    prompts = [list(range(1, 300)), [(i * 7) % 500 + 1 for i in range(45)]]
    engine = {"kv_cache_memory_bytes": 64 * MiB, "max_model_len": 1024, "max_num_batched_tokens": 256,
              "tensor_parallel_size": 2}  # fmt: skip
    then = [prompts[0] + [(i * 5) % 500 + 1 for i in range(100)]]  # a prefix-cache hit: the ledger serves both ranks
    spec = {"model": str(tmp_path / "model"), "dtype": "float32", "max_tokens": 16, "prompts": prompts,
            "then": then, "engine": engine, "kivi": {}}  # fmt: skip
    result = _run_engine(tmp_path, spec)
    for prompt, answer in zip(prompts + then, result["answers"], strict=True):
        _assert_own_answer(model, prompt, answer)
    assert [answer["cached"] for answer in result["answers"]] == [0, 0, 256]
    one_rank = plan({}, model.config, PageShape(2, 32, 2), torch.float32, 64 * MiB, 128, 256, 1024)
    assert 2 * result["block_bytes"] == one_rank.page_bytes * 2  # two layers
    assert 2 * result["unit_bytes"] == one_rank.unit_bytes


@pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="no .venv-vllm (make vllm-env)")
def test_faults_leave_the_pool_as_it_was(tmp_path):
    """An abort mid-prefill, an abort mid-decode, requests preempted for want of pages and a request longer than the
    model length: after each (and a short request run next), vLLM's free blocks and the plugin's free exact units are
    those before it, and no request holds units; the preempted requests still answer as their own generate."""
    model = _model(tmp_path / "model")
    engine = {"kv_cache_memory_bytes": KV_FOR_PREEMPTION, "max_model_len": 1024, "max_num_batched_tokens": 128,
              "max_num_seqs": 4}  # fmt: skip
    spec = {"model": str(tmp_path / "model"), "dtype": "float32", "engine": engine,
            "kivi": {"staging_tokens": 256, "max_requests": 4}, "long_prompt": 600, "crowd": 4,
            "crowd_prompt": 100, "crowd_new": 420}  # fmt: skip
    report = _run_engine(tmp_path, spec, "run_faults.py")
    baseline = report["baseline"]  # the warm-up request's units came back as vLLM freed its blocks
    assert baseline["requests"] == [] and baseline["free_units"] > 0 and baseline["pins"] == 0
    assert report["mid_prefill"]["requests"] == ["prefilling"]
    assert report["mid_prefill"]["free_blocks"] < baseline["free_blocks"]
    assert report["mid_decode_tokens"] >= 4
    assert max(report["preempted_with_answer_tokens"], default=0) > 1, "the crowd was to be preempted mid-answer"
    assert report["crowd_finished"] == [f"crowd-{i}" for i in range(4)]
    for answer in report["crowd"]:  # a preempted request's answer is still its own generate's
        _assert_own_answer(model, answer["prompt"], answer)
    assert "ValidationError" in (report["oversized_error"] or "") and "1025" in report["oversized_error"]
    for after in ("after_prefill_abort", "after_decode_abort", "after_crowd", "after_oversized"):
        assert report[after] == baseline, f"{after}: {report[after]} != {baseline}"


def _serve(model_dir: Path, log: Path) -> tuple[subprocess.Popen, str]:
    """``vllm serve`` of .venv-vllm with the plugin on ``model_dir`` (eager, a free port); the process and its URL
    once the server is up."""
    with socket.socket() as probe:  # vLLM takes no port 0
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = offline.engine_env(ranks=1) | {"HF_HUB_OFFLINE": "1"}
    command = [str(VLLM_PYTHON.parent / "vllm"), "serve", str(model_dir), "--dtype", "float32", "--enforce-eager",
               "--skip-tokenizer-init", "--host", "127.0.0.1", "--port", str(port), "--kv-cache-memory-bytes", "64M",
               "--max-model-len", "1024", "--enable-prompt-tokens-details", "--additional-config",
               json.dumps({"kivi": {"staging_tokens": 1024}})]  # fmt: skip
    server = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 300
    while "Application startup complete" not in log.read_text():
        if server.poll() is not None or time.monotonic() > deadline:
            server.kill()
            raise AssertionError(f"vllm serve did not start:\n{log.read_text()[-4000:]}")
        time.sleep(1)
    return server, f"http://127.0.0.1:{port}"


def _post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


@pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="no .venv-vllm (make vllm-env)")
def test_the_openai_server_answers_counts_and_refuses_with_the_plugin(tmp_path):
    """`vllm serve --additional-config '{"kivi": {...}}'`: a completion is its own generate's, its usage counts the
    tokens (cached_tokens 0: prefix caching is off with KIVI pages), /metrics counts them too and shows the plugin's
    pool (block 128, its blocks), and a prompt over max_model_len gets HTTP 400."""
    model = _model(tmp_path / "model")
    server, url = _serve(tmp_path / "model", tmp_path / "server.log")
    try:
        prompt = [(i * 11) % 500 + 1 for i in range(300)]
        status, answer = _post(f"{url}/v1/completions", {"model": str(tmp_path / "model"), "prompt": prompt,
                                                         "max_tokens": 12, "temperature": 0, "ignore_eos": True,
                                                         "return_token_ids": True})  # fmt: skip
        assert status == 200, answer
        _assert_own_answer(model, prompt, {"tokens": answer["choices"][0]["token_ids"]})
        usage = answer["usage"]
        assert (usage["prompt_tokens"], usage["completion_tokens"]) == (300, 12)
        assert usage["prompt_tokens_details"]["cached_tokens"] == 0
        status, refused = _post(f"{url}/v1/completions", {"model": str(tmp_path / "model"), "prompt": [1] * 1025,
                                                          "max_tokens": 4})  # fmt: skip
        assert status == 400, refused
        with urllib.request.urlopen(f"{url}/metrics", timeout=60) as response:
            metrics = response.read().decode()
        assert re.search(r"^vllm:prompt_tokens_total\{[^}]*\} 300\.0$", metrics, re.M), metrics[:2000]
        assert re.search(r"^vllm:generation_tokens_total\{[^}]*\} 12\.0$", metrics, re.M)
        assert re.search(r"^vllm:kv_cache_usage_perc\{[^}]*\} 0\.0$", metrics, re.M)  # every block given back
        planned = plan_rows(str(tmp_path / "model"), torch.float32, [64], [(300, 12)], {"staging_tokens": 1024},
                            max_model_len=1024, engines=("vllm",))[0]  # fmt: skip
        info = re.search(r"^vllm:cache_config_info\{([^}]*)\}", metrics, re.M).group(1)
        assert 'block_size="128"' in info and f'num_gpu_blocks="{planned["pool_tokens"] // 128}"' in info, info
    finally:
        server.terminate()
        server.wait(timeout=60)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
