"""Video decoding (service/media/video.py) on real video files: pans across scikit-image photographs
encoded here with PyAV as H.264 in MP4, VP9 in WebM and MPEG-4 Part 2 in AVI (tests/support/videodata.py).
The header is read and checked before any frame is decoded; only the sampled frames are kept, and
they are the frames a full decode gives; every hostile file is its own clear 4xx. Sampling, the clip
size (the per-frame cap too) and the prompt's timestamps equal transformers' own functions; the whole
path, decode to pixel_values_videos, equals transformers' Qwen3VLVideoProcessor on the fixture that
tests/support/fixtures/make_video_reference.py makes where torchvision is (fixtures/video_reference.json).
"""

from __future__ import annotations

import hashlib
import importlib
import io
import json
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from service.errors import http_status, VideoError
from service.media.params import VideoLimits, VideoParams
from service.media.video import clip_size, decode_frames, read_header, sample_indices, timestamps, video_size
from service.media.video_preprocess import patchify_video, resize_frames, video_grid, video_lut
from tests.support import imagedata as data, videodata as vd
from tests.support.errors import raises_code

av = pytest.importorskip("av", reason="PyAV is the video decoder (a base dependency)")

CLIPS = [("libx264", "mp4", "h264"), ("libvpx-vp9", "webm", "vp9"), ("mpeg4", "avi", "mpeg4")]


def test_sampling_is_transformers_fps_sampling():
    s = VideoParams()  # fps 2, min 4, max 768
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
    idx = sample_indices(header.frames, header.fps, VideoParams())
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
    (b"", "not_a_video", "empty"),
    (b"\x00\x01garbage" * 500, "not_a_video", "not a video container"),
    (data.photo("rocket.jpg"), "not_a_video", "a still image"),
])
def test_what_is_not_a_video_says_so(blob, error, words):
    with pytest.raises(VideoError) as e:
        read_header(blob, VideoLimits())
    assert e.value.code == error and words in e.value.message and http_status(e.value) == 422, e.value


def test_an_audio_file_has_no_video_stream():
    with raises_code(VideoError, "not_a_video", match="no video stream \\(only audio\\)"):
        read_header(vd.audio_only(), VideoLimits())


def test_an_unsupported_codec_is_415_and_names_the_supported_ones():
    with raises_code(VideoError, "unsupported_codec", match="'ffv1' is not supported; use one of av1, h264") as e:
        read_header(vd.clip("ffv1", "matroska"), VideoLimits())
    assert http_status(e.value) == 415


def test_a_two_hour_header_and_an_8k_frame_are_refused_before_decoding():
    # Two frames, two hours apart: the header says 2 h; refused by it alone (413).
    with raises_code(VideoError, "video_too_long", match=r"video is 7\d{3}\.\d s long; the limit is 1200 s") as e:
        read_header(vd.clip(frames=2, pts_gap_s=7200), VideoLimits())
    assert http_status(e.value) == 413
    eight_k = vd.clip("mpeg4", "avi", frames=2, width=7680, height=4320)
    with raises_code(VideoError, "video_too_large", match="7680x4320 .* the limit is 8294400 pixels a frame"):
        read_header(eight_k, VideoLimits())
    with raises_code(VideoError, "video_too_large", match="bytes; the limit is 1000"):
        read_header(vd.clip(), VideoLimits(max_bytes=1000))
    with raises_code(VideoError, "video_too_long", match="24 frames; the limit is 10"):
        read_header(vd.clip(), VideoLimits(max_frames=10))


def test_a_truncated_file_and_a_decode_past_its_deadline_are_clear_errors():
    blob = vd.clip("mpeg4", "avi")
    header = read_header(blob, VideoLimits())
    cut = blob[: len(blob) // 2]  # (AVI's index is at the end: the header still reads as whole)
    with pytest.raises(VideoError) as e:
        decode_frames(cut, header, sample_indices(header.frames, header.fps, VideoParams()), VideoLimits())
    assert e.value.code in ("truncated_video", "corrupt_video", "not_a_video") and http_status(e.value) == 422 and ("ends after" in e.value.message or "cannot" in e.value.message)
    with raises_code(VideoError, "video_too_long", match="decoding the video took over 0 s"):
        decode_frames(blob, header, [0, 23], VideoLimits(max_decode_s=0))


def _transformers_video_module():
    """transformers' Qwen3-VL video processing module, imported whole (its class attribute goes through
    transformers' lazy loader, which refuses it without torchvision; the module's functions need none)."""
    return importlib.import_module("transformers.models.qwen3_vl.video_processing_qwen3_vl")


@pytest.mark.parametrize("sampling", [VideoParams(), VideoParams(fps=1.0, min_frames=2, max_frames=32),
                                      VideoParams(fps=4.0, min_frames=8, max_frames=64)])
def test_sampling_equals_transformers_sample_frames(sampling):
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


def test_without_sampling_every_frame_is_used():
    assert sample_indices(7, 30.0, VideoParams(do_sample_frames=False)) == list(range(7))


def test_video_params_from_a_written_video_preprocessor_config(tmp_path):
    path = tmp_path / "video_preprocessor_config.json"
    path.write_text(json.dumps({
        "size": {"shortest_edge": 4096, "longest_edge": 25165824}, "fps": 1, "min_frames": 2, "max_frames": 64,
        "patch_size": 14, "merge_size": 2, "temporal_patch_size": 2, "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": 0.25, "rescale_factor": 0.00392156862745098, "resample": 3, "do_sample_frames": False,
        "cap_pixels_per_frame": True, "max_video_tokens": 256, "do_resize": True, "do_convert_rgb": True,
        "video_processor_type": "Qwen3VLVideoProcessor", "processor_class": "Qwen3VLProcessor"}))
    p = VideoParams.from_config(json.loads(path.read_text()))
    assert (p.min_pixels, p.max_pixels, p.fps, p.min_frames, p.max_frames) == (4096, 25165824, 1.0, 2, 64)
    assert (p.patch_size, p.factor, p.patch_dim) == (14, 28, 3 * 2 * 14 * 14)
    assert p.image_mean == (0.48145466, 0.4578275, 0.40821073) and p.image_std == (0.25, 0.25, 0.25)
    assert (p.rescale_factor, p.resample, p.do_sample_frames) == (1 / 255, 3, False)
    assert (p.cap_pixels_per_frame, p.max_video_tokens) == (True, 256)
    # Absent keys, and transformers' None for the cap: Qwen3VLVideoProcessor's class defaults.
    assert VideoParams.from_config({}) == VideoParams() == VideoParams.from_config({"cap_pixels_per_frame": None})
    d = VideoParams()
    assert (d.min_pixels, d.max_pixels, d.fps, d.min_frames, d.max_frames) == (131072, 786432, 2.0, 4, 768)
    assert (d.cap_pixels_per_frame, d.max_video_tokens, d.do_sample_frames) == (False, 768, True)


@pytest.mark.parametrize("raw,words", [
    ({"size": {"longest_edge": 1000}}, "size must have shortest_edge and longest_edge"),
    ({"size": {"height": 224, "width": 224}}, "size must have shortest_edge and longest_edge"),
    ({"do_normalize": False}, "do_normalize is false"),
    ({"resample": 2}, "resample 2 is not bicubic"),
    ({"num_frames": 16}, "num_frames is set"),
    ({"fps": 0}, "fps must be a positive number"),
    ({"image_mean": [0.5, 0.5]}, "image_mean needs 3 values"),
])
def test_a_video_config_this_pipeline_does_not_reproduce_is_refused_by_name(raw, words):
    with pytest.raises(ValueError, match=words):
        VideoParams.from_config(raw)


def test_the_clip_size_and_its_per_frame_cap_equal_transformers_resize(monkeypatch):
    """Qwen3VLVideoProcessor.resize itself computes the size (cap included), then hands it to the backend's
    resize, which here hands it back (no torchvision)."""
    from transformers.image_processing_backends import TorchvisionBackend
    from transformers.image_utils import SizeDict

    monkeypatch.setattr(TorchvisionBackend, "resize", lambda self, image, size, resample=None, **kw: (size.height, size.width))
    cls = _transformers_video_module().Qwen3VLVideoProcessor
    rng = np.random.default_rng(1)
    shapes = [(9, 120, 160), (7, 150, 200), (4, 128, 96), (2, 1080, 1920), (768, 720, 1280), (5, 33, 1000), (3, 20, 40)]
    shapes += [(int(t), int(h), int(w)) for t, h, w in zip(rng.integers(2, 300, 30), rng.integers(16, 2200, 30),
                                                            rng.integers(16, 4000, 30))]
    for params in [VideoParams(), VideoParams(cap_pixels_per_frame=True),
                   VideoParams(cap_pixels_per_frame=True, max_video_tokens=8, min_pixels=4096, max_pixels=131072),
                   VideoParams(cap_pixels_per_frame=True, max_video_tokens=256, min_pixels=65536, max_pixels=25165824),
                   VideoParams(cap_pixels_per_frame=True, patch_size=14, min_pixels=4096, max_pixels=16384 * 28 * 28)]:
        proc = object.__new__(cls)  # (its __init__ wants torchvision; resize reads max_video_tokens only)
        proc.max_video_tokens = params.max_video_tokens
        for t, h, w in shapes:
            if max(h, w) / min(h, w) > 200:
                continue
            theirs = cls.resize(proc, types.SimpleNamespace(shape=(1, t, 3, h, w)),
                                size=SizeDict(shortest_edge=params.min_pixels, longest_edge=params.max_pixels),
                                resample=3, factor=params.factor, temporal_factor=params.temporal_patch_size,
                                cap_pixels_per_frame=params.cap_pixels_per_frame)
            assert clip_size(t, h, w, params) == theirs, (params, t, h, w)
    # The cap's formula, by hand: 9 frames, 8 tokens of 32x32 a frame, above 1.05 x 4096: 8192 pixels a frame.
    capped = VideoParams(cap_pixels_per_frame=True, max_video_tokens=8, min_pixels=4096, max_pixels=131072)
    assert clip_size(9, 120, 160, capped) == video_size(9, 120, 160, factor=32, min_pixels=4096, max_pixels=9 * 8192)


def test_timestamps_equal_transformers_calculate_timestamps():
    processor = importlib.import_module("transformers.models.qwen3_vl.processing_qwen3_vl").Qwen3VLProcessor
    for total, fps in [(24, 8.0), (31, 12.0), (30, 25.0), (901, 29.97), (61, 25.0), (5, 30.0), (1000, 59.94)]:
        for t in (2, 3):
            idx = sample_indices(total, fps, VideoParams(fps=3.0))
            theirs = processor._calculate_timestamps(None, list(idx), fps, t)
            mine = timestamps(idx, fps, t)
            assert mine == theirs and len(mine) == -(-len(idx) // t), (total, fps, t)
    idx = [0, 5, 9]
    assert timestamps(idx, 8.0, 2) == [0.3125, 1.125] and idx == [0, 5, 9]  # the caller's list left alone


# The whole path against transformers' processor: fixtures/make_video_reference.py runs it (with torchvision)
# on the frames fixtures/make_video_frames.py decodes from these clips, and writes what it made.
FIXTURE = Path(__file__).parents[2] / "support" / "fixtures" / "video_reference.json"
_FIXTURE = json.loads(FIXTURE.read_text()) if FIXTURE.exists() else None


@pytest.mark.parametrize("case", _FIXTURE["cases"] if _FIXTURE else [None],
                         ids=lambda c: f"{c['clip']}-{c['config']}" if c else "no-fixture")
def test_the_whole_path_equals_transformers_video_processor(case):
    if case is None:
        pytest.skip(f"{FIXTURE.relative_to(Path(__file__).parents[3])} is not there yet: it is made where transformers "
                    "has torchvision (tests/support/fixtures/make_video_frames.py, then make_video_reference.py)")
    ref = case["reference"]
    assert ref is not None, f"{FIXTURE} is a draft (made with --ours-only, no transformers): make it with the reference"
    blob = vd.clip(**case["source"])
    header = read_header(blob, VideoLimits())
    assert (header.fps, header.frames) == (case["video_fps"], case["total_frames"])
    frames = decode_frames(blob, header, list(range(header.frames)), VideoLimits())
    assert hashlib.sha256(frames.tobytes()).hexdigest() == case["frames_sha256"], (
        "our decode of this clip is not the frames the reference was made from (another FFmpeg or encoder?): "
        "what follows would compare different inputs")
    params = VideoParams.from_config(_FIXTURE["configs"][case["config"]])
    idx = sample_indices(header.frames, header.fps, params)
    assert idx == ref["frames_indices"]
    h, w = clip_size(len(idx), header.height, header.width, params)
    resized = resize_frames(frames[idx], h, w)
    assert list(resized.shape) == ref["resized_shape"]
    assert hashlib.sha256(resized.tobytes()).hexdigest() == ref["resized_sha256"]
    pixels = patchify_video(torch.from_numpy(resized), torch.from_numpy(video_lut(params)), params).numpy()
    assert list(video_grid(len(idx), h, w, params)) == ref["video_grid_thw"]
    assert list(pixels.shape) == ref["pixel_values_shape"]
    assert pixels.reshape(-1)[:8].tolist() == ref["first8"] and pixels.reshape(-1)[-8:].tolist() == ref["last8"]
    assert hashlib.sha256(pixels.tobytes()).hexdigest() == ref["pixel_values_sha256"]
    assert timestamps(idx, header.fps, params.temporal_patch_size) == ref["timestamps"]


def test_an_av1_clip_is_read_by_its_codec_not_its_decoders_name():
    # PyAV's AV1 decoder is named 'libdav1d'; the header must say 'av1' (the bug: AV1 refused as unsupported).
    import av

    if "libsvtav1" not in av.codecs_available and "libaom-av1" not in av.codecs_available:
        pytest.skip("this PyAV build has no AV1 encoder (libsvtav1 / libaom-av1) to make the clip with")
    blob = vd.clip("libsvtav1" if "libsvtav1" in av.codecs_available else "libaom-av1", "mp4")
    header = read_header(blob, VideoLimits())
    assert (header.codec, header.width, header.height, header.frames) == ("av1", 160, 120, 24)
    frames = decode_frames(blob, header, sample_indices(header.frames, header.fps, VideoParams()), VideoLimits())
    assert frames.shape == (6, 120, 160, 3)
