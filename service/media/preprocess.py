"""Qwen3-VL image preprocessing, bit-exact with transformers' PIL backend.

The reference is `transformers.models.qwen2_vl.image_processing_pil_qwen2_vl.Qwen2VLImageProcessorPil`
called with Qwen3-VL's values (patch 16, merge 2, temporal patch 2, mean = std = 0.5, bicubic). It does:

    convert_to_rgb (transparency composited on white)  ->  uint8 RGB
    smart_resize + PIL resize (uint8 in, uint8 out)     ->  uint8 [H', W', 3]
    rescale: float64(x) * (1/255) -> float32; normalize: (x - mean) / std in float32
    patchify: rows (h/2, w/2, 2, 2), columns (c, t, py, px), the frame repeated over t

We split it at the uint8 boundary: decode workers produce the resized uint8 pixels (`resize`), and the
step loop turns them into float patches (`patchify`) with a 3x256 lookup table (`normalize_lut`).
Rescale + normalize is a pure function of (channel, uint8 level), so a gather from a table computed
with exactly the reference's float ops reproduces the reference bit for bit.
"""

from __future__ import annotations

import math
import typing

import numpy as np
from PIL import Image

from service.errors import ImageError
from service.media.params import PreprocessParams

if typing.TYPE_CHECKING:
    import torch

# NOTE: the model's limit, not a service setting: transformers' smart_resize raises when
# max(h, w) / min(h, w) > 200 (strictly greater; a ratio of exactly 200 is accepted).
MAX_ASPECT_RATIO = 200.0


def smart_resize(height: int, width: int, params: PreprocessParams) -> tuple[int, int]:
    """The (height, width) the image is resized to: multiples of patch*merge, pixels within
    [min_pixels, max_pixels], aspect ratio kept as well as possible. Same math as transformers'."""
    assert height > 0 and width > 0, f"image size {width}x{height} must be positive: this is a bug"
    ratio = max(height, width) / min(height, width)
    if ratio > MAX_ASPECT_RATIO:
        raise ImageError(
            f"image is {width}x{height}, an aspect ratio of {ratio:.1f}:1, over the model's limit of "
            f"{MAX_ASPECT_RATIO:.0f}:1; crop or pad it to a less extreme shape", code="aspect_ratio_too_extreme"
        )
    factor = params.factor
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > params.max_pixels:
        beta = math.sqrt((height * width) / params.max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < params.min_pixels:
        beta = math.sqrt(params.min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def grid_for(height: int, width: int, params: PreprocessParams) -> tuple[int, int, int]:
    """grid_thw of a *resized* image (height, width multiples of patch*merge): one frame."""
    assert height % params.factor == 0 and width % params.factor == 0, (
        f"{height}x{width} is not a smart_resize output: this is a bug"
    )
    return (1, height // params.patch_size, width // params.patch_size)


def num_patches(grid_thw: tuple[int, int, int]) -> int:
    t, h, w = grid_thw
    return t * h * w


def num_tokens(grid_thw: tuple[int, int, int], params: PreprocessParams) -> int:
    """Output tokens (embedding rows) of one image: patches / merge**2."""
    return num_patches(grid_thw) // (params.merge_size**2)


def to_rgb(img: Image.Image) -> Image.Image:
    """The RGB conversion transformers' processor applies to a PIL image (image_transforms.convert_to_rgb).

    NOTE: copied behaviour, quirks included: any band named 'A' counts as alpha, so a LAB image's a*
    channel is used as alpha; 16-bit and 32-bit modes (I;16, I, F) are clipped to 0..255, not scaled.
    Raises ValueError for the few modes PIL cannot convert (e.g. 'La'); images.py turns that into a
    client error.
    """
    has_alpha = "A" in img.getbands() or img.info.get("transparency") is not None
    if has_alpha:
        rgba = img.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    if img.mode == "RGB":
        return img  # convert() would return an identical copy
    return img.convert("RGB")


def resize(img_rgb: Image.Image, params: PreprocessParams, out: np.ndarray | None = None) -> np.ndarray:
    """smart_resize + PIL resize of an RGB image, as the processor does it: the uint8 image is resized
    by PIL itself (reducing_gap=None), so the result is uint8. Returns [H', W', 3] uint8, C-contiguous.

    out: optional preallocated [H', W', 3] uint8 C-contiguous array to write into (returned)."""
    assert img_rgb.mode == "RGB", f"resize expects an RGB image, got {img_rgb.mode}: call to_rgb first"
    width, height = img_rgb.size
    new_h, new_w = smart_resize(height, width, params)
    resized = img_rgb.resize((new_w, new_h), resample=params.resample, reducing_gap=None)
    if out is None:
        # np.array copies: the result is writable (torch.from_numpy, pinned copies) and owns its memory.
        return np.array(resized, dtype=np.uint8, order="C")
    assert out.dtype == np.uint8 and out.shape == (new_h, new_w, 3) and out.flags.c_contiguous, (
        f"out must be a contiguous [{new_h}, {new_w}, 3] uint8 array, got {out.shape} {out.dtype}"
    )
    out[...] = np.asarray(resized)  # asarray is a view of PIL's packed bytes: this is the one copy
    return out


def normalize_lut(params: PreprocessParams) -> np.ndarray:
    """[3, 256] float32: the processor's value for each (channel, uint8 level), with its exact float ops.

    rescale: uint8 -> float64, times rescale_factor, cast to float32 (image_transforms.rescale);
    normalize: (x - mean) / std with mean and std as float32 arrays, in float32 (image_transforms.normalize).
    """
    levels = np.arange(256, dtype=np.uint8)
    rescaled = (levels.astype(np.float64) * params.rescale_factor).astype(np.float32)  # [256]
    mean = np.array(params.image_mean, dtype=np.float32)[:, None]  # [3, 1]
    std = np.array(params.image_std, dtype=np.float32)[:, None]  # [3, 1]
    lut = (rescaled[None, :] - mean) / std
    assert lut.dtype == np.float32 and lut.shape == (3, 256), "float32 in, float32 out: this is a bug"
    return np.ascontiguousarray(lut)


def patchify(
    pixels: torch.Tensor,
    lut: torch.Tensor,
    params: PreprocessParams,
    temporal: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Resized uint8 pixels -> the vision tower's flat patch rows (the CPU path; kernels/ mirrors it).

    pixels: [H, W, 3] uint8, H and W multiples of patch*merge (a `resize` output).
    lut: [3, 256] float32 from `normalize_lut`.
    Returns [gh*gw, D] float32 with rows ordered (gh/m, gw/m, m, m), so each merge block is contiguous, and
      temporal=True:  D = 3*T*p*p (1536), columns (c, t, py, px), the frame repeated over t: equal to the
                      processor's pixel_values;
      temporal=False: D = 3*p*p (768), columns (c, py, px): the t=0 half, for a patch embedding whose
                      Conv3d weights are summed over t.
    out: optional preallocated [gh*gw, D] float32 contiguous tensor to write into (returned).
    """
    import torch  # NOTE: local, so decode worker processes (which never patchify) don't import torch

    assert pixels.dtype == torch.uint8 and pixels.dim() == 3 and pixels.shape[2] == 3, (
        f"pixels must be [H, W, 3] uint8, got {tuple(pixels.shape)} {pixels.dtype}"
    )
    height, width, channels = pixels.shape
    p, t = params.patch_size, params.temporal_patch_size
    rows = (height // p) * (width // p)
    reps = t if temporal else 1
    width_out = channels * reps * p * p
    if out is None:
        out = torch.empty((rows, width_out), dtype=torch.float32, device=pixels.device)
    assert out.dtype == torch.float32 and tuple(out.shape) == (rows, width_out) and out.is_contiguous(), (
        f"out must be a contiguous [{rows}, {width_out}] float32 tensor, got {tuple(out.shape)} {out.dtype}"
    )
    if reps == 1:
        return patch_rows(pixels[None], lut, p, params.merge_size, 1, out=out)
    # An image is one frame repeated over t: look it up once, then copy it into each t slot.
    values = patch_rows(pixels[None], lut, p, params.merge_size, 1).view(rows, channels, 1, p * p)
    out.view(rows, channels, reps, p * p).copy_(values.expand(rows, channels, reps, p * p))
    return out


def patch_rows(
    frames: torch.Tensor, lut: torch.Tensor, patch: int, merge: int, temporal: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """uint8 frames [N, H, W, C] (N a multiple of `temporal`) -> float32 [N/temporal * gh*gw, C*temporal*p*p],
    each value lut[c, pixel]: transformers' patch layout, rows (t group, gh/m, gw/m, m, m), columns
    (c, t, py, px). The one patch gather of images (`patchify`, N = 1) and videos (video_preprocess).

    lut: [C, 256] float32. out: optional preallocated contiguous result to write into (returned)."""
    import torch

    assert frames.dtype == torch.uint8 and frames.dim() == 4, (
        f"frames must be [N, H, W, C] uint8, got {tuple(frames.shape)} {frames.dtype}"
    )
    n, height, width, channels = frames.shape
    assert lut.dtype == torch.float32 and tuple(lut.shape) == (channels, 256), (
        f"lut must be [{channels}, 256] float32, got {tuple(lut.shape)} {lut.dtype}"
    )
    p, m, t = patch, merge, temporal
    assert height % (p * m) == 0 and width % (p * m) == 0, f"{height}x{width} is not a multiple of {p * m}"
    assert n % t == 0, f"{n} frames are not whole temporal patches of {t}: pad first (this is a bug)"
    groups, gh, gw = n // t, height // p, width // p

    # Reorder the uint8 pixels first (a quarter of the bytes of float32), then look them up.
    # [N, H, W, C] -> (G, t, gh/m, m, p, gw/m, m, p, C) -> (G, gh/m, gw/m, m, m, C, t, p, p)
    blocks = frames.reshape(groups, t, gh // m, m, p, gw // m, m, p, channels).permute(0, 2, 5, 3, 6, 8, 1, 4, 7)
    blocks = blocks.reshape(groups * gh * gw, channels, t * p * p)  # copies: [rows, C, t*p*p] uint8
    offsets = torch.arange(channels, dtype=torch.int32, device=frames.device).view(1, channels, 1) * 256
    index = (blocks.to(torch.int32) + offsets).view(-1)  # into the flattened lut

    shape = (groups * gh * gw, channels * t * p * p)
    if out is None:
        out = torch.empty(shape, dtype=torch.float32, device=frames.device)
    assert out.dtype == torch.float32 and tuple(out.shape) == shape and out.is_contiguous(), (
        f"out must be a contiguous {list(shape)} float32 tensor, got {tuple(out.shape)} {out.dtype}"
    )
    torch.index_select(lut.reshape(-1), 0, index, out=out.view(-1))
    return out
