"""Rotations applied to keys and values before they are quantized (QuaRot, RotateKV).

A layer's keys or values ``x [B, H, n, D]`` are stored as the codes of ``x @ Q`` for an orthogonal ``Q [D, D]``
and read back as ``dequantize(...) @ Qᵀ``. A Walsh-Hadamard ``Q`` spreads an outlier channel (or a token's few large
channels) over all channels, so the groups that share one scale and zero point hold evenly sized numbers and lose
less to a 2-bit grid. Only the packed history is rotated: the sinks and the full-precision window stay exact.

The fused attention never un-rotates the history: because ``Q`` is orthogonal, ``q · k = (q Q) · (k Q)`` and
``Σ_t p_t v_t = (Σ_t p_t (v_t Q)) Qᵀ``, so it scores the packed keys with the rotated query and un-rotates the packed
values' weighted sum once per query row.

Rotations (the ``rotation`` / ``key_rotation`` / ``value_rotation`` settings, see :mod:`kivi_xpu.algorithm`):

* ``"none"``: the paper's algorithm;
* ``"hadamard"``: the normalised Walsh-Hadamard matrix over blocks of ``b`` channels, ``b`` the largest power of
  two dividing ``D`` (the whole head for the usual 64 / 128; block-diagonal for e.g. 80 or 96).
"""

from __future__ import annotations

import functools

import torch

ROTATIONS = ("none", "hadamard")


def hadamard_block(head_dim: int) -> int:
    """Channels per Walsh-Hadamard block for ``head_dim``: its largest power-of-two divisor."""
    return head_dim & -head_dim


@functools.cache
def _hadamard(head_dim: int) -> torch.Tensor:
    block = hadamard_block(head_dim)
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < block:  # Sylvester's construction: H_2n = [[H, H], [H, -H]]
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    h = h / block**0.5
    return torch.block_diag(*([h] * (head_dim // block))).float()


def rotation_matrix(name: str, head_dim: int, device=None) -> torch.Tensor | None:
    """The orthogonal ``Q [head_dim, head_dim]`` float32 of rotation ``name`` on ``device``, or ``None`` for
    ``"none"``. Tensors of one (name, head_dim, device) are shared, so treat them as read-only."""
    if name == "none":
        return None
    if name != "hadamard":
        raise ValueError(f"`rotation` must be one of {ROTATIONS}, got {name!r}")
    if not isinstance(device, torch.device):  # (a decode step asks three times per layer: skip the constructor)
        device = torch.device("cpu" if device is None else device)
    return _on_device(head_dim, device)


_SHARED: dict[tuple[int, torch.device], torch.Tensor] = {}  # the matrices rotation_matrix hands out


def _on_device(head_dim: int, device: torch.device) -> torch.Tensor:
    q = _SHARED.get((head_dim, device))
    if q is None:
        q = _SHARED[(head_dim, device)] = _hadamard(head_dim).to(device)
    return q


def is_shared(t: torch.Tensor) -> bool:
    """Whether ``t`` is one of the matrices :func:`rotation_matrix` shares: the process's, not a cache's storage (a
    cache may keep references to them; its memory accounting does not count them)."""
    return any(t is q for q in _SHARED.values())


def rotate(x: torch.Tensor, rotation: torch.Tensor | None) -> torch.Tensor:
    """``x [..., D] @ rotation`` in float32 (``x`` itself for ``None``): what is quantized."""
    return x if rotation is None else x.float() @ rotation.to(x.device)


def unrotate(x: torch.Tensor, rotation: torch.Tensor | None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x [..., D] @ rotationᵀ`` (computed in float32), in ``dtype`` (default: ``x``'s): back to the model's basis."""
    dtype = x.dtype if dtype is None else dtype
    return x.to(dtype) if rotation is None else (x.float() @ rotation.to(x.device).T).to(dtype)
