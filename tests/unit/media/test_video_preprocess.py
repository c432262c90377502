"""Video pixels (service/media/video_preprocess.py) against transformers' Qwen3VLVideoProcessor, piece by piece,
on real decoded frames (tests/support/videodata.py). torchvision does not import here, so its two functions on the
path, resize_image and normalize_image (torchvision 0.26, transforms/v2/functional), are written out as
they are; transformers' own pieces (the fused mean and std, patchify) are called. Tolerance 0 throughout.
tests/unit/media/test_video.py compares the whole path with the processor itself (a fixture made with torchvision).
"""

from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from service.media.params import PreprocessParams, VideoLimits, VideoParams
from service.media.preprocess import normalize_lut
from service.media.video import decode_frames, read_header
from service.media.video_preprocess import patchify_video, resize_frames, video_grid, video_lut
from tests.support import videodata as vd

pytest.importorskip("av", reason="PyAV decodes the test clips (a base dependency)")

CLIP_NORM = VideoParams(image_mean=(0.48145466, 0.4578275, 0.40821073), image_std=(0.26862954, 0.26130258, 0.27577711))


def _frames(codec="libx264", container="mp4", **kw) -> np.ndarray:
    blob = vd.clip(codec, container, **kw)
    header = read_header(blob, VideoLimits())
    return decode_frames(blob, header, list(range(header.frames)), VideoLimits())


def _fused_mean_std(params: VideoParams) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' own fusion (TorchvisionBackend._fuse_mean_std_and_rescale_factor; no torchvision in it)."""
    backend = importlib.import_module("transformers.image_processing_backends").TorchvisionBackend
    mean, std, do_rescale = backend._fuse_mean_std_and_rescale_factor(
        None, do_normalize=True, image_mean=params.image_mean, image_std=params.image_std, do_rescale=True,
        rescale_factor=params.rescale_factor)
    assert do_rescale is False  # fused: the rescale is inside mean and std
    return mean, std


def _tv_normalize(image: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """torchvision's normalize_image on a float32 [..., C, H, W] image (not in place: a copy is made)."""
    mean = torch.as_tensor(mean, dtype=image.dtype).view(-1, 1, 1)
    std = torch.as_tensor(std, dtype=image.dtype).view(-1, 1, 1)
    return image.sub(mean).div_(std)


def _tv_resize_cpu(frames: np.ndarray, height: int, width: int) -> np.ndarray:
    """torchvision's resize_image as the processor calls it on CPU uint8 frames, bicubic, antialias: what
    _prepare_input_videos hands it (NCHW, contiguous), uint8 kept (native on the CPU for bicubic)."""
    x = torch.from_numpy(frames).permute(0, 3, 1, 2).contiguous()
    if (height, width) == tuple(x.shape[-2:]):
        return frames
    y = F.interpolate(x, size=[height, width], mode="bicubic", align_corners=False, antialias=True)
    return y.permute(0, 2, 3, 1).contiguous().numpy()


@pytest.mark.parametrize("params", [VideoParams(), CLIP_NORM, VideoParams(rescale_factor=1 / 127.5)],
                         ids=["qwen3vl", "clip-mean-std", "rescale-1/127.5"])
def test_the_lut_is_the_fused_rescale_normalize_in_float32(params):
    mean, std = _fused_mean_std(params)
    levels = torch.arange(256, dtype=torch.float32).expand(3, 1, 256)  # an image [C, 1, 256] of every level
    expected = _tv_normalize(levels, mean, std).reshape(3, 256)
    lut = video_lut(params)
    assert lut.dtype == np.float32 and lut.shape == (3, 256) and lut.flags.c_contiguous
    assert torch.equal(torch.from_numpy(lut), expected)


def test_the_video_lut_is_not_the_image_lut():
    # Images: (float32(x * (1/255)) - 0.5) / 0.5; videos: (x - 127.5) / 127.5. Half the levels round apart.
    image, video = normalize_lut(PreprocessParams()), video_lut(VideoParams())
    assert 0 < (image != video).sum() and np.abs(image - video).max() < 1e-6


def test_a_clip_at_its_size_is_not_resampled():
    frames = _frames()
    assert resize_frames(frames, 120, 160) is frames  # torchvision returns its input when the size is the same


@pytest.mark.parametrize("size", [(96, 128), (192, 256), (64, 96), (32, 32), (128, 64)])
def test_resize_is_torchvisions_uint8_bicubic_on_the_cpu(size):
    frames = _frames()[::5]  # 5 real frames of 120x160
    ours = resize_frames(frames, *size)
    assert ours.shape == (5, *size, 3) and ours.dtype == np.uint8 and ours.flags.c_contiguous
    # (channels-last memory in, as ours goes, or contiguous NCHW, as torchvision's: the same bytes)
    assert np.array_equal(ours, _tv_resize_cpu(frames, *size))
    # Not the float path torchvision takes on CUDA (float32, clamp, round): a real difference, a level or a few.
    x = torch.from_numpy(frames).permute(0, 3, 1, 2).float()
    y = F.interpolate(x, size=list(size), mode="bicubic", align_corners=False, antialias=True).clamp_(0, 255).round_()
    gap = np.abs(y.to(torch.uint8).permute(0, 2, 3, 1).numpy().astype(int) - ours.astype(int))
    assert 0.02 < (gap > 0).mean() < 0.5 and gap.max() <= 8, ((gap > 0).mean(), gap.max())


def test_resize_of_a_portrait_clip_and_a_non_uniform_scale():
    frames = _frames("libvpx-vp9", "webm", width=200, height=150, fps=12, frames=31)[::6]
    for size in [(96, 128), (160, 192), (224, 160)]:
        assert np.array_equal(resize_frames(frames, *size), _tv_resize_cpu(frames, *size)), size


@pytest.mark.parametrize("n", [4, 5, 1])
@pytest.mark.parametrize("params", [VideoParams(), CLIP_NORM], ids=["qwen3vl", "clip-mean-std"])
def test_patchify_video_equals_transformers_patchify_of_the_normalized_frames(n, params):
    frames = resize_frames(_frames()[:n], 96, 128)  # [n, 96, 128, 3]
    mean, std = _fused_mean_std(params)
    videos = _tv_normalize(torch.from_numpy(frames).permute(0, 3, 1, 2).contiguous()[None].to(torch.float32), mean, std)
    cls = importlib.import_module("transformers.models.qwen3_vl.video_processing_qwen3_vl").Qwen3VLVideoProcessor
    patches, *grid = cls.patchify(None, videos, patch_size=16, merge_size=2, temporal_patch_size=2)
    ours = patchify_video(torch.from_numpy(frames), torch.from_numpy(video_lut(params)), params)
    assert ours.dtype == torch.float32 and ours.is_contiguous()
    assert torch.equal(ours, patches[0])
    assert video_grid(n, 96, 128, params) == tuple(grid) == ((n + 1) // 2, 6, 8)


def test_patchify_video_columns_are_c_t_py_px_and_an_odd_clip_repeats_its_last_frame():
    p = VideoParams()
    frames = torch.empty((3, 32, 64, 3), dtype=torch.uint8)
    for i in range(3):
        for c in range(3):
            frames[i, :, :, c] = 40 * i + c  # every value names its frame and channel
    identity = torch.arange(256, dtype=torch.float32).expand(3, 256).contiguous()  # lut[c, v] = v
    rows = patchify_video(frames, identity, p).view(2 * 2 * 4, 3, 2, 256)  # [rows, c, t, py*px]
    assert rows.shape[0] == 16  # grid (2, 2, 4): 2 temporal groups of 2 x 4 patches
    for r in range(16):
        g = r // 8  # rows run over the temporal groups first
        for c in range(3):
            t0, t1 = 2 * g, min(2 * g + 1, 2)  # group 1 is frame 2, then frame 2 again (the padding)
            assert (rows[r, c, 0] == 40 * t0 + c).all() and (rows[r, c, 1] == 40 * t1 + c).all(), (r, c)


def test_patchify_video_writes_into_out_and_refuses_bad_input_as_bugs():
    p = VideoParams()
    frames = torch.from_numpy(resize_frames(_frames()[:2], 64, 64))
    lut = torch.from_numpy(video_lut(p))
    out = torch.full((16, 1536), float("nan"))
    assert patchify_video(frames, lut, p, out=out) is out and torch.equal(out, patchify_video(frames, lut, p))
    with pytest.raises(AssertionError, match="not a multiple of 32"):
        patchify_video(torch.zeros((2, 48, 64, 3), dtype=torch.uint8), lut, p)
    with pytest.raises(AssertionError, match="uint8"):
        patchify_video(frames.float(), lut, p)
    with pytest.raises(AssertionError, match="out must be a contiguous"):
        patchify_video(frames, lut, p, out=torch.empty((16, 768)))
