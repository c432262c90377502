"""Qwen3-VL video pixels, bit-exact with transformers' Qwen3VLVideoProcessor, without torchvision.

The reference is `transformers.models.qwen3_vl.video_processing_qwen3_vl.Qwen3VLVideoProcessor` (its
torchvision backend, transformers 5.17 to 5.24) on decoded frames, as it runs by default: on the CPU.
After sampling (media/video.py) it does, on the whole clip at once (here on each frame as it is decoded,
which gives the same bytes: torch's resize treats the frames of a batch one by one):

    resize to one (h, w) (`clip_size`): torchvision's resize, bicubic, antialiased, on the uint8 frames
    a FUSED rescale + normalize, in float32: (x - M) / S, M = mean * (1 / rescale_factor), S likewise of std
    an odd frame count padded by repeating the last frame; patchify: rows (t group, gh/m, gw/m, m, m),
    columns (c, t, py, px)

    plan_video(header, params)           -> VideoPlan                  indices, size, grid, tokens: from the header alone
    prepare_video(data, header, ...)     -> PreparedVideo              decode + resize, frame by frame: a decode worker's whole job
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
from dataclasses import dataclass

import numpy as np

from service.errors import VideoError
from service.media.params import VideoLimits, VideoParams
from service.media.preprocess import patch_rows
from service.media.video import VideoHeader, clip_size, sample_indices, sampled_frames, timestamps

if typing.TYPE_CHECKING:
    import torch


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
    layout (tests/unit/media/test_video.py checks it on real frames).
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


def warm() -> None:
    """Import what a video's decode and resize need (PyAV, torch) and run one small resize, so that a
    process's first video does not pay it: torch's import alone took 3.9 s on the 2-core machine, and on
    the H200 the first 30 s clips an API process decoded took 3.5-3.8 s where later ones took 0.4-1.0 s
    (bench/bench_video.py). Without PyAV (the video extra) there is nothing to warm."""
    try:
        import av  # noqa: F401
    except ImportError:
        return
    resize_frames(np.zeros((2, 64, 64, 3), np.uint8), 32, 32)


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


@dataclass(frozen=True)
class VideoPlan:
    """What a video's header alone says it becomes (admission counts `tokens` before any frame is decoded)."""

    indices: tuple[int, ...]  # the source frames sampled (sample_indices), ascending
    height: int  # clip_size: every frame resized to this
    width: int
    grid_thw: tuple[int, int, int]  # (temporal groups, height / patch, width / patch)
    tokens: int  # output tokens: grid patches / merge**2
    frames: int  # resized frames: the sampled ones, an odd count padded to whole temporal groups

    @property
    def nbytes(self) -> int:
        """The resized clip's bytes (uint8 [frames, height, width, 3]): what its decode holds, besides the
        frame being resized, and what the video budgets (--video-max-request-bytes, --video-max-process-bytes)
        count before any frame is decoded."""
        return self.frames * self.height * self.width * 3


def plan_video(header: VideoHeader, params: VideoParams) -> VideoPlan:
    """The sampling, size and tokens of a video from its header. VideoError for one transformers' processor
    refuses (fewer frames than a temporal patch, an aspect ratio over 200)."""
    indices = sample_indices(header.frames, header.fps, params)
    if len(indices) < params.temporal_patch_size:
        raise VideoError(f"the video has {header.frames} frame(s); Qwen3-VL needs at least "
                           f"{params.temporal_patch_size}: send a longer one, or send the frame as an image", code="corrupt_video")
    ratio = max(header.width, header.height) / min(header.width, header.height)
    if ratio > 200:
        raise VideoError(f"video frames are {header.width}x{header.height}, an aspect ratio of {ratio:.0f}; "
                            "the limit is 200", code="video_too_large")
    h, w = clip_size(len(indices), header.height, header.width, params)
    grid = video_grid(len(indices), h, w, params)
    return VideoPlan(tuple(indices), h, w, grid, grid[0] * grid[1] * grid[2] // params.merge_size**2,
                     grid[0] * params.temporal_patch_size)


@dataclass(frozen=True)
class PreparedVideo:
    """One decoded, resized video (or a run of its temporal groups, for a step): what crosses from a decode
    worker to the batcher, as PreparedImage does for an image."""

    # [2 * grid_t, h, w, 3] uint8, C-contiguous: the sampled frames resized, an odd count padded with the last
    frames: np.ndarray
    grid_thw: tuple[int, int, int]  # (temporal groups, h / patch, w / patch)
    num_patches: int  # t*h*w: rows of pixel_values_videos
    num_tokens: int  # num_patches // merge**2
    indices: tuple[int, ...]  # the source frames sampled (unpadded)
    fps: float  # the source's average frame rate
    timestamps: tuple[float, ...]  # seconds of each temporal group

    def groups(self, start: int, stop: int) -> PreparedVideo:
        """Temporal groups [start, stop) as a video of their own (a step's share of a long video: groups
        never attend to each other and repeat their positions, so tower.video_groups's rows are theirs)."""
        t, h, w = self.grid_thw
        assert 0 <= start < stop <= t, f"groups [{start}, {stop}) of {t}: this is a bug"
        per = len(self.frames) // t
        return PreparedVideo(self.frames[start * per : stop * per], (stop - start, h, w), (stop - start) * h * w,
                             (stop - start) * (self.num_tokens // t), self.indices, self.fps,
                             self.timestamps[start:stop])


def prepare_video(data: bytes, header: VideoHeader, params: VideoParams, limits: VideoLimits,
                  out=None, progress=None) -> PreparedVideo:
    """Decode the sampled frames and resize each as it is decoded (the decode worker's whole job for a video):
    uint8 frames, padded to whole temporal patches. Besides the resized clip it holds one frame at full size
    (and FFmpeg's own frames), never the sampled frames all at once: 100 sampled 4K frames are 2.5 GB.
    `out(nbytes)`, if given, returns a writable uint8 buffer of that size for the frames (an arena cell),
    asked for before the first frame is decoded; the result's frames are then a view of it. `progress()` is
    called for every frame decoded (video.sampled_frames)."""
    plan = plan_video(header, params)
    shape = (plan.frames, plan.height, plan.width, 3)
    target = np.empty(shape, np.uint8) if out is None else np.frombuffer(out(plan.nbytes), np.uint8).reshape(shape)
    n = len(plan.indices)
    for k, frame in enumerate(sampled_frames(data, header, list(plan.indices), limits, progress)):
        target[k] = resize_frames(frame[None], plan.height, plan.width)[0]
    target[n:] = target[n - 1]  # patchify_video's padding: the last frame repeated
    t, gh, gw = plan.grid_thw
    return PreparedVideo(target, plan.grid_thw, t * gh * gw, plan.tokens, plan.indices, header.fps,
                         tuple(timestamps(list(plan.indices), header.fps, params.temporal_patch_size)))
