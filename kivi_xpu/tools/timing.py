"""Measuring decode speed: the timed greedy decode loop, the timer of the fused attention op's calls and of their
phases (and the row fields that sum them up over the runs), CPU-bound competitor processes that load the machine
during a measurement (``--contend N``), and the decode-step ratios against the full-precision baselines."""

from __future__ import annotations

import contextlib
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import NamedTuple

import torch
from transformers import AttentionInterface
from transformers.generation.streamers import BaseStreamer

from ..attention import functions as attention_functions
from ..integration import cache_argument
from ..ops.operands import KindOperands
from ..runtime import load_native_extension
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


def synchronize(device: torch.device) -> None:
    """Waits until the work queued on ``device`` is done. An accelerator (cuda, xpu, mps) runs kernels
    asynchronously, so a clock read without this would time their launches, not their work; the CPU needs nothing."""
    accelerator = torch.accelerator.current_accelerator()
    if accelerator is not None and device.type == accelerator.type:
        torch.accelerator.synchronize(device)


@torch.no_grad()
def timed_decode(
    model, cache, token: torch.Tensor, steps: int, warmup: int, bar, on_timed: Callable[[], object] | None = None
) -> tuple[list[torch.Tensor], float]:
    """Greedy decode of ``steps`` tokens from ``token [B, 1]`` (fed first) through ``cache``; returns the ``[B, 1]``
    tokens and the seconds of the steps after the first ``warmup`` (``steps - warmup`` timed steps). ``on_timed()``,
    when given, is called as the timed steps begin (e.g. ``calls.clear`` of a :func:`fused_op_timer`). On an
    accelerator the clock is read after its queued work is done (:func:`synchronize`)."""
    tokens, start = [], None
    for step in range(steps):
        if step == warmup:
            if on_timed is not None:
                on_timed()
            synchronize(token.device)
            start = time.perf_counter()
        token = model(token, **cache_argument(cache), use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
        tokens.append(token)
        bar.update(1)
    synchronize(token.device)
    return tokens, time.perf_counter() - start


class GenerateClock(BaseStreamer):
    """A ``generate(streamer=...)`` that reads the clock: ``generate`` hands a streamer the prompt, then each new token,
    so ``first - start`` is the time to the first new token (the prefill) and ``stop - first`` the decode of the
    others. Build it just before the call."""

    def __init__(self):
        self.start, self.first, self.stop, self.puts = time.perf_counter(), None, None, 0

    def put(self, value):
        self.puts += 1
        if self.puts == 2:  # the first new token: the prefill is done
            self.first = time.perf_counter()

    def end(self):
        self.stop = time.perf_counter()

    def decode_ms_per_token(self, new_tokens: int) -> float:
        """Mean ms of the decode steps after the first new token (``nan`` for fewer than 2 new tokens)."""
        return (self.stop - self.first) / (new_tokens - 1) * 1e3 if new_tokens > 1 else float("nan")


@contextlib.contextmanager
def step_parts(model):
    """Where a decode step goes: yields a dict whose ``"weights"`` and ``"attention"`` entries add up, while the
    context is active, the seconds the model's forward passes spend in its ``nn.Linear`` layers (the products with
    the weights, ``lm_head`` included) and in the function transformers' attention interface calls (the fused KIVI
    op, or SDPA over the dense states); the rest of a step (norms, rotary embeddings, the caches' own work, the
    argmax) is the step's time minus both. Clock reads around each call, so an accelerator needs :func:`synchronize`
    inside them: use it on the CPU."""
    seconds = {"weights": 0.0, "attention": 0.0}
    started: dict[int, float] = {}

    def start(module, args):
        started[id(module)] = time.perf_counter()

    def stop(module, args, output):
        seconds["weights"] += time.perf_counter() - started.pop(id(module))

    handles = []
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            handles += [module.register_forward_pre_hook(start), module.register_forward_hook(stop)]
    mapping = AttentionInterface._global_mapping
    name = model.config.get_text_config(decoder=True)._attn_implementation
    original = mapping.get(name)

    def timed_attention(*args, **kwargs):
        begin = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            seconds["attention"] += time.perf_counter() - begin

    if original is not None:
        mapping[name] = timed_attention
    try:
        yield seconds
    finally:
        for handle in handles:
            handle.remove()
        if original is not None:
            mapping[name] = original


class OpCall(NamedTuple):
    """One call of the fused attention op: its seconds, and the bytes of the layer's KV it had to read."""

    seconds: float
    packed_bytes: int  # the packed history of keys and values: codes, scales and zeros of the `count` tokens
    exact_bytes: int  # the exact (full-precision) sinks and tail of keys and values


def packed_bytes(kind: KindOperands) -> int:
    """Bytes of the packed history one kind (keys or values) of a ``decode_attention`` call holds: the codes,
    scales and zeros of its ``count`` tokens (``bits`` per element, ``2 x D / group`` metadata per token and
    head, whichever way the kind is grouped), not the spare capacity of its buffers."""
    batch, heads, dim = kind.codes.shape[0], kind.codes.shape[1], kind.tail.shape[3]
    per_token = dim * kind.bits // 8 + 2 * (dim // kind.group) * kind.scales.element_size()
    return batch * heads * kind.count * per_token


def exact_bytes(kind: KindOperands) -> int:
    """Bytes of the exact sinks and tail of one kind of a ``decode_attention`` call."""
    return sum(t.numel() * t.element_size() for t in (kind.sinks, kind.tail))


@contextlib.contextmanager
def fused_op_timer():
    """Times every call of the fused KIVI attention within the block: yields a list that receives one
    :class:`OpCall` per call of ``kivi_xpu.attention.functions.decode_attention`` (what the ``"kivi"`` attention
    calls for each layer of a decode step; it runs the backend's ``decode_attention`` op, whose CPU and SYCL kernels
    return when done). The module's function is wrapped for the block and restored after it, also on an error:
    outside a ``with fused_op_timer()`` nothing is wrapped, so it costs nothing; inside, a few microseconds per call.
    On an asynchronous device (the pure-PyTorch kernels on cuda) a call's time is that of its launches."""
    original = attention_functions.decode_attention
    calls: list[OpCall] = []

    def timed(inputs, *args, **kwargs):
        start = time.perf_counter()
        out = original(inputs, *args, **kwargs)
        seconds = time.perf_counter() - start
        packed = packed_bytes(inputs.keys) + packed_bytes(inputs.values)
        calls.append(OpCall(seconds, packed, exact_bytes(inputs.keys) + exact_bytes(inputs.values)))
        return out

    attention_functions.decode_attention = timed
    try:
        yield calls
    finally:
        attention_functions.decode_attention = original


class PhaseTimes:
    """Thread seconds per phase of the native fused attention's calls (``csrc/cpu/decode_attention.h``: ``Phase``;
    the threads of one call add up), filled in ``seconds`` when its :func:`fused_op_phases` block ends."""

    def __init__(self, native):
        self._native, self.seconds = native, {}

    def restart(self) -> None:
        """Forgets the calls timed so far (e.g. those of the warm-up steps)."""
        if self._native is not None:
            self._native.phase_seconds(reset=True)


@contextlib.contextmanager
def fused_op_phases(enabled: bool = True):
    """Times the phases of every native CPU fused attention call within the block (``kivi-xpu bench --phases``):
    yields a :class:`PhaseTimes`. The timers cost ~5-10 % of a call, so the op times measured alongside are that
    much longer; they are turned off after the block, also on an error. Without ``enabled``, or for calls of other
    backends, nothing is timed."""
    native = load_native_extension() if enabled else None
    times = PhaseTimes(native)
    if native is None:
        yield times
        return
    times.restart()
    native.set_phase_timing(True)
    try:
        yield times
    finally:
        native.set_phase_timing(False)
        times.seconds = native.phase_seconds(reset=True)


class OpStats(NamedTuple):
    """The fused op's calls during the timed steps of one run (medians over the calls)."""

    seconds: float  # one call
    packed_bytes: int
    exact_bytes: int
    gb_per_s: float  # packed bytes / seconds of a call, 1e9 bytes per GB
    calls_per_step: float


def op_stats(calls: list[OpCall], steps: int) -> OpStats | None:
    """The medians of ``calls`` made over ``steps`` decode steps; ``None`` without calls (no fused attention)."""
    if not calls:
        return None
    return OpStats(
        statistics.median(c.seconds for c in calls),
        int(statistics.median(c.packed_bytes for c in calls)),
        int(statistics.median(c.exact_bytes for c in calls)),
        statistics.median(c.packed_bytes / c.seconds for c in calls) / 1e9,
        len(calls) / steps,
    )


@torch.no_grad()
def timed_fused_decode(
    model, cache, token: torch.Tensor, steps: int, warmup: int, bar, phases: bool = False
) -> tuple[list[torch.Tensor], float, OpStats | None, dict[str, float] | None]:
    """:func:`timed_decode` with every call of the fused attention op in the timed steps timed
    (:func:`fused_op_timer`) and, with ``phases``, split into its phases by the native kernel's timers
    (:func:`fused_op_phases`; pass it only for a cache read by the fused attention). Returns the tokens, the seconds
    of the timed steps, their :class:`OpStats` (``None``: no fused op call) and the thread ms per call in each phase
    (``None``: not timed, or the calls ran on a backend without phase timers)."""
    with fused_op_timer() as calls, fused_op_phases(phases) as times:

        def on_timed():
            calls.clear()
            times.restart()

        tokens, seconds = timed_decode(model, cache, token, steps, warmup, bar, on_timed)
    # (all zero: the fused op ran on another backend, which has no phase timers)
    timed = calls and any(times.seconds.values())
    phase_ms = {k: 1000 * s / len(calls) for k, s in times.seconds.items()} if timed else None
    return tokens, seconds, op_stats(calls, steps - warmup), phase_ms


def fused_op_fields(stats: list[OpStats | None]) -> dict:
    """A row's ``fused_op_*`` fields (but the bandwidth fraction, which ``bench.benchmark`` adds) from its runs' op
    statistics: the medians over the runs; none when a run had no fused op call."""
    if not stats or None in stats:
        return {}
    return {
        "fused_op_ms": 1000 * statistics.median(s.seconds for s in stats),
        "fused_op_calls_per_step": statistics.median(s.calls_per_step for s in stats),
        "fused_op_packed_bytes": int(statistics.median(s.packed_bytes for s in stats)),
        "fused_op_exact_bytes": int(statistics.median(s.exact_bytes for s in stats)),
        "fused_op_gb_per_s": statistics.median(s.gb_per_s for s in stats),
    }


def phase_medians(runs: list[dict[str, float] | None]) -> dict[str, float] | None:
    """Each phase's median over the runs' thread ms per call; ``None`` unless every run was timed."""
    if not runs or None in runs:
        return None
    return {name: statistics.median(run[name] for run in runs) for name in runs[0]}


BASELINES = ("dynamic", "static")


def add_step_ratios(rows: list) -> None:
    """Sets ``step_speedup_vs_dynamic`` / ``step_speedup_vs_static`` of each row (objects with ``name`` and
    ``ms_per_step``, all from one configuration of one run) to that baseline's decode ms/step over its own (the
    issue's convention); ``None`` where the baseline did not run. Above 1: faster than the baseline."""
    for baseline in BASELINES:
        base = next((r for r in rows if r.name == baseline), None)
        for row in rows:
            setattr(row, f"step_speedup_vs_{baseline}", None if base is None else base.ms_per_step / row.ms_per_step)
