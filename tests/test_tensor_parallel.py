"""Tensor parallelism: examples/tensor_parallel.py under ``torch.distributed.run --nproc-per-node 2`` (transformers'
``tp_plan="auto"``, gloo on CPU) against the same script in one process.

Each rank must hold exactly its half of the KV heads (and of the cache's bytes), generate exactly the single-process
tokens while the cache holds no quantized token, and, across flushes, the same tokens with the fused KIVI attention
as with dense keys/values. The backend is the process's (``$KIVI_XPU_BACKEND``: sycl in CI), so two processes also
share the SYCL runtime's persistent kernel cache.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from kivi_xpu import KiviSettings

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "tensor_parallel.py"
TIMEOUT = 300  # seconds for both runs together; they take ~15 s on 2 busy cores
NEW_TOKENS, RESIDUAL = 40, 32


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(launcher: list[str], architecture: str, output: Path, example: Path = EXAMPLE,
           args: list[str] | None = None) -> subprocess.Popen:  # fmt: skip
    env = os.environ | {
        "OMP_NUM_THREADS": "1",
        "KIVI_XPU_CPU_DOT": "fp32",  # fused = dense to fp32 rounding (the int8 arithmetic has its own twin tests)
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
    }
    if args is None:
        args = ["--max-new-tokens", str(NEW_TOKENS), "--residual-length", str(RESIDUAL)]
    command = [sys.executable, *launcher, str(example), "--tiny", architecture, *args, "--output-dir", str(output)]
    return subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )


def _torchrun(ranks: int) -> list[str]:
    return ["-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-addr", "127.0.0.1",
            "--master-port", str(_free_port())]  # fmt: skip


def _finish(processes: list[subprocess.Popen], expect_success: bool = True) -> list[str]:
    """Waits for every process (all within :data:`TIMEOUT`), then checks their exit codes. Whatever still runs at the
    deadline is stopped with SIGTERM, which torchrun passes on to its ranks (each runs in a session of its own, out of
    reach of a kill of torchrun's group), then killed with its process group: no rank outlives the test."""
    deadline = time.monotonic() + TIMEOUT
    outputs = []
    try:
        for process in processes:
            try:
                outputs.append(process.communicate(timeout=max(deadline - time.monotonic(), 0))[0])
            except subprocess.TimeoutExpired:
                pytest.fail(f"{process.args} did not finish in {TIMEOUT} s")
    finally:
        for process in processes:
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(process.pid, signal.SIGKILL)
                    process.wait()
    for process, out in zip(processes, outputs, strict=True):
        assert (process.returncode == 0) == expect_success, f"{process.args}:\n{out[-4000:]}"
    return outputs


def _exact_steps(prompt_tokens: int) -> int:
    """Generated tokens whose step saw no quantized key or value (the step producing token i holds prompt + i)."""
    settings = KiviSettings(residual_length=RESIDUAL)
    held = range(prompt_tokens, prompt_tokens + NEW_TOKENS)
    return sum(settings.quantized_key_count(n) == 0 and settings.quantized_value_count(n) == 0 for n in held)


@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
def test_two_ranks_hold_half_the_kv_heads_and_reproduce_one_process(tmp_path, architecture):
    port = str(_free_port())
    ranks = _start(
        ["-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", port],
        architecture,
        tmp_path / "tp",
    )
    single = _start([], architecture, tmp_path / "single")
    _finish([single, ranks])
    one = json.loads((tmp_path / "single" / "rank0.json").read_text())
    shards = [json.loads((tmp_path / "tp" / f"rank{r}.json").read_text()) for r in range(2)]
    exact = _exact_steps(one["prompt_tokens"])
    assert 5 <= exact < NEW_TOKENS  # some steps inside the window, and flushes after them

    for attention in ("sdpa", "kivi"):
        whole = one[attention]
        assert whole["kv_heads"] == [2, 2] and whole["quantized_tokens"] > 0
        for shard in shards:
            run = shard[attention]
            assert shard["world_size"] == 2 and run["backend"] == whole["backend"]
            assert run["kv_heads"] == [1, 1]  # 2 KV heads over 2 ranks
            assert 2 * run["total_bytes"] == whole["total_bytes"] and 2 * run["code_bytes"] == whole["code_bytes"]
            assert run["tokens"][:exact] == whole["tokens"][:exact]
            torch.testing.assert_close(
                torch.tensor(run["logits"][:exact]), torch.tensor(whole["logits"][:exact]), rtol=1e-4, atol=1e-4
            )
        assert shards[0][attention]["tokens"] == shards[1][attention]["tokens"]
    for run in (one, *shards):  # fused = dense across flushes, in one process and on each rank
        assert run["kivi"]["tokens"] == run["sdpa"]["tokens"]
        torch.testing.assert_close(torch.tensor(run["kivi"]["logits"]), torch.tensor(run["sdpa"]["logits"]))


SERVING = ROOT / "examples" / "tensor_parallel_serving.py"


@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
def test_serving_on_two_ranks_holds_half_the_pool_and_answers_as_one_process(tmp_path, architecture):
    """Continuous batching on KIVI pages under tensor parallelism: each rank's pool and cached prompts are exactly
    half the one-process ones (half the KV heads each), and the answers (across flushes: G = R = 8) are the same."""
    single = _start([], architecture, tmp_path / "single", SERVING, [])
    ranks = _start(_torchrun(2), architecture, tmp_path / "tp", SERVING, [])
    _finish([single, ranks])
    one = json.loads((tmp_path / "single" / "rank0.json").read_text())
    shards = [json.loads((tmp_path / "tp" / f"rank{r}.json").read_text()) for r in range(2)]
    assert one["kv_heads"] == 2 and one["cached_bytes"] > 0
    for shard in shards:
        assert shard["world_size"] == 2 and shard["kv_heads"] == 1
        assert 2 * shard["pool_bytes"] == one["pool_bytes"] and 2 * shard["cached_bytes"] == one["cached_bytes"]
        assert shard["answers"] == one["answers"]


def test_a_request_cancelled_on_the_driver_is_freed_on_every_rank(tmp_path):
    """The first rank cancels a request mid-flight; every rank then holds no request (the example waits for that)
    and the other answers are the same on both ranks."""
    _finish([_start(_torchrun(2), "llama", tmp_path, SERVING, ["--cancel", "2"])])
    shards = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert shards[0]["answers"][2] is None and shards[0]["answers"] == shards[1]["answers"]
    assert all(answer for i, answer in enumerate(shards[0]["answers"]) if i != 2)


@pytest.mark.parametrize(
    "ranks, args, message",
    [
        (2, ["--kv-memory-of", "1=3"], "the ranks of a tensor-parallel group must get the same KIVI pages options"),
        (3, [], "tensor parallelism over 3 ranks needs a number of KV heads divisible by 3; this model has 2"),
    ],
)
def test_bad_tensor_parallel_setups_fail_before_any_work(tmp_path, ranks, args, message):
    (out,) = _finish([_start(_torchrun(ranks), "llama", tmp_path, SERVING, args)], expect_success=False)
    assert message in out and not list(tmp_path.glob("rank*.json"))


def _rank_pid(launcher_pid: int, rank: int) -> int | None:
    """The pid of torchrun's child whose environment says RANK=``rank`` (Linux /proc)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) != launcher_pid:
                continue
            if f"RANK={rank}".encode() in (stat.parent / "environ").read_bytes().split(b"\0"):
                return int(stat.parent.name)
        except (OSError, ValueError, IndexError):
            continue
    return None


def test_a_rank_that_dies_stops_the_run_naming_it(tmp_path):
    """Rank 1 killed mid-run: torchrun stops the other rank and exits non-zero within seconds, naming rank 1 as the
    root cause (it would otherwise wait in transformers' broadcast until the CPU group's timeout)."""
    process = _start(_torchrun(2), "llama", tmp_path, SERVING,
                     ["--lengths", "400", "400", "400", "--max-new-tokens", "2000", "--kv-memory", "64"])  # fmt: skip
    deadline = time.monotonic() + 60
    while (pid := _rank_pid(process.pid, 1)) is None:
        assert time.monotonic() < deadline and process.poll() is None, "rank 1 never started"
        time.sleep(0.1)
    time.sleep(5)  # loaded and serving
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    (out,) = _finish([process], expect_success=False)
    assert time.monotonic() - killed < 30
    root = out[out.index("Root Cause") :]
    assert "rank      : 1" in root and "SIGKILL" in root
