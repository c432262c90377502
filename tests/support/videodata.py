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
         height: int = 120, photo: str = "astronaut.png", pts_gap_s: float = 0.0) -> bytes:
    """A pan over `photo` as a `codec` video in a `container` file. `pts_gap_s`: the last frame that
    much later (a header that claims a long video with few frames in it)."""
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
