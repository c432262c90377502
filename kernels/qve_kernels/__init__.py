"""GPU kernels: CuPy (patchify) and Triton (rotary). Importing needs no GPU, CuPy or Triton; a kernel compiles on its first launch."""

from qve_kernels.patchify import check_image_table, cupy_available, patchify_cuda

__all__ = ["check_image_table", "cupy_available", "patchify_cuda"]
