"""Comparison of value storage quantized from rotated tokens (``quantize_values_into`` with a ``rotation``) with the
reference's: a kernel's ``x @ Q`` may sum in another order than torch's matmul, so the rotated values differ in their
last bits, float32 metadata with them, and a code may sit one step off where a value lies that close to a boundary."""

import torch

from kivi_xpu.ops import reference


def random_orthogonal(head_dim: int) -> torch.Tensor:
    """A non-symmetric orthogonal float32 ``[D, D]`` (the Hadamard matrix is symmetric: it cannot tell ``x @ Q`` from
    ``x @ Q.T``)."""
    q = torch.linalg.qr(torch.randn(head_dim, head_dim, dtype=torch.float64)).Q.float()
    assert not torch.allclose(q, q.T)
    return q


def assert_rotated_storage_close(
    actual, expected, bits: int, what: str, x: torch.Tensor, rotation: torch.Tensor, offset: int
) -> None:
    """Storage ``actual`` and ``expected`` ``(codes, scales, zeros)`` holding ``x [B, H, n, D] @ rotation`` in rows
    ``[offset, offset + n)``: identical outside them; inside, the same NaN groups, metadata within 4 ulps of its dtype
    plus the rounding error of the matmul (``D`` float32 ulps of ``|x| @ |Q|``), codes at most one step apart and in
    at most 1 % of the elements."""
    n = x.shape[2]
    for name, a, e in zip(("codes", "scales", "zeros"), actual, expected, strict=True):
        assert a.dtype == e.dtype, f"{what}: {name} dtype {a.dtype} != {e.dtype}"
        outside = torch.ones(a.shape[2], dtype=torch.bool)
        outside[offset : offset + n] = False
        torch.testing.assert_close(
            a[:, :, outside], e[:, :, outside], rtol=0, atol=0, equal_nan=True, msg=f"{what}: {name} outside its rows"
        )
    if n == 0:
        return
    magnitude = (x.float().abs() @ rotation.abs()).amax(-1, keepdim=True).nan_to_num(0, 0, 0)
    slack = x.shape[3] * torch.finfo(torch.float32).eps * magnitude  # [B, H, n, 1]
    for name, a, e in (("scales", actual[1], expected[1]), ("zeros", actual[2], expected[2])):
        a, e = a[:, :, offset : offset + n].float(), e[:, :, offset : offset + n].float()
        assert torch.equal(a.isnan(), e.isnan()), f"{what}: {name} differ in their NaN groups"
        bound = 4 * torch.finfo(actual[1].dtype).eps * e.abs() + slack
        off = ((a - e).abs() - bound).nan_to_num(0)  # equal infinities give NaN: fine
        assert (off <= 0).all(), f"{what}: {name} differ by up to {(a - e).abs().nan_to_num(0).max().item():.3g}"
    ours, theirs = reference.unpack(actual[0], 3, bits), reference.unpack(expected[0], 3, bits)
    off = (ours - theirs).abs()
    assert off.max() <= 1, f"{what}: codes up to {off.max().item()} steps apart"
    fraction = (off > 0).float().mean().item()
    assert fraction <= 0.01, f"{what}: {fraction:.2%} of the codes differ"
