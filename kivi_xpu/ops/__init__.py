"""Quantization ops: the pure-PyTorch reference (:mod:`.reference`), the SYCL kernels' host wrappers
(:mod:`.sycl`, kernels in ``csrc/``), their torch.library registration (:mod:`.library`), and the shared
argument checks (:mod:`.checks`). Which implementation a cache uses is chosen by :func:`kivi_xpu.backend.select`.
"""
