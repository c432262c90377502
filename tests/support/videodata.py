"""Real video files for tests, made here with PyAV from scikit-image's photographs: a camera pan across
the photo (each frame a window one step further along it), encoded with a real codec into a real
container. `frame_window(i)` is what frame i shows, for comparing a decode with its source.
"""

from __future__ import annotations

import functools
import io
import os
from fractions import Fraction

import numpy as np
from PIL import Image

from tests.support import imagedata as data


def source(name: str = "astronaut.png", side: int = 512) -> np.ndarray:
    img = Image.open(io.BytesIO(data.photo(name))).convert("RGB")
    img.thumbnail((side, side), Image.Resampling.LANCZOS)
    return np.asarray(img)


def frame_window(photo: np.ndarray, i: int, width: int, height: int, frames: int) -> np.ndarray:
    """Frame i of `frames` of the pan: a width x height window moving left to right (then down) across."""
    h, w = photo.shape[:2]
    x = (w - width) * i // max(1, frames - 1)
    y = (h - height) * i // max(1, frames - 1)
    return np.ascontiguousarray(photo[y : y + height, x : x + width])


@functools.cache
def clip(codec: str = "libx264", container: str = "mp4", *, frames: int = 24, fps: int = 8, width: int = 160,
         height: int = 120, photo: str = "astronaut.png", pts_gap_s: float = 0.0, rotation: int | None = None) -> bytes:
    """A pan over `photo` as a `codec` video in a `container` file. `pts_gap_s`: the last frame that
    much later (a header that claims a long video with few frames in it). `rotation`: a display matrix
    that turns the picture that many degrees counterclockwise, as a phone held upright writes one (the
    frames themselves stay as encoded)."""
    import av

    src = source(photo)
    buf = io.BytesIO()
    # NOTE: SVT-AV1's encoder (libsvtav1), run as root, puts the calling thread under SCHED_FIFO, priority 99:
    # the test process, and every server a later test started (they inherit it), then outranked everything
    # else, and two of them busy on a 2-core CI machine starved the run, its watchdog included, until CI's own
    # limit. The policy is put back as it was (tests/support/watchdog.py fails a test that leaves it changed).
    policy, priority = os.sched_getscheduler(0), os.sched_getparam(0).sched_priority
    try:
        with av.open(buf, mode="w", format=container) as out:
            stream = out.add_stream(codec, rate=fps)
            stream.width, stream.height = width, height
            stream.pix_fmt = "yuv444p" if codec == "ffv1" else "yuv420p"
            stream.time_base = Fraction(1, fps)
            if codec == "libx264":
                stream.options = {"preset": "ultrafast", "crf": "18"}
            if rotation is not None:
                stream.set_display_rotation(rotation)
            for i in range(frames):
                frame = av.VideoFrame.from_ndarray(frame_window(src, i, width, height, frames), format="rgb24")
                frame.pts = i + (int(pts_gap_s * fps) if pts_gap_s and i == frames - 1 else 0)
                out.mux(stream.encode(frame))
            out.mux(stream.encode(None))
    finally:
        if os.sched_getscheduler(0) != policy:
            os.sched_setscheduler(0, policy, os.sched_param(priority))
    return buf.getvalue()


@functools.cache
def audio_only() -> bytes:
    """One second of a 440 Hz tone as Opus in WebM: a container with no video stream."""
    import av

    buf = io.BytesIO()
    with av.open(buf, mode="w", format="webm") as out:
        stream = out.add_stream("libopus", rate=48000)
        t = np.arange(48000) / 48000
        samples = (0.2 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)[None, :]
        for start in range(0, 48000, 960):
            frame = av.AudioFrame.from_ndarray(samples[:, start : start + 960], format="flt", layout="mono")
            frame.sample_rate, frame.pts = 48000, start
            out.mux(stream.encode(frame))
        out.mux(stream.encode(None))
    return buf.getvalue()


@functools.cache
def still_clip(width: int = 3840, height: int = 2160, frames: int = 100, fps: int = 1) -> bytes:
    """A nearly still picture (a grey ramp, a small block moving down its left edge) as H.264 in MP4: a few
    hundred bytes a frame, whatever the frame size, so a small file that decodes into big frames (4K x 100
    frames: about 66 KB, 2.5 GB of RGB frames). At 1 fps every frame is one the processor samples (2 fps)."""
    import av

    buf = io.BytesIO()
    yuv = np.full((height * 3 // 2, width), 128, np.uint8)  # yuv420p planes: no RGB conversion per frame
    yuv[:height] = np.linspace(16, 235, width).astype(np.uint8)[None, :]
    with av.open(buf, mode="w", format="mp4") as out:
        stream = out.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.time_base = Fraction(1, fps)
        stream.options = {"preset": "ultrafast", "crf": "30"}
        for i in range(frames):
            y = (i * 16) % (height - 16)
            yuv[y : y + 16, :64] = 255 - i % 200
            frame = av.VideoFrame.from_ndarray(yuv, format="yuv420p")
            frame.pts = i
            out.mux(stream.encode(frame))
        out.mux(stream.encode(None))
    return buf.getvalue()


@functools.cache
def two_streams(first: int = 24, second: int = 48, fps: int = 8) -> bytes:
    """MPEG-4 Part 2 in Matroska with two video streams: a 160x120 pan of `first` frames, then a 320x240 one
    of `second` frames (the container's duration is the longer stream's)."""
    import av

    src = source()
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="matroska") as out:
        streams = []
        for w, h in ((160, 120), (320, 240)):
            s = out.add_stream("mpeg4", rate=fps)
            s.width, s.height, s.pix_fmt = w, h, "yuv420p"
            streams.append(s)
        for i in range(max(first, second)):
            for s, n in zip(streams, (first, second)):
                if i < n:
                    frame = av.VideoFrame.from_ndarray(frame_window(src, i, s.width, s.height, n), format="rgb24")
                    frame.pts = i
                    out.mux(s.encode(frame))
        for s in streams:
            out.mux(s.encode(None))
    return buf.getvalue()


def size_change(sizes: tuple[tuple[int, int], ...], fps: int = 8) -> bytes:
    """H.264 in MPEG-TS whose frame size changes mid-stream: frame i is sizes[i] (width, height), each run of
    one size encoded on its own (a keyframe with its own parameter sets, as a spliced broadcast has). The
    header tells the first frame's size."""
    import av

    src = source()
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mpegts") as out:
        stream = out.add_stream("libx264", rate=fps)
        stream.width, stream.height = sizes[0]
        stream.pix_fmt = "yuv420p"
        i = 0
        while i < len(sizes):
            w, h = sizes[i]
            enc = av.CodecContext.create("libx264", "w")
            enc.width, enc.height, enc.pix_fmt = w, h, "yuv420p"
            enc.time_base, enc.framerate = Fraction(1, fps), Fraction(fps)
            enc.options = {"preset": "ultrafast", "crf": "18", "bframes": "0"}
            while i < len(sizes) and sizes[i] == (w, h):
                frame = av.VideoFrame.from_ndarray(frame_window(src, i, w, h, len(sizes)), format="rgb24")
                frame.pts = i
                for packet in enc.encode(frame):
                    packet.stream = stream
                    out.mux(packet)
                i += 1
            for packet in enc.encode(None):
                packet.stream = stream
                out.mux(packet)
    return buf.getvalue()
