""":class:`KiviMemoryReport`: the bytes a KIVI cache (or one layer, or one kind of one layer) holds."""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass
class KiviMemoryReport:
    """Bytes held by a KIVI cache (or one layer of it), against the same tokens stored densely.

    ``code_bytes``, ``meta_bytes`` (scales and zero points) and ``residual_bytes`` (full-precision window)
    count the tokens actually held; ``allocated_bytes`` counts the storage reserved, including spare
    capacity for growth. ``dense_bytes`` is what a ``DynamicCache`` would hold for the same tokens in
    the model dtype.
    """

    tokens: int = 0
    code_bytes: int = 0
    meta_bytes: int = 0
    residual_bytes: int = 0
    allocated_bytes: int = 0
    dense_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        return self.code_bytes + self.meta_bytes + self.residual_bytes

    @property
    def compression_ratio(self) -> float:
        """Dense bytes / KIVI bytes for the tokens held (``inf`` for an empty cache)."""
        return self.dense_bytes / self.total_bytes if self.total_bytes else float("inf")

    def __add__(self, other: KiviMemoryReport) -> KiviMemoryReport:
        summed = {f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)}
        summed["tokens"] = max(self.tokens, other.tokens)  # tokens per layer, not a sum over layers
        return KiviMemoryReport(**summed)

    def __str__(self) -> str:
        mib = 1 << 20
        return (
            f"KIVI cache: {self.tokens} tokens, codes {self.code_bytes / mib:.2f} MiB, scales+zeros "
            f"{self.meta_bytes / mib:.2f} MiB, full-precision residual {self.residual_bytes / mib:.2f} MiB, "
            f"total {self.total_bytes / mib:.2f} MiB (allocated {self.allocated_bytes / mib:.2f} MiB) vs dense "
            f"{self.dense_bytes / mib:.2f} MiB: {self.compression_ratio:.2f}x smaller"
        )
