"""VideoLimits: the video limits of Settings (config.py derives them), in a module of the standard library
alone, because media/video.py takes them and must import without pydantic
(tests/media/fixtures/make_video_reference.py runs it where only numpy, torch and transformers are installed)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class VideoLimits:
    """Checked from a video's header before any frame is decoded (media/video.read_header), except the
    decode deadline."""

    max_bytes: int = 256 * 1024**2  # the encoded file
    max_duration_s: float = 20 * 60.0  # by the header, before anything is decoded
    max_frames: int = 60 * 60 * 30  # frames in the stream (what a decode walks through), by the header
    max_frame_pixels: int = 3840 * 2160  # one frame's width x height (4K)
    max_decode_s: float = 60.0  # wall time of one video's decode
