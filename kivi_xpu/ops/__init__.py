"""The KIVI ops: declared once in :mod:`.declarations` (schemas, checks, shape rules) and registered as
``torch.ops.kivi_xpu.*`` by :mod:`.library`; implementations per backend in :mod:`.reference` (pure PyTorch, the
default and the ground truth), :mod:`.native` (native CPU kernels) and :mod:`.sycl` (SYCL kernels).
"""

from . import declarations  # noqa: F401  (defines the ops)
from .library import (
    OPS,
    BackendOps,
    call,
    cpu_backend,
    direct_kernel,
    for_backend,
    kernel,
    register_direct,
    register_kernel,
    use_backend,
)

__all__ = [
    "OPS",
    "BackendOps",
    "call",
    "cpu_backend",
    "direct_kernel",
    "for_backend",
    "kernel",
    "register_direct",
    "register_kernel",
    "use_backend",
]
