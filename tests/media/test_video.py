"""Video decoding (service/media/video.py) on real video files: pans across scikit-image photographs
encoded here with PyAV as H.264 in MP4, VP9 in WebM and MPEG-4 Part 2 in AVI (tests/videodata.py).
The header is read and checked before any frame is decoded; only the sampled frames are kept, and
they are the frames a full decode gives; every hostile file is its own clear 4xx."""

from __future__ import annotations

import io

import numpy as np
import pytest

from service.errors import (CorruptVideo, NotAVideo, TruncatedVideo, UnsupportedCodec, VideoError, VideoTooLarge,
                            VideoTooLong, http_status)
from service.media.video import VideoLimits, VideoSampling, decode_frames, read_header, sample_indices, video_size
from tests import imagedata as data
from tests import videodata as vd

av = pytest.importorskip("av", reason="PyAV is the video decoder (the `video` extra)")

CLIPS = [("libx264", "mp4", "h264"), ("libvpx-vp9", "webm", "vp9"), ("mpeg4", "avi", "mpeg4")]


def test_sampling_is_transformers_fps_sampling():
    s = VideoSampling()  # fps 2, min 4, max 768
    # The issue's worked example (transformers' sample_frames): 24 frames at 8 fps.
    assert sample_indices(24, 8.0, s) == [0, 5, 9, 14, 18, 23]
    # int(5 / 30 * 2) = 0 frames by fps: min_frames 4, spread over 0..4 (linspace 0, 1.33, 2.67, 4, rounded)
    assert sample_indices(5, 30.0, s) == [0, 1, 3, 4]
    assert sample_indices(2, 30.0, s) == [0, 1]  # never more frames than the video has
    ten_s = sample_indices(300, 30.0, s)  # 10 s at 2 fps
    assert len(ten_s) == 20 and ten_s[:3] == [0, 16, 31] and ten_s[-1] == 299
    long = sample_indices(30 * 60 * 30, 30.0, s)  # 30 min: 3600 by fps, capped at max_frames
    assert len(long) == 768 and long[0] == 0 and long[-1] == 30 * 60 * 30 - 1


def test_the_clip_size_bounds_the_whole_clips_pixels():
    # 16 frames of 480x640, patch 16 x merge 2: 32-multiples, the clip within [min, max] pixels.
    h, w = video_size(16, 480, 640, factor=32, min_pixels=128 * 32 * 32, max_pixels=32 * 32 * 768)
    # 16 x 480 x 640 is over max: beta = sqrt(16 * 480 * 640 / 786432) = 2.5, floor(192 / 32), floor(256 / 32)
    assert (h, w) == (192, 256) and 16 * h * w <= 32 * 32 * 768
    assert video_size(4, 64, 64, factor=32, min_pixels=128 * 32 * 32, max_pixels=32 * 32 * 768) == (192, 192)
    assert video_size(2, 10, 40, factor=32, min_pixels=32 * 32, max_pixels=32 * 32 * 768) == (32, 128)


@pytest.mark.parametrize("codec,container,name", CLIPS)
def test_the_header_is_read_before_any_frame(codec, container, name):
    header = read_header(vd.clip(codec, container), VideoLimits())
    assert (header.codec, header.width, header.height, header.fps, header.frames) == (name, 160, 120, 8.0, 24)
    assert header.duration_s == pytest.approx(3.0, abs=0.2)


@pytest.mark.parametrize("codec,container,name", CLIPS)
def test_the_sampled_frames_are_a_full_decodes_frames_and_show_the_pan(codec, container, name):
    blob = vd.clip(codec, container)
    header = read_header(blob, VideoLimits())
    idx = sample_indices(header.frames, header.fps, VideoSampling())
    frames = decode_frames(blob, header, idx, VideoLimits())
    assert frames.shape == (6, 120, 160, 3) and frames.dtype == np.uint8
    with av.open(io.BytesIO(blob)) as c:
        every = [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]
    assert len(every) == 24
    for k, i in enumerate(idx):
        assert np.array_equal(frames[k], every[i]), (name, i)
        # A lossy decode of the photo's window at frame i (and not of another frame's window).
        src = vd.frame_window(vd.source(), i, 160, 120, 24).astype(np.int16)
        err = np.abs(frames[k].astype(np.int16) - src).mean()
        other = vd.frame_window(vd.source(), (i + 12) % 24, 160, 120, 24).astype(np.int16)
        assert err < 20 and err < np.abs(frames[k].astype(np.int16) - other).mean() / 2, (name, i, err)


@pytest.mark.parametrize("blob,error,words", [
    (b"", NotAVideo, "empty"),
    (b"\x00\x01garbage" * 500, NotAVideo, "not a video container"),
    (data.photo("rocket.jpg"), NotAVideo, "a still image"),
])
def test_what_is_not_a_video_says_so(blob, error, words):
    with pytest.raises(VideoError) as e:
        read_header(blob, VideoLimits())
    assert isinstance(e.value, error) and words in e.value.message and http_status(e.value) == 422, e.value


def test_an_audio_file_has_no_video_stream():
    with pytest.raises(NotAVideo, match="no video stream \\(only audio\\)"):
        read_header(vd.audio_only(), VideoLimits())


def test_an_unsupported_codec_is_415_and_names_the_supported_ones():
    with pytest.raises(UnsupportedCodec, match="'ffv1' is not supported; use one of av1, h264") as e:
        read_header(vd.clip("ffv1", "matroska"), VideoLimits())
    assert http_status(e.value) == 415


def test_a_two_hour_header_and_an_8k_frame_are_refused_before_decoding():
    # Two frames, two hours apart: the header says 2 h; refused by it alone (413).
    with pytest.raises(VideoTooLong, match=r"video is 7\d{3}\.\d s long; the limit is 1200 s") as e:
        read_header(vd.clip(frames=2, pts_gap_s=7200), VideoLimits())
    assert http_status(e.value) == 413
    eight_k = vd.clip("mpeg4", "avi", frames=2, width=7680, height=4320)
    with pytest.raises(VideoTooLarge, match="7680x4320 .* the limit is 8294400 pixels a frame"):
        read_header(eight_k, VideoLimits())
    with pytest.raises(VideoTooLarge, match="bytes; the limit is 1000"):
        read_header(vd.clip(), VideoLimits(max_bytes=1000))
    with pytest.raises(VideoTooLong, match="24 frames; the limit is 10"):
        read_header(vd.clip(), VideoLimits(max_frames=10))


def test_a_truncated_file_and_a_decode_past_its_deadline_are_clear_errors():
    blob = vd.clip("mpeg4", "avi")
    header = read_header(blob, VideoLimits())
    cut = blob[: len(blob) // 2]  # (AVI's index is at the end: the header still reads as whole)
    with pytest.raises((TruncatedVideo, CorruptVideo, NotAVideo)) as e:
        decode_frames(cut, header, sample_indices(header.frames, header.fps, VideoSampling()), VideoLimits())
    assert http_status(e.value) == 422 and ("ends after" in e.value.message or "cannot" in e.value.message)
    with pytest.raises(VideoTooLong, match="decoding the video took over 0 s"):
        decode_frames(blob, header, [0, 23], VideoLimits(max_decode_s=0))


def _transformers_video_module():
    """transformers' Qwen3-VL video processing module, imported whole (its class attribute goes through
    transformers' lazy loader, which refuses it without torchvision; the module's functions need none)."""
    import importlib

    return importlib.import_module("transformers.models.qwen3_vl.video_processing_qwen3_vl")


@pytest.mark.parametrize("sampling", [VideoSampling(), VideoSampling(fps=1.0, min_frames=2, max_frames=32),
                                      VideoSampling(fps=4.0, min_frames=8, max_frames=64)])
def test_sampling_equals_transformers_sample_frames(sampling):
    import types

    from transformers.video_utils import VideoMetadata

    cls = _transformers_video_module().Qwen3VLVideoProcessor
    self = types.SimpleNamespace(fps=sampling.fps, min_frames=sampling.min_frames, max_frames=sampling.max_frames)
    for total, fps in [(24, 8.0), (5, 30.0), (2, 24.0), (300, 30.0), (901, 29.97), (7200, 24.0), (61, 25.0),
                       (1000, 59.94), (17, 1.0)]:
        theirs = cls.sample_frames(self, VideoMetadata(total_num_frames=total, fps=fps)).tolist()
        assert sample_indices(total, fps, sampling) == theirs, (total, fps)


def test_the_clip_size_equals_transformers_smart_resize():
    smart_resize = _transformers_video_module().smart_resize
    limits = [(128 * 32 * 32, 32 * 32 * 768), (32 * 32, 32 * 32 * 64), (16 * 16 * 4, 16 * 16 * 2 * 1024)]
    rng = np.random.default_rng(0)
    shapes = [(16, 480, 640), (4, 64, 64), (2, 10, 40), (768, 1080, 1920), (30, 2160, 3840), (3, 33, 1000)]
    shapes += [(int(t), int(h), int(w)) for t, h, w in zip(rng.integers(2, 200, 40), rng.integers(8, 2200, 40),
                                                            rng.integers(8, 4000, 40))]
    for factor in (28, 32):
        for lo, hi in limits:
            for t, h, w in shapes:
                if max(h, w) / min(h, w) > 200:
                    continue  # (refused before: the aspect check)
                theirs = smart_resize(t, h, w, temporal_factor=2, factor=factor, min_pixels=lo, max_pixels=hi)
                assert video_size(t, h, w, factor=factor, min_pixels=lo, max_pixels=hi) == tuple(theirs), (t, h, w)
