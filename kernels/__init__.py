"""GPU kernels (CuPy). Importing needs no GPU and no CuPy; a kernel compiles on its first launch."""

from kernels.preprocess import check_image_table, cupy_available, patchify_cuda

__all__ = ["check_image_table", "cupy_available", "patchify_cuda"]
