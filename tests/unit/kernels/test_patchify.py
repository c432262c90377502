"""qve_kernels.patchify: the GPU patchify kernel against a tiny independent torch reference.

The kernel tests need CUDA and CuPy and are skipped without them; the launcher's table checks, the
CPU import, and the reference's layout (against transformers' own processor) run anywhere.
Tolerance: none. The kernel only gathers LUT values and reorders them, so float32 output must equal
the reference bit for bit, and bfloat16 output must equal the reference's `.to(torch.bfloat16)`.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from qve_kernels.patchify import check_image_table, cupy_available, patch_rows, patchify_cuda

P, M = 16, 2
HAVE_GPU = torch.cuda.is_available() and cupy_available()
needs_gpu = pytest.mark.skipif(not HAVE_GPU, reason="needs a CUDA GPU and CuPy (pip install cupy-cuda12x or -cuda13x)")

# Different sizes: the minimum 32x32, non-square both ways, a thin strip, and a large one.
SIZES = [(32, 32), (64, 96), (96, 64), (448, 448), (32, 320), (1024, 768)]


def reference(pixels: torch.Tensor, lut: torch.Tensor, temporal: bool = False) -> torch.Tensor:
    """[H, W, 3] uint8 -> [patches, 3*P*P] (or 3*2*P*P) float32 in the processor's order."""
    h, w, _ = pixels.shape
    vals = torch.stack([lut[c][pixels[..., c].long()] for c in range(3)])  # [3, H, W]
    gh, gw = h // P, w // P
    x = vals.reshape(3, gh // M, M, P, gw // M, M, P).permute(1, 4, 2, 5, 0, 3, 6)  # bh bw mh mw c py px
    x = x.reshape(gh * gw, 3, 1, P * P)
    if temporal:
        x = x.expand(-1, -1, 2, -1)
    return x.reshape(gh * gw, -1)


def make_lut(seed: int = 0) -> torch.Tensor:
    """Random per-channel values, plus bf16 rounding edge cases: exact ties (both parities) and
    mantissas that carry into the exponent."""
    g = torch.Generator().manual_seed(seed)
    lut = torch.randn(3, 256, generator=g)
    bits = lut.view(torch.int32)
    hi = torch.randint(0x3C00, 0x4100, (32,), generator=g, dtype=torch.int32)
    bits[2, :32] = (hi << 16) | 0x8000  # ties: round to the even neighbour
    edges = [0x3F7FFFFF, 0x3F7F8000, 0x3F7F7FFF, 0xBF7FFFFF, 0x00000001, 0x80008000, 0x7F7F7FFF, 0x7F7FFFFF, 0x3F808000]
    bits[2, 32 : 32 + len(edges)] = torch.tensor([e - (1 << 32) if e >= 1 << 31 else e for e in edges], dtype=torch.int32)
    return lut


def make_batch(sizes, seed: int = 0, pad: int = 0):
    """Images back to back in one uint8 buffer (`pad` junk bytes before each: unaligned offsets)."""
    g = torch.Generator().manual_seed(seed)
    pixels, chunks, table, off, row = [], [], [], 0, 0
    for h, w in sizes:
        if pad:
            chunks.append(torch.randint(1, 256, (pad,), generator=g, dtype=torch.uint8))
            off += pad
        px = torch.randint(1, 256, (h, w, 3), generator=g, dtype=torch.uint8)  # never all zeros
        pixels.append(px)
        chunks.append(px.reshape(-1))
        table.append((off, h, w, row))
        off += px.numel()
        row += patch_rows(h, w, P)
    return torch.cat(chunks), torch.tensor(table, dtype=torch.int32), pixels, row


def run_kernel(src, table, lut, rows, *, dtype, temporal, src_where, table_where):
    src = src.pin_memory() if src_where == "pinned" else src.cuda()
    images = table.pin_memory() if table_where == "pinned" else table.cuda()
    cols = 3 * P * P * (2 if temporal else 1)
    out = torch.full((rows, cols), float("nan"), device="cuda", dtype=dtype)  # poison: every element must be written
    patchify_cuda(src, images, lut.cuda(), out, temporal=temporal, images_host=table)
    torch.cuda.synchronize()
    return out.cpu()


def expected(pixels, lut, temporal, dtype):
    ref = torch.cat([reference(px, lut, temporal) for px in pixels])
    return ref.to(dtype)


@needs_gpu
@pytest.mark.parametrize("temporal", [False, True], ids=["t1", "t2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("table_where", ["cuda", "pinned"])
@pytest.mark.parametrize("src_where", ["cuda", "pinned"])
def test_kernel_matches_reference(src_where, table_where, dtype, temporal):
    src, table, pixels, rows = make_batch(SIZES, seed=1)
    lut = make_lut(2)
    out = run_kernel(src, table, lut, rows, dtype=dtype, temporal=temporal, src_where=src_where, table_where=table_where)
    assert not torch.isnan(out.float()).any(), "some output elements were never written"
    assert torch.equal(out, expected(pixels, lut, temporal, dtype))


@needs_gpu
@pytest.mark.parametrize("src_where", ["cuda", "pinned"])
def test_kernel_unaligned_offsets(src_where):
    # Odd image offsets take the byte-load path instead of 16-byte vector loads.
    src, table, pixels, rows = make_batch([(64, 32), (32, 96), (128, 128)], seed=3, pad=5)
    lut = make_lut(4)
    out = run_kernel(src, table, lut, rows, dtype=torch.float32, temporal=False, src_where=src_where, table_where="cuda")
    assert torch.equal(out, expected(pixels, lut, False, torch.float32))


@needs_gpu
def test_kernel_single_image_and_current_stream():
    src, table, pixels, rows = make_batch([(32, 32)], seed=5)
    lut = make_lut(6).cuda()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        src_d, table_d = src.cuda(), table.cuda()
        out = torch.full((rows, 3 * P * P), float("nan"), device="cuda")
        patchify_cuda(src_d, table_d, lut, out)  # must be ordered after the copies on `side`
    side.synchronize()
    assert torch.equal(out.cpu(), expected(pixels, lut.cpu(), False, torch.float32))


@needs_gpu
def test_launcher_rejects_bad_arguments():
    src, table, _, rows = make_batch([(64, 64)], seed=7)
    lut, src_d, table_d = make_lut().cuda(), src.cuda(), table.cuda()
    out = torch.empty(rows, 3 * P * P, device="cuda")
    with pytest.raises(ValueError, match="pinned"):
        patchify_cuda(src, table_d, lut, out)  # pageable host memory: not readable by the GPU
    with pytest.raises(ValueError, match="uint8"):
        patchify_cuda(src_d.float(), table_d, lut, out)
    with pytest.raises(ValueError, match="int32"):
        patchify_cuda(src_d, table_d.long(), lut, out)
    with pytest.raises(ValueError, match="lut"):
        patchify_cuda(src_d, table_d, lut.double(), out)
    with pytest.raises(ValueError, match=r"\[rows, 1536\]"):
        patchify_cuda(src_d, table_d, lut, out, temporal=True)
    with pytest.raises(ValueError, match="contiguous"):
        patchify_cuda(src_d, table_d, lut, torch.empty(3 * P * P, rows, device="cuda").t())
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        patchify_cuda(src_d, table_d, lut, out.half())
    with pytest.raises(ValueError, match="out has"):
        patchify_cuda(src_d, table.pin_memory(), lut, out[:-1])


# ---- anywhere ----------------------------------------------------------------------------------------
def test_out_must_be_cuda():
    src, table, _, rows = make_batch([(32, 32)])
    with pytest.raises(ValueError, match="CUDA"):
        patchify_cuda(src, table, make_lut(), torch.empty(rows, 3 * P * P))


def test_check_image_table():
    src, table, _, rows = make_batch([(32, 64), (64, 32)])
    check_image_table(table, src.numel(), rows)  # fine
    check_image_table(torch.zeros(0, 4, dtype=torch.int32), 0, 0)
    bad = table.clone()
    bad[1, 1] = 48  # H not a multiple of patch*merge
    with pytest.raises(ValueError, match="multiples of 32"):
        check_image_table(bad, src.numel(), rows)
    with pytest.raises(ValueError, match="outside src"):
        check_image_table(table, src.numel() - 1, rows)
    bad = table.clone()
    bad[1, 3] += 1
    with pytest.raises(ValueError, match="first row"):
        check_image_table(bad, src.numel(), rows)
    with pytest.raises(ValueError, match="out has"):
        check_image_table(table, src.numel(), rows + 4)
    with pytest.raises(ValueError, match=r"\[n, 4\]"):
        check_image_table(table[:, :3], src.numel(), rows)


def test_reference_layout_matches_transformers():
    """The test reference (and so the kernel spec) orders rows and columns like transformers."""
    pil_proc = pytest.importorskip("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")
    from PIL import Image

    # 256x320: multiples of 32 and above min_pixels, so smart_resize keeps the size (no resampling).
    px = torch.randint(0, 256, (256, 320, 3), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    proc = pil_proc.Qwen2VLImageProcessorPil(
        size={"shortest_edge": 65536, "longest_edge": 16777216},
        patch_size=P,
        merge_size=M,
        temporal_patch_size=2,
        image_mean=[0.5] * 3,
        image_std=[0.5] * 3,
    )
    got = proc(images=[Image.fromarray(px.numpy())], return_tensors="pt")
    assert got["image_grid_thw"].tolist() == [[1, 256 // P, 320 // P]]
    levels = torch.arange(256, dtype=torch.float64)
    lut = ((levels / 255 - 0.5) / 0.5).float().expand(3, 256).contiguous()
    # Exactness of the LUT itself is service/media/preprocess.py's business; a layout error would be ~1.
    np.testing.assert_allclose(got["pixel_values"].numpy(), reference(px, lut, temporal=True).numpy(), rtol=0, atol=1e-6)
