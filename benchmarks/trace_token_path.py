"""The modules a key passes through in ``KiviLayer.update``: the structure's yardstick (docs/development.md).

A call trace (``sys.settrace``) of one ``update`` of a fused layer, reduced to the calls from one kivi_xpu module into
another, in order (``kivi_xpu/ops/`` counts as one module; calls within a module, and calls into torch, transformers
or the native extension, are not counted; Python callbacks into kivi_xpu are, from the nearest kivi_xpu caller).
Consecutive calls into one module are one **stay**; a stay in a module the path had already left is a **return**
(a climb back up, or a second visit to a helper module). Only a key is followed: the calls made on the values' objects
(their stream, codec, storage) and everything below them are left out.

Four steps, on a layer of the default settings (S = 4 sinks, R = 128) under the fused attention:

* ``first``: the first decode step after the prompt (new shapes checked, the steady run made and planned);
* ``run-start``: a decode step that plans the next steps of a run (one ``append_decode_step`` call);
* ``flush``: the decode step whose key completes a block of R: the block is quantized and packed;
* ``steady``: a decode step inside a run.

    python benchmarks/trace_token_path.py [--backend native|reference|sycl]
"""

from __future__ import annotations

import argparse
import sys
import types
from pathlib import Path

import torch

import kivi_xpu

PACKAGE = Path(kivi_xpu.__file__).resolve().parent
STEPS = ("first", "run-start", "flush", "steady")
STEPS_BEFORE = {"first": 0, "flush": 1, "run-start": 2, "steady": 3}  # decode steps before the traced one


def module_of(filename: str) -> str | None:
    """The kivi_xpu module of a code object's file (``ops`` for everything under ``kivi_xpu/ops/``), or ``None``."""
    try:
        relative = Path(filename).resolve().relative_to(PACKAGE)
    except ValueError:
        return None
    if relative.parts[0] == "ops":
        return "ops"
    return relative.with_suffix("").as_posix()


def is_value_object(obj) -> bool:
    """Whether ``obj`` is one of the values' objects, whose calls a key's path leaves out."""
    name = type(obj).__name__
    if name.startswith("Value"):  # ValueStream, ValueCodec
        return True
    return getattr(obj, "kind", None) == "values"  # the objects of kivi-xpu <= bc2f283 named their kind


def trace_calls(fn) -> list[tuple[str, str]]:
    """Runs ``fn()`` and returns its kivi_xpu calls as ``(module, function)`` in order, a key's only."""
    calls: list[tuple[str, str]] = []
    skipped: set[int] = set()  # ids of the live frames of the values' objects

    def on_return(frame, event, arg):
        if event == "return":
            skipped.discard(id(frame))
        return on_return

    def on_call(frame, event, arg):
        if event != "call":
            return None
        parent = frame.f_back
        while parent is not None:
            if id(parent) in skipped:
                return None
            parent = parent.f_back
        module = module_of(frame.f_code.co_filename)
        if module is None:
            return None
        if is_value_object(frame.f_locals.get("self")):
            skipped.add(id(frame))
            return on_return
        caller = frame.f_back
        while caller is not None and module_of(caller.f_code.co_filename) is None:
            caller = caller.f_back
        if caller is None or module_of(caller.f_code.co_filename) != module:
            calls.append((module, frame.f_code.co_name))
        return None

    sys.settrace(on_call)
    try:
        fn()
    finally:
        sys.settrace(None)
    return calls


def stays(calls: list[tuple[str, str]]) -> list[tuple[str, list[str]]]:
    """The calls merged into stays: ``(module, functions called there)``."""
    merged: list[tuple[str, list[str]]] = []
    for module, function in calls:
        if merged and merged[-1][0] == module:
            merged[-1][1].append(function)
        else:
            merged.append((module, [function]))
    return merged


def returns(path: list[tuple[str, list[str]]]) -> int:
    """Stays in a module that the path had already left."""
    seen, count = set(), 0
    for module, _ in path:
        count += module in seen
        seen.add(module)
    return count


def layer_before(step: str, backend: str):
    """A fused layer (default settings, batch 1, 2 kv heads, head_dim 64) just before ``step``, and the states of the
    step's token."""
    settings = kivi_xpu.KiviSettings()
    s, r = settings.sink_tokens, settings.residual_length
    config = types.SimpleNamespace(_attn_implementation="kivi")  # what the fused path reads of a model config
    layer = kivi_xpu.KiviLayer(settings, backend=backend, model_config=config)
    torch.manual_seed(0)
    # The prompt leaves R - 2 keys in the window: decode step 1 (first) starts a run, step 2 completes a key block (a
    # flush, on the general path), step 3 plans the next steps (run-start) and step 4 continues them.
    prompt = s + 2 * r + r - 2
    layer.update(torch.randn(1, 2, prompt, 64), torch.randn(1, 2, prompt, 64))
    for _ in range(STEPS_BEFORE[step]):
        layer.update(torch.randn(1, 2, 1, 64), torch.randn(1, 2, 1, 64))
    return layer, torch.randn(1, 2, 1, 64), torch.randn(1, 2, 1, 64)


def token_path(step: str, backend: str = "native") -> list[tuple[str, list[str]]]:
    """The stays of a key's path through ``update`` at ``step`` (one of :data:`STEPS`), in a process that has run a
    layer before (the kernels' first lookup, once per process, is not part of a token's path)."""
    layer_before("steady", backend)
    layer, key, value = layer_before(step, backend)
    with torch.inference_mode(False):
        return stays(trace_calls(lambda: layer.update(key, value)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="native", choices=("native", "reference", "sycl"))
    args = parser.parse_args()
    for step in STEPS:
        path = token_path(step, args.backend)
        print(f"{step}: {len(path)} stays, {returns(path)} returns to a module already left")
        for module, functions in path:
            print(f"  {module:<22} {', '.join(functions)}")


if __name__ == "__main__":
    main()
