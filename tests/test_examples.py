"""Every example runs (offline variants: a tiny random model and a byte tokenizer), so they cannot rot."""

import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def run(script: str, *args: str) -> str:
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / script), "--tiny", *args], capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_generate_with_a_kivi_cache_object():
    out = run("generate.py", "--max-new-tokens", "24", "--residual-length", "32")
    assert "KIVI 2-bit (default): prefill" in out and "24 tokens at" in out and "x smaller" in out
    assert "greedy tokens identical to full precision" in out


def test_cache_implementation_three_ways():
    out = run("cache_implementation.py", "--max-new-tokens", "40")
    assert "1. generate(cache_implementation='kivi'): KIVI cache" in out
    assert "2. GenerationConfig(cache_implementation='kivi'): same tokens as 1: True" in out
    assert "3. model.generation_config.cache_implementation='kivi': same tokens as 1: True" in out


def test_pipeline():
    assert "pipeline with cache_implementation='kivi': done" in run("pipeline.py", "--max-new-tokens", "20")


def test_chat_keeps_one_cache_across_turns():
    out = run("chat.py", "--max-new-tokens", "20")
    assert out.count("assistant: ") == 3 and "chat: 3 turns in one cache of" in out


def test_assisted_decoding():
    out = run("assisted_decoding.py", "--max-new-tokens", "40")
    assert "assisted decoding: 40 tokens;" in out


def test_quantization_aware_fine_tuning_moves_the_streaming_perplexity_down():
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "finetune_qat.py")], capture_output=True, text=True, timeout=900
    )
    assert result.returncode == 0, result.stderr
    line = next(x for x in result.stdout.splitlines() if x.startswith("streaming ppl with KIVI cache: before "))
    numbers, alternative = line.split("before ")[1].rstrip(")").split(" (full-precision fine-tuning instead: ")
    before, after = (float(x) for x in numbers.split(" -> after "))
    assert after < before and after < float(alternative)  # QAT beats fine-tuning in full precision for this cache
    # The example's claim: the one-forward QAT emulation gives the streaming KIVI perplexity (printed to 3 decimals).
    line = next(x for x in result.stdout.splitlines() if x.startswith("(the QAT forward's own ppl"))
    assert abs(float(line.split("windows: ")[1].split(";")[0]) - after) <= 0.0015, line


def test_continuous_batching_on_kivi_pages():
    out = run("continuous_batching.py", "--max-new-tokens", "20", "--kv-memory", "8", "--max-requests", "2")
    assert "continuous batching on KIVI pages: 6 requests, 120 tokens in" in out
