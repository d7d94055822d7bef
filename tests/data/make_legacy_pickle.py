"""Writes tests/data/kivi_layers_bc2f283.pt: two KiviLayers pickled by kivi-xpu at bc2f283 (before the streams became
one class per kind), which tests/test_copy.py loads. Run with that revision first on the path:

    git worktree add /tmp/base bc2f283 && PYTHONPATH=/tmp/base python tests/data/make_legacy_pickle.py
"""

import pickle
from pathlib import Path

import torch

from kivi_xpu import KiviLayer, KiviSettings


def legacy_inputs():
    """The states both revisions feed: a 70-token prompt, then 5 one-token steps ([2, 2, n, 32] each)."""
    g = torch.Generator().manual_seed(58)
    prompt = [torch.randn(2, 2, 70, 32, generator=g) for _ in range(2)]
    steps = [[torch.randn(2, 2, 1, 32, generator=g) for _ in range(2)] for _ in range(5)]
    return prompt, steps


def legacy_layers():
    settings = (KiviSettings(residual_length=32, group_size=16), KiviSettings(residual_length=32, preset="paper"))
    layers = [KiviLayer(s, backend="reference", attention="dense") for s in settings]
    prompt, steps = legacy_inputs()
    for layer in layers:
        layer.update(*prompt)
        for k, v in steps:
            layer.update(k, v)
    return layers


if __name__ == "__main__":
    out = Path(__file__).with_name("kivi_layers_bc2f283.pt")
    out.write_bytes(pickle.dumps(legacy_layers()))
    print(out, out.stat().st_size, "bytes")
