"""GPU patchify: staged uint8 images -> the vision tower's normalized patch rows, in one kernel.

The host stages decoded, resized uint8 pixels (several images back to back, each [H, W, 3]) plus a
small image table; this kernel reads the pixels in place (device memory, or pinned host memory
through unified addressing, so no separate H2D copy is needed) and writes `pixel_values` in the
exact row and column order of transformers' Qwen2-VL/Qwen3-VL image processor:

    rows    (h/m, w/m, m, m): row j of an image = ((bh * (gw/m) + bw) * m + mh) * m + mw,
            patch (py_, px_) = (bh*m + mh, bw*m + mw); each m x m merge block is contiguous
    columns (c, py, px) (or (c, t, py, px) with temporal=True: the frame repeated over t)
    value   lut[c][pixel] -- the exact normalized float per channel and uint8 level, computed on
            the host like the processor does it, so the gather is bit-identical to it

CuPy is imported only when the kernel is first launched: importing this module needs no GPU.
"""

from __future__ import annotations

import functools

import torch

_LUT_LEVELS = 256

# One block per output row (one patch): the block first stages the patch's P rows of 3P bytes in
# shared memory with coalesced (16-byte when aligned) loads -- each source byte is read once, which
# matters when the source is pinned host memory read over PCIe -- then every thread produces one
# column: a shared-memory byte, a LUT gather (3 KB, stays in L1), one coalesced store.
#
# NOTE: the image of a row is found by a binary search over the table's first-row column instead of
# a per-row image index. The table is n x 16 bytes and stays in L1/L2; a per-row index would be
# another rows-long array to build on the host and move every step. The search is uniform across
# the block (every thread computes the same answer from broadcast loads), so it needs no sync.
_SOURCE = r"""
#define COLS (3 * PATCH * PATCH)   // 768 for patch 16: one column per (c, py, px)
#define ROW_BYTES (3 * PATCH)      // one pixel row of one patch, RGB interleaved: 48 bytes
#define ROW_VECS (ROW_BYTES / 16)

__device__ __forceinline__ unsigned short f32_to_bf16_rne(float f) {
    // Round to nearest, ties to even; what torch's float -> bfloat16 conversion does for non-NaN.
    unsigned int u = __float_as_uint(f);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
}

__device__ __forceinline__ void store(float* out, long long i, float v) { out[i] = v; }
__device__ __forceinline__ void store(unsigned short* out, long long i, float v) { out[i] = f32_to_bf16_rne(v); }

template <typename T>
__device__ __forceinline__ void patchify(
    const unsigned char* __restrict__ src,  // images back to back, each [H, W, 3] uint8
    const int* __restrict__ images,         // [n, 4]: src byte offset, H, W, first output row
    const float* __restrict__ lut,          // [3, 256]
    T* __restrict__ out,                    // [rows, COLS * (temporal ? 2 : 1)]
    int num_images, int temporal)
{
    __shared__ __align__(16) unsigned char tile[PATCH * ROW_BYTES];
    const int r = blockIdx.x;

    int lo = 0, hi = num_images - 1;  // last image whose first row <= r
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (images[4 * mid + 3] <= r) lo = mid; else hi = mid - 1;
    }
    const long long off = images[4 * lo + 0];
    const int W = images[4 * lo + 2];
    const int j = r - images[4 * lo + 3];
    const int bws = W / (PATCH * MERGE);  // merge blocks per block row
    const int mw = j % MERGE;
    const int mh = (j / MERGE) % MERGE;
    const int b = j / (MERGE * MERGE);
    const int py0 = ((b / bws) * MERGE + mh) * PATCH;
    const int px0 = ((b % bws) * MERGE + mw) * PATCH;
    const long long stride = 3LL * W;
    const unsigned char* base = src + off + (py0 * (long long)W + px0) * 3;

    if (ROW_BYTES % 16 == 0 && ((unsigned long long)base & 15) == 0 && (stride & 15) == 0) {
        for (int k = threadIdx.x; k < PATCH * ROW_VECS; k += blockDim.x) {
            const int row = k / ROW_VECS, v = k % ROW_VECS;
            reinterpret_cast<uint4*>(tile)[k] = reinterpret_cast<const uint4*>(base + row * stride)[v];
        }
    } else {
        for (int k = threadIdx.x; k < PATCH * ROW_BYTES; k += blockDim.x)
            tile[k] = base[(k / ROW_BYTES) * stride + k % ROW_BYTES];
    }
    __syncthreads();

    const long long out_row = (long long)r * COLS * (temporal ? 2 : 1);
    for (int k = threadIdx.x; k < COLS; k += blockDim.x) {
        const int c = k / (PATCH * PATCH), q = k % (PATCH * PATCH);
        const int py = q / PATCH, px = q % PATCH;
        const float v = lut[c * 256 + tile[py * ROW_BYTES + px * 3 + c]];
        if (temporal) {  // columns (c, t, py, px): the frame twice
            const long long i = out_row + (long long)c * 2 * PATCH * PATCH + q;
            store(out, i, v);
            store(out, i + PATCH * PATCH, v);
        } else {
            store(out, out_row + k, v);
        }
    }
}

extern "C" __global__ void __launch_bounds__(BLOCK)
patchify_f32(const unsigned char* src, const int* images, const float* lut, float* out, int n, int temporal) {
    patchify<float>(src, images, lut, out, n, temporal);
}

extern "C" __global__ void __launch_bounds__(BLOCK)
patchify_bf16(const unsigned char* src, const int* images, const float* lut, unsigned short* out, int n, int temporal) {
    patchify<unsigned short>(src, images, lut, out, n, temporal);
}
"""


def _block_size(patch_size: int) -> int:
    return min(1024, -(-3 * patch_size * patch_size // 32) * 32)


@functools.cache
def _kernels(device_index: int, patch_size: int, merge_size: int) -> dict[torch.dtype, object]:
    """Compile (once per process and device; CuPy also caches the binary on disk) and load."""
    import cupy

    with cupy.cuda.Device(device_index):
        module = cupy.RawModule(
            code=_SOURCE,
            options=(
                "-std=c++17",
                f"-DPATCH={patch_size}",
                f"-DMERGE={merge_size}",
                f"-DBLOCK={_block_size(patch_size)}",
            ),
        )
        return {
            torch.float32: module.get_function("patchify_f32"),
            torch.bfloat16: module.get_function("patchify_bf16"),
        }


def cupy_available() -> bool:
    """True when CuPy imports and sees a GPU (the service falls back to CPU preprocessing otherwise)."""
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # ImportError, or a CuPy that cannot find a driver / CUDA runtime
        return False


def copy_async(copies: list[tuple[int, int, int]], stream: torch.cuda.Stream) -> None:
    """Enqueue raw copies (dst pointer, src pointer, bytes) on `stream`, in order: cudaMemcpyAsync with
    the direction from unified addressing. Why not torch's copy_: for a pinned source each call also
    records an event for torch's pinned-memory allocator and slices two tensors; six such copies were
    ~0.24 ms of a lone image's step on an H200 host. The caller owns both buffers' lifetimes (the
    engine's slots and device mirrors live as long as it does; its slot fence guards the source)."""
    import cupy

    memcpy, kind, handle = cupy.cuda.runtime.memcpyAsync, cupy.cuda.runtime.memcpyDefault, stream.cuda_stream
    for dst, src, nbytes in copies:
        if nbytes:
            memcpy(dst, src, nbytes, kind, handle)


def patch_rows(height: int, width: int, patch_size: int = 16) -> int:
    """Output rows (patches) of one [height, width] image."""
    return (height // patch_size) * (width // patch_size)


def check_image_table(
    table: torch.Tensor, src_bytes: int, rows: int, patch_size: int = 16, merge_size: int = 2
) -> None:
    """Validate an image table (host tensor [n, 4] int32: src byte offset, H, W, first row).

    Images must tile a multiple of patch*merge, lie inside `src`, and their rows must be packed in
    order from 0 to exactly `rows`. Raises ValueError (these are programming errors of the caller).
    """
    assert table.device.type == "cpu", "check_image_table reads the table on the host"
    if table.dim() != 2 or table.shape[1] != 4:
        raise ValueError(f"images must be [n, 4] (offset, H, W, first_row), got {tuple(table.shape)}")
    if table.shape[0] == 0:
        if rows != 0:
            raise ValueError(f"no images but out has {rows} rows")
        return
    t = table.to(torch.int64)
    off, h, w, first = t.unbind(1)
    factor = patch_size * merge_size
    bad = (h <= 0) | (w <= 0) | (h % factor != 0) | (w % factor != 0)
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise ValueError(f"image {i}: H, W = {int(h[i])}, {int(w[i])} must be positive multiples of {factor}")
    end = off + h * w * 3
    bad = (off < 0) | (end > src_bytes)
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise ValueError(f"image {i}: bytes [{int(off[i])}, {int(end[i])}) lie outside src ({src_bytes} bytes)")
    n_rows = (h // patch_size) * (w // patch_size)
    expected_first = torch.cumsum(n_rows, 0) - n_rows
    bad = first != expected_first
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise ValueError(f"image {i}: first row {int(first[i])}, expected {int(expected_first[i])} (rows packed in order)")
    if int(n_rows.sum()) != rows:
        raise ValueError(f"images cover {int(n_rows.sum())} rows but out has {rows}")


def _check_input(name: str, t: torch.Tensor, dtype: torch.dtype, device: torch.device) -> None:
    if t.dtype != dtype:
        raise ValueError(f"{name} must be {dtype}, got {t.dtype}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    if t.device == device:
        return
    if t.device.type == "cpu" and t.is_pinned():
        return  # read in place through unified addressing
    raise ValueError(f"{name} must be on {device} or in pinned host memory, got {t.device}")


def patchify_cuda(
    src: torch.Tensor,
    images: torch.Tensor,
    lut: torch.Tensor,
    out: torch.Tensor,
    *,
    patch_size: int = 16,
    merge_size: int = 2,
    temporal: bool = False,
    images_host: torch.Tensor | None = None,
) -> None:
    """Write every image's patch rows into `out`, on torch's current CUDA stream.

    src:    uint8, contiguous, images back to back, each [H, W, 3]; on out's device or pinned host
    images: int32 [n, 4] (src byte offset, H, W, first output row); on out's device or pinned host.
            A device table is faster (every block binary-searches it).
    lut:    float32 [3, 256] on out's device: normalized value per channel and uint8 level
    out:    float32 or bfloat16 [total rows, 3*P*P] (temporal: [total rows, 3*2*P*P]), contiguous

    The table's values are validated when they can be read without syncing with the GPU: from
    `images` itself when it is a host tensor, else from `images_host` (the host copy it was made
    from) when given. A device table without a host copy is trusted.

    The kernel reads `src` (and a host `images`) asynchronously: the caller must keep them unchanged
    and alive until the work on this stream has run (service.engine.pool does that with an event per slot).
    """
    if out.device.type != "cuda":
        raise ValueError(f"out must be a CUDA tensor, got {out.device}")
    if out.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"out must be float32 or bfloat16, got {out.dtype}")
    cols = 3 * patch_size * patch_size * (2 if temporal else 1)
    if out.dim() != 2 or out.shape[1] != cols or not out.is_contiguous():
        raise ValueError(f"out must be contiguous [rows, {cols}] (temporal={temporal}), got {tuple(out.shape)}")
    if lut.dtype != torch.float32 or tuple(lut.shape) != (3, _LUT_LEVELS) or not lut.is_contiguous():
        raise ValueError(f"lut must be contiguous float32 [3, 256], got {lut.dtype} {tuple(lut.shape)}")
    if lut.device != out.device:
        raise ValueError(f"lut must be on {out.device}, got {lut.device}")
    _check_input("src", src, torch.uint8, out.device)
    _check_input("images", images, torch.int32, out.device)
    if images.dim() != 2 or images.shape[1] != 4:
        raise ValueError(f"images must be [n, 4] (offset, H, W, first_row), got {tuple(images.shape)}")
    if src.numel() >= 2**31:
        raise ValueError(f"src holds {src.numel()} bytes; offsets are int32, so stage < 2 GiB per step")
    host_table = images if images.device.type == "cpu" else images_host
    if host_table is not None:
        if tuple(host_table.shape) != tuple(images.shape):
            raise ValueError(f"images_host shape {tuple(host_table.shape)} != images shape {tuple(images.shape)}")
        check_image_table(host_table, src.numel(), out.shape[0], patch_size, merge_size)
    if out.shape[0] == 0:
        return
    if images.shape[0] == 0:
        raise ValueError(f"no images but out has {out.shape[0]} rows")

    import cupy
    import numpy as np

    kernel = _kernels(out.device.index, patch_size, merge_size)[out.dtype]
    stream = torch.cuda.current_stream(out.device)
    with cupy.cuda.Device(out.device.index), cupy.cuda.ExternalStream(stream.cuda_stream):
        kernel(
            (out.shape[0],),
            (_block_size(patch_size),),
            (
                np.uint64(src.data_ptr()),
                np.uint64(images.data_ptr()),
                np.uint64(lut.data_ptr()),
                np.uint64(out.data_ptr()),
                np.int32(images.shape[0]),
                np.int32(1 if temporal else 0),
            ),
        )
