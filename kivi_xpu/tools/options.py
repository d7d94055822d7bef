"""The settings of a tool run as plain dataclasses (argparse stays at the edge, in :mod:`.cli`), and the error a
tool reports as one line."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch

CACHE_NAMES = ("dynamic", "static", "kivi-fused", "kivi-dense", "quanto", "hqq")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# What --device takes, for help texts and errors: any torch device string whose device this torch can use.
DEVICE_FORMS = "cpu, xpu, xpu:N, cuda, cuda:N, mps"


class ToolError(Exception):
    """Bad input or an unusable environment: reported as one ``error: ...`` line with exit code 2."""


@dataclass(kw_only=True)
class ToolOptions:
    """What both tools take: the model, the caches to compare and their KIVI/HF settings, the output."""

    model: str = "smollm2"  # HF model id, local checkpoint directory or "smollm2"
    dtype: str = "float32"  # a key of DTYPES
    device: str = "cpu"  # where the model runs: a torch device string (cpu, xpu, xpu:1, cuda:0, ...)
    threads: int | None = None  # torch threads (None: torch's choice)
    caches: list[str] = field(default_factory=lambda: list(CACHE_NAMES))
    bits: list[int] = field(default_factory=lambda: [2])
    group_size: int = 32
    residual_length: int = 128
    meta_dtype: str | None = None  # KIVI scales/zeros, a key of DTYPES; None: KiviCache's (the model's dtype rule)
    kivi_options: list[tuple[str, object]] = field(default_factory=list)  # extra KiviCache keyword arguments
    backend: str | None = None
    sycl_device: str | None = None  # SYCL device filter of the KIVI kernels (KiviCache's `device`), e.g. opencl:cpu
    json: str | None = None
    no_progress: bool = False

    @classmethod
    def from_namespace(cls, namespace):
        """The options from an object with one attribute per field (an ``argparse.Namespace``)."""
        return cls(**{f.name: getattr(namespace, f.name) for f in fields(cls)})

    def settings(self) -> dict:
        """The options as the JSON ``settings`` object (dtypes as their names)."""
        settings = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "kivi_options"}
        settings["kivi_options"] = {k: str(v) if isinstance(v, torch.dtype) else v for k, v in self.kivi_options}
        return settings
