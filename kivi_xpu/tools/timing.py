"""Measuring decode speed: the timed greedy decode loop, CPU-bound competitor processes that load the machine
during a measurement (``--contend N``), and the decode-step ratios against the full-precision baselines."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time

import torch

from .options import ToolError

# Float work in a loop that ends by itself after MAX_SECONDS, or as soon as its parent is gone (its parent id
# changes), so that a competitor never outlives the benchmark even if the benchmark is killed.
COMPETITOR = """
import os, sys, time
parent, end, x = os.getppid(), time.monotonic() + float(sys.argv[1]), 1.0
print("ready", flush=True)
while time.monotonic() < end and os.getppid() == parent:
    for _ in range(20000):
        x = x * 1.0000001 + 1e-9
"""
MAX_SECONDS = 3600.0  # one measured run of one cache never takes longer


@contextlib.contextmanager
def competitors(count: int, max_seconds: float = MAX_SECONDS):
    """``count`` CPU-bound Python processes running for the duration of the ``with`` block (none for 0): started
    and running before the block, killed and reaped after it, also on an error or KeyboardInterrupt. Yields the
    ``subprocess.Popen`` objects."""
    processes: list[subprocess.Popen] = []
    try:
        for _ in range(count):
            processes.append(
                subprocess.Popen(
                    [sys.executable, "-S", "-c", COMPETITOR, str(max_seconds)],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    text=True,
                )
            )
        for process in processes:
            if process.stdout.readline().strip() != "ready":
                raise ToolError(f"--contend: a competitor process exited at start (code {process.wait()})")
        yield processes
    finally:
        for process in processes:
            process.kill()
        for process in processes:
            process.wait()
            process.stdout.close()


@torch.no_grad()
def timed_decode(model, cache, token: torch.Tensor, steps: int, warmup: int, bar) -> tuple[list[torch.Tensor], float]:
    """Greedy decode of ``steps`` tokens from ``token [B, 1]`` (fed first) through ``cache``; returns the ``[B, 1]``
    tokens and the seconds of the steps after the first ``warmup`` (``steps - warmup`` timed steps)."""
    tokens, start = [], None
    for step in range(steps):
        if step == warmup:
            start = time.perf_counter()
        token = model(token, past_key_values=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
        tokens.append(token)
        bar.update(1)
    return tokens, time.perf_counter() - start


BASELINES = ("dynamic", "static")


def add_step_ratios(rows: list) -> None:
    """Sets ``step_speedup_vs_dynamic`` / ``step_speedup_vs_static`` of each row (objects with ``name`` and
    ``ms_per_step``, all from one configuration of one run) to that baseline's decode ms/step over its own (the
    issue's convention); ``None`` where the baseline did not run. Above 1: faster than the baseline."""
    for baseline in BASELINES:
        base = next((r for r in rows if r.name == baseline), None)
        for row in rows:
            setattr(row, f"step_speedup_vs_{baseline}", None if base is None else base.ms_per_step / row.ms_per_step)
