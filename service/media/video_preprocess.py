"""Qwen3-VL video pixels, bit-exact with transformers' Qwen3VLVideoProcessor, without torchvision.

The reference is `transformers.models.qwen3_vl.video_processing_qwen3_vl.Qwen3VLVideoProcessor` (its
torchvision backend, transformers 5.17 to 5.24) on decoded frames, as it runs by default: on the CPU.
After sampling (media/video.py) it does, on the whole clip at once:

    resize to one (h, w) (`clip_size`): torchvision's resize, bicubic, antialiased, on the uint8 frames
    a FUSED rescale + normalize, in float32: (x - M) / S, M = mean * (1 / rescale_factor), S likewise of std
    an odd frame count padded by repeating the last frame; patchify: rows (t group, gh/m, gw/m, m, m),
    columns (c, t, py, px)

    resize_frames(frames, h, w)          -> uint8 [n, h, w, 3]         (decode side)
    video_lut(params)                    -> float32 [3, 256]           the fused rescale + normalize per level
    patchify_video(frames, lut, params)  -> float32 [grid_t*gh*gw, 3*t*p*p]
    video_grid(n, h, w, params)          -> (grid_t, gh, gw)           video_grid_thw

As for images (media/preprocess.py), the work splits at the uint8 boundary and the normalization is a
[3, 256] table computed with exactly the reference's float ops. The values differ from the image path's:
images rescale then normalize (x * (1/255) - 0.5) / 0.5; videos subtract and divide by mean and std
scaled by 255 ((x - 127.5) / 127.5), which rounds differently.
"""

from __future__ import annotations

import typing

import numpy as np

from service.media.preprocess import patch_rows

if typing.TYPE_CHECKING:
    import torch

    from service.media.video import VideoParams


def resize_frames(frames: np.ndarray, height: int, width: int) -> np.ndarray:
    """uint8 [n, H, W, 3] -> uint8 [n, height, width, 3]: torchvision's resize (bicubic, antialias) as
    Qwen3VLVideoProcessor calls it on CPU tensors (torchvision/transforms/v2/functional/_geometry.py,
    resize_image, 0.26):

      * the size unchanged: the input itself, not resampled;
      * uint8 on the CPU with BICUBIC: torch's own uint8 kernel (`_do_native_uint8_resize_on_cpu` is true
        for bicubic on every CPU), no float round trip; its fixed-point arithmetic is not the float
        path's: one value in six or seven differs, by a level or a few, from float32 interpolate + clamp + round,
        which is what torchvision does on CUDA tensors (the processor with device="cuda");
      * F.interpolate(mode="bicubic", align_corners=False, antialias=True).

    NOTE: torchvision hands interpolate contiguous NCHW frames; these go in as NHWC memory (channels
    last) and come out so, without two copies: torch's uint8 kernel gives the same bytes for either
    layout (tests/media/test_video.py checks it on real frames).
    """
    import torch  # NOTE: local: only the processes that resize video import torch for it
    import torch.nn.functional as F

    assert frames.dtype == np.uint8 and frames.ndim == 4 and frames.shape[3] == 3, (
        f"frames must be [n, H, W, 3] uint8, got {frames.shape} {frames.dtype}"
    )
    n, old_h, old_w, _ = frames.shape
    if (height, width) == (old_h, old_w):
        return frames
    x = torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2)  # [n, 3, H, W], channels last
    y = F.interpolate(x, size=[height, width], mode="bicubic", align_corners=False, antialias=True)
    assert y.dtype == torch.uint8, "torch resized uint8 as uint8: this is a bug"
    return np.ascontiguousarray(y.permute(0, 2, 3, 1).numpy())  # (already NHWC in memory: no copy)


def video_lut(params: VideoParams) -> np.ndarray:
    """[3, 256] float32: the processor's value for each (channel, uint8 level), with its exact float ops
    (TorchvisionBackend.rescale_and_normalize, fused): mean and std as torch.tensor(list) (float32) times
    1.0 / rescale_factor, in float32; then torchvision's normalize: x.float32 - mean, then / std."""
    import torch

    mean = torch.tensor(list(params.image_mean)) * (1.0 / params.rescale_factor)  # [3] float32
    std = torch.tensor(list(params.image_std)) * (1.0 / params.rescale_factor)
    levels = torch.arange(256, dtype=torch.uint8).to(torch.float32)
    lut = levels.view(1, 256).sub(mean.view(3, 1)).div_(std.view(3, 1))
    assert lut.dtype == torch.float32 and tuple(lut.shape) == (3, 256), "float32 in, float32 out: this is a bug"
    return np.ascontiguousarray(lut.numpy())


def video_grid(num_frames: int, height: int, width: int, params: VideoParams) -> tuple[int, int, int]:
    """video_grid_thw of `num_frames` resized frames (an odd count padded to whole temporal patches)."""
    assert height % params.factor == 0 and width % params.factor == 0, (
        f"{height}x{width} is not a clip_size output: this is a bug"
    )
    t = params.temporal_patch_size
    return (-(-num_frames // t), height // params.patch_size, width // params.patch_size)


def patchify_video(
    frames: torch.Tensor, lut: torch.Tensor, params: VideoParams, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Resized uint8 frames [n, h, w, 3] -> pixel_values_videos [grid_t*gh*gw, 3*t*p*p] float32, equal to
    the processor's: n padded to whole temporal patches by repeating the last frame, rows (t group, gh/m,
    gw/m, m, m), columns (c, t, py, px), each value lut[c, pixel].

    lut: [3, 256] float32 from `video_lut`. out: optional preallocated contiguous result (returned)."""
    import torch

    assert frames.dtype == torch.uint8 and frames.dim() == 4 and frames.shape[0] > 0, (
        f"frames must be [n, h, w, 3] uint8 with n > 0, got {tuple(frames.shape)} {frames.dtype}"
    )
    if pad := -frames.shape[0] % params.temporal_patch_size:
        frames = torch.cat([frames, frames[-1:].expand(pad, *frames.shape[1:])])
    return patch_rows(frames, lut, params.patch_size, params.merge_size, params.temporal_patch_size, out=out)
