"""``kivi-xpu plan``: its figures are what the pools admit. Here transformers' KIVI pages (a SmolLM2-135M-shaped
pool with its shipped calibration, 3 budgets x 3 request lengths); vLLM's pools in tests/test_vllm_plugin.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import ContinuousBatchingConfig, LlamaConfig

from kivi_xpu.__main__ import main
from kivi_xpu.calibrations import __path__ as calibrations_path
from kivi_xpu.paged.cache import KiviPagedCache
from kivi_xpu.paged.manager import config_layer_settings
from kivi_xpu.tools.plan import plan_rows

MiB = 2**20
BUDGETS_MIB = (48, 256, 768)
LENGTHS = ((408, 128), (1222, 512), (3796, 256))


def smollm2_config() -> LlamaConfig:
    """SmolLM2-135M-Instruct's config as its shipped calibration names it (its calibration then applies)."""
    payload = json.loads((Path(calibrations_path[0]) / "SmolLM2-135M-Instruct.json").read_text())
    shape = {k: v for k, v in payload["fingerprint"]["config"].items() if k != "model_type"}
    config = LlamaConfig(**shape, max_position_embeddings=8192)
    config._name_or_path = "HuggingFaceTB/" + payload["fingerprint"]["name"]
    return config


class _Helper:
    tp_size = 1

    def are_kv_heads_tp_ed(self) -> bool:
        return False


class _Request:
    """What admission reads of transformers' request state: a fresh request of ``prompt`` + ``new_tokens``."""

    def __init__(self, index: int, prompt: int, new_tokens: int):
        self.request_id, self.max_new_tokens = f"r{index}", new_tokens
        self.remaining_prefill_tokens, self.generated_tokens = list(range(1, prompt + 1)), []

    def current_len(self) -> int:
        return 0


def _pool(config, kv_memory: int) -> KiviPagedCache:
    settings = config_layer_settings(config, torch.float32, {})
    return KiviPagedCache(config, ContinuousBatchingConfig(allow_block_sharing=False), "cpu", _Helper(), torch.float32,
                          kv_memory=kv_memory, settings=settings, backend="reference")  # fmt: skip


def _admitted_at_once(pool: KiviPagedCache, prompt: int, new_tokens: int) -> int:
    """Fresh requests admitted one after another, each with its whole prompt in one forward, until one waits."""
    count = 0
    while pool.can_store_request_tokens(_Request(count, prompt, new_tokens), prompt):
        count += 1
    return count


def _admitted_alone(config, kv_memory: int, prompt: int, new_tokens: int, max_batch_tokens: int) -> bool:
    """Whether the empty pool admits the request: its prompt split into chunks (staged), or whole in one forward
    when it fits in one."""
    pool = _pool(config, kv_memory)
    chunked = pool.can_store_request_tokens(_Request(0, prompt, new_tokens), max_batch_tokens, dry_run=True)
    whole = prompt <= max_batch_tokens and pool.can_store_request_tokens(_Request(1, prompt, new_tokens), prompt,
                                                                         dry_run=True)  # fmt: skip
    return chunked or whole


@pytest.mark.parametrize("budget_mib", BUDGETS_MIB)
def test_the_plan_is_what_the_kivi_pool_admits(budget_mib):
    config = smollm2_config()
    rows = plan_rows(config, torch.float32, [budget_mib], list(LENGTHS), {}, engines=("transformers",))
    kivi = [row for row in rows if row["pages"] == "KIVI 2-bit"]
    assert [(row["prompt"], row["new_tokens"]) for row in kivi] == list(LENGTHS)
    for row in kivi:
        pool = _pool(config, budget_mib * MiB)
        assert _admitted_at_once(pool, row["prompt"], row["new_tokens"]) == row["requests"], row
        assert pool.held_bytes == row["requests"] * (
            pool.budget.unit_bytes
            + -(-(row["prompt"] + row["new_tokens"]) // pool.budget.block.tokens) * pool.budget.block.block_bytes
        )
        assert row["unit_bytes"] == pool.budget.unit_bytes
        longest, chunk = row["longest_prompt"], pool.max_batch_tokens
        assert _admitted_alone(config, budget_mib * MiB, longest, row["new_tokens"], chunk)
        assert not _admitted_alone(config, budget_mib * MiB, longest + 1, row["new_tokens"], chunk)
    assert any(row["requests"] > 1 for row in kivi)
    full = [row for row in rows if row["pages"] == "float32"]
    token_bytes = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 4
    for row in full:  # transformers' own pool of the same bytes, blocks of 256 tokens
        assert row["pool_tokens"] == budget_mib * MiB // (token_bytes * 256) * 256
        assert row["requests"] == row["pool_tokens"] // 256 // -(-(row["prompt"] + row["new_tokens"]) // 256)


def test_plan_prints_every_engine_and_writes_json(tmp_path, capsys):
    out = tmp_path / "plan.json"
    config_dir = tmp_path / "model"
    smollm2_config().save_pretrained(config_dir)
    assert main(["plan", str(config_dir), "--dtype", "float32", "--kv-memory", "768", "--requests", "3796+256",
                 "--json", str(out)]) == 0  # fmt: skip
    text = capsys.readouterr().out
    assert "768 MiB of KV, requests of 3796 + 256 tokens" in text
    for engine, pages in (("transformers", "KIVI 2-bit"), ("transformers", "float32"), ("vllm", "KIVI 2-bit"),
                          ("vllm", "float32"), ("vllm", "fp8")):  # fmt: skip
        assert f"  {engine:<12} {pages:<10}" in text, (engine, pages)
    rows = json.loads(out.read_text())["rows"]
    assert {(row["engine"], row["pages"]) for row in rows} == {("transformers", "KIVI 2-bit"),
        ("transformers", "float32"), ("vllm", "KIVI 2-bit"), ("vllm", "float32"), ("vllm", "fp8")}  # fmt: skip
    vllm_fp32 = next(row for row in rows if row["engine"] == "vllm" and row["pages"] == "float32")
    assert vllm_fp32["pool_tokens"] == 17_408  # what vLLM 0.32 logged for SmolLM2 fp32 at 768 MiB


def test_vllm_holds_no_request_longer_than_its_model_length():
    rows = plan_rows(smollm2_config(), torch.float32, [768], [(8000, 193), (8000, 192)], {}, engines=("vllm",))
    held = {(row["pages"], row["prompt"] + row["new_tokens"]): row["requests"] for row in rows}
    assert held["KIVI 2-bit", 8193] == held["float32", 8193] == held["fp8", 8193] == 0
    assert held["KIVI 2-bit", 8192] > 0 and held["fp8", 8192] > 0


def test_bad_plan_arguments_are_named(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--requests", "4000"])
    assert "PROMPT+NEW" in capsys.readouterr().err
    assert main(["plan", "llama-3.1-8b", "--tp", "3"]) == 2
    assert "--tp 3 does not divide the model's 8 KV heads" in capsys.readouterr().err
    assert main(["plan", "--kivi-option", "bits=5"]) == 2
    assert "`bits` must be one of" in capsys.readouterr().err
