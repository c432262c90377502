"""Video input, the decoding half: a container's header read before any frame is decoded, the
frames Qwen3-VL's video processor samples, and only those decoded and kept.

    read_header(data, limits)            -> VideoHeader   codec, size as displayed, frame rate, frames, duration,
                                                          rotation; every limit that the header can tell is checked here
    sample_indices(frames, fps, params)  -> list[int]     transformers' Qwen3VLVideoProcessor.sample_frames
    sampled_frames(data, header, indices, limits) -> each sampled frame, uint8 [H, W, 3], as it is decoded
    decode_frames(data, header, indices, limits) -> uint8 [n, H, W, 3]: sampled_frames stacked (tests, fixtures)
    clip_size(frames, h, w, params)      -> (h, w)        the size every frame is resized to: transformers'
                                                          video smart_resize (`video_size`: the whole clip's
                                                          pixels bounded, not one frame's), per-frame cap included
    timestamps(indices, fps, temporal)   -> list[float]   the seconds of each temporal patch in Qwen3-VL's prompt

`VideoParams` is a checkpoint's video_preprocessor_config.json (`VideoParams.from_config`; the engine's
loader finds the file). The pixels (resize, normalize, patchify) are media/video_preprocess.py.

PyAV (FFmpeg inside its wheel) decodes on the CPU; nothing here needs torch or torchvision. Every failure
is a VideoError (service/errors.py): a 4xx that says what was wrong, never a hang (a decode deadline) or
a 500. Memory stays bounded: frames are sampled while decoding and handed on one at a time, never all held
(video_preprocess.prepare_video resizes each as it comes).

A display matrix (a phone's portrait video is stored landscape, with a matrix that turns it upright) is
applied to every frame, as vLLM's video loader (OpenCV, which turns frames by the stream's matrix) does:
the grid is the upright picture's, the LM's positions are those vLLM computes. Only quarter turns exist in
OpenCV's loader; another angle is refused.
"""

from __future__ import annotations

import io
import math
import struct
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from service.media.params import VideoLimits, VideoParams
from service.errors import VideoError

if TYPE_CHECKING:
    import numpy as np
# NOTE: numpy is imported where it is used: VideoParams travels in engine/messages.py, which API processes
# import without numpy.

# The decoders PyAV's wheel carries that we accept: what browsers and phones record, and what vLLM's
# video loaders are tested on. Anything else is `unsupported_codec` (415), named.
CODECS = frozenset({"h264", "hevc", "vp8", "vp9", "av1", "mpeg4", "mjpeg"})


@dataclass(frozen=True)
class VideoHeader:
    codec: str
    width: int  # as displayed: the display matrix applied (`rotation`)
    height: int
    fps: float  # the stream's average frame rate
    frames: int  # frames in the stream (the header's count, else its duration x fps)
    duration_s: float
    rotation: int = 0  # degrees counterclockwise the display matrix turns each decoded frame: 0, 90, 180 or 270

    @property
    def coded_size(self) -> tuple[int, int]:
        """(width, height) of the frames as decoded, before the display matrix turns them."""
        return (self.height, self.width) if self.rotation % 180 else (self.width, self.height)


def read_header(data: bytes, limits: VideoLimits) -> VideoHeader:
    """The first video stream's header, checked against `limits` before its frames are decoded (its first
    frame is, for the display matrix that FFmpeg hands out with decoded frames only)."""
    import av  # (PyAV: only the processes that decode video import it)

    if len(data) > limits.max_bytes:
        raise VideoError(f"video is {len(data)} bytes; the limit is {limits.max_bytes}", code="video_too_large")
    if not data:
        raise VideoError("the video is empty (0 bytes)", code="not_a_video")
    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            if container.format.name.endswith("_pipe") or container.format.name == "image2":
                raise VideoError(f"this is a still image ({container.format.name}), not a video: send it as an image", code="not_a_video")
            streams = container.streams.video
            if not streams:
                raise VideoError("the file has no video stream" + (" (only audio)" if container.streams.audio else ""), code="not_a_video")
            s = streams[0]
            if s.codec_context is None:  # (a stream FFmpeg found but could not set up: an mp4 cut inside its index)
                raise _cut_short(data) or VideoError("the video stream's codec cannot be set up", code="corrupt_video")
            # NOTE: the codec's canonical name, not its decoder's: PyAV decodes AV1 with a decoder named
            # 'libdav1d' (and could pick 'libvpx-vp9' for VP9), whose codec is 'av1'.
            codec = s.codec_context.codec.canonical_name
            width, height = s.codec_context.width, s.codec_context.height
            rate = float(s.average_rate or s.guessed_rate or 0)
            duration = _stream_duration(s, container)
            frames = int(s.frames) if s.frames else int(round(duration * rate))
            if codec in CODECS and 0 < width * height <= limits.max_frame_pixels:
                rotation = _rotation(container, s, data)
            else:
                rotation = 0  # (refused below, before any frame is decoded)
    except av.error.InvalidDataError as e:
        raise _cut_short(data) or VideoError(f"not a video container PyAV can open ({e.strerror or e})", code="not_a_video") from None
    except av.error.FFmpegError as e:
        raise _cut_short(data) or VideoError(f"the video's header cannot be read ({e.strerror or e})", code="corrupt_video") from None
    if codec not in CODECS:
        raise VideoError(f"video codec {codec!r} is not supported; use one of {', '.join(sorted(CODECS))}", code="unsupported_codec")
    if width <= 0 or height <= 0 or rate <= 0 or frames <= 0:
        raise VideoError(f"the video's header gives no usable size, frame rate or length "
                           f"({width}x{height}, {rate:g} fps, {frames} frames)", code="corrupt_video")
    if width * height > limits.max_frame_pixels:
        raise VideoError(f"video frames are {width}x{height} ({width * height} pixels); the limit is "
                            f"{limits.max_frame_pixels} pixels a frame", code="video_too_large")
    if duration > limits.max_duration_s:
        raise VideoError(f"video is {duration:.1f} s long; the limit is {limits.max_duration_s:g} s", code="video_too_long")
    if frames > limits.max_frames:
        raise VideoError(f"video has {frames} frames; the limit is {limits.max_frames}", code="video_too_long")
    if rotation % 180:
        width, height = height, width
    return VideoHeader(codec=codec, width=width, height=height, fps=rate, frames=frames, duration_s=duration,
                       rotation=rotation)


def _stream_duration(s, container) -> float:
    """The stream's own length in seconds: its duration, else its DURATION tag (Matroska's muxers write one
    for each track, and the container's duration is its longest track's: a second video stream or a longer
    audio track made the first stream's frames seem more than there are), else the container's."""
    import av

    if s.duration is not None and s.time_base is not None:
        return float(s.duration * s.time_base)
    tag = s.metadata.get("DURATION") or s.metadata.get("duration")
    if tag:
        try:
            h, m, sec = tag.split(":")
            return int(h) * 3600 + int(m) * 60 + float(sec)
        except ValueError:
            pass  # (not HH:MM:SS.fraction: the container's then)
    return float(container.duration) / av.time_base if container.duration else 0.0


def _rotation(container, s, data: bytes) -> int:
    """The quarter turns (degrees counterclockwise, 0-270) of the stream's display matrix, read from its first
    decoded frame: PyAV gives a stream's side data with its frames only. Another angle is a VideoError."""
    import av

    try:
        frame = next(container.decode(s), None)
    except av.error.FFmpegError as e:
        raise _cut_short(data) or VideoError(f"the video's first frame cannot be decoded ({e.strerror or e})",
                                             code="corrupt_video") from None
    if frame is None:
        raise _cut_short(data) or VideoError("no frame of the video decodes", code="corrupt_video")
    degrees = frame.rotation % 360  # (PyAV: counterclockwise, -180..180)
    if degrees % 90:
        raise VideoError(f"the video's display matrix turns it by {degrees} degrees; only quarter turns are "
                         "applied (as vLLM's loader does): re-encode it upright", code="invalid_video")
    return degrees


def _cut_short(data: bytes) -> VideoError | None:
    """`truncated_video` when the container's own sizes say the file goes on past its end: an MP4 or MOV
    (ISO BMFF) whose last top-level box does, an AVI whose RIFF chunk does, a Matroska or WebM file whose
    Segment does. An MP4 cut short has lost its index (the 'moov' box is written last): FFmpeg then refuses it
    as it refuses bytes that are no video, and only these sizes tell the two apart. None otherwise."""
    n = len(data)
    end = None
    if data[4:8] == b"ftyp":
        pos = 0
        while pos + 8 <= n:
            size, kind = struct.unpack(">I4s", data[pos : pos + 8])
            if size == 1 and pos + 16 <= n:
                size = struct.unpack(">Q", data[pos + 8 : pos + 16])[0]
            if size == 0:  # (the box runs to the end of the file, whatever that is)
                return None
            if size < 8 or pos + size > n:
                end = pos + size if size >= 8 else None
                what = f"its {kind.decode('latin-1')!r} box"
                break
            pos += size
        else:
            if pos < n:
                end, what = pos + 8, "a box header"
    elif data[:4] == b"RIFF" and n >= 8:
        end, what = 8 + struct.unpack("<I", data[4:8])[0], "its RIFF chunk"
    elif data[:4] == b"\x1a\x45\xdf\xa3":  # EBML: the header element, then the Segment
        header = _ebml_element(data, 0)
        segment = header and _ebml_element(data, header[1] + header[2])
        if segment and segment[0] == 0x18538067 and segment[2] is not None:
            end, what = segment[1] + segment[2], "its Segment"
    if end is None or end <= n:
        return None
    return VideoError(f"the file is cut short: {what} runs to byte {end}, and the file has {n}; send the whole "
                      "file", code="truncated_video")


def _ebml_element(data: bytes, pos: int) -> tuple[int, int, int | None] | None:
    """An EBML element at `pos`: (its ID, where its data starts, its size: None for 'unknown', as a live
    stream writes), or None where the bytes cannot be one."""
    def vint(at: int, keep_marker: bool) -> tuple[int, int] | None:
        if at >= len(data) or data[at] == 0:
            return None
        length = 9 - data[at].bit_length()
        if at + length > len(data):
            return None
        value = int.from_bytes(data[at : at + length], "big")
        return (value if keep_marker else value & ((1 << (7 * length)) - 1)), at + length

    ident = vint(pos, keep_marker=True)
    size = ident and vint(ident[1], keep_marker=False)
    if not size:
        return None
    length = size[1] - ident[1]
    unknown = size[0] == (1 << (7 * length)) - 1
    return ident[0], size[1], None if unknown else size[0]


def sample_indices(total_frames: int, video_fps: float, params: VideoParams) -> list[int]:
    """The frame indices transformers' Qwen3VLVideoProcessor.sample_frames picks (its `fps` mode):
    num = clamp(int(total / video_fps * fps), min_frames, max_frames, total), spread uniformly over
    [0, total - 1] and rounded (numpy's round: half to even). do_sample_frames false: every frame."""
    import numpy as np

    if not params.do_sample_frames:
        return list(range(total_frames))
    num = int(total_frames / video_fps * params.fps)
    num = min(max(num, params.min_frames), params.max_frames, total_frames)
    return np.linspace(0, total_frames - 1, num).round().astype(int).tolist()


def sampled_frames(data: bytes, header: VideoHeader, indices: list[int], limits: VideoLimits,
                   progress: Callable[[], None] | None = None) -> Iterator[np.ndarray]:
    """Each frame at `indices` (ascending) as RGB uint8 [height, width, 3] (the display matrix applied), in
    order, as soon as it is decoded; every other frame is dropped as it comes. Every decoded frame, sampled or
    not, is held to --video-max-frame-pixels (a header tells only the first size; a stream may change size
    later) and calls `progress` (a decode that calls it is making progress: procs/decoders.py's stall watch).
    `truncated_video` when the stream ends before the last index (a header that promised more frames than
    there are, or a file cut short); `video_too_long` past the decode deadline."""
    import av
    import numpy as np

    want = sorted(set(indices))
    assert want == list(indices), "indices must be ascending and distinct: this is a bug"
    coded = header.coded_size
    turns = header.rotation // 90
    deadline = time.monotonic() + limits.max_decode_s
    got, i = 0, 0
    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            stream = container.streams.video[0]
            stream.thread_type = "AUTO"
            for frame in container.decode(stream):
                if time.monotonic() > deadline:
                    raise VideoError(f"decoding the video took over {limits.max_decode_s:g} s; send a shorter "
                                       "or smaller one", code="video_too_long")
                if frame.width * frame.height > limits.max_frame_pixels:
                    raise VideoError(f"frame {i} is {frame.width}x{frame.height} ({frame.width * frame.height} pixels); "
                                     f"the limit is {limits.max_frame_pixels} pixels a frame", code="video_too_large")
                if progress is not None:
                    progress()
                if got < len(want) and i == want[got]:
                    if (frame.width, frame.height) != coded:
                        raise VideoError(f"frame {i} is {frame.width}x{frame.height}; the header said "
                                           f"{coded[0]}x{coded[1]} (a size change mid-stream is not supported)", code="corrupt_video")
                    rgb = frame.to_ndarray(format="rgb24")
                    # (np.rot90 turns counterclockwise, as the display matrix's angle counts)
                    yield np.ascontiguousarray(np.rot90(rgb, turns)) if turns else rgb
                    got += 1
                    if got == len(want):
                        break
                i += 1
    except av.error.FFmpegError as e:
        raise _cut_short(data) or VideoError(f"the video cannot be decoded at frame {i} ({e.strerror or e})",
                                             code="corrupt_video") from None
    if got < len(want):
        raise VideoError(f"the video ends after {i} frames; its header promised {header.frames}", code="truncated_video")


def decode_frames(data: bytes, header: VideoHeader, indices: list[int], limits: VideoLimits) -> np.ndarray:
    """The frames at `indices` as one array, uint8 [n, height, width, 3] (sampled_frames, stacked): every
    sampled frame at its full size at once, so for tests and fixtures; the service resizes each as it comes."""
    import numpy as np

    out = np.empty((len(indices), header.height, header.width, 3), np.uint8)
    for k, frame in enumerate(sampled_frames(data, header, indices, limits)):
        out[k] = frame
    return out


def video_size(num_frames: int, height: int, width: int, *, factor: int, min_pixels: int, max_pixels: int,
               temporal_factor: int = 2) -> tuple[int, int]:
    """transformers' video smart_resize (video_processing_qwen3_vl.py): the frames' (height, width) at
    multiples of `factor` (patch x merge), the whole clip's pixels (frames rounded to `temporal_factor`)
    within [min_pixels, max_pixels]. The caller has checked the aspect ratio and frame count."""
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    t_bar = round(num_frames / temporal_factor) * temporal_factor
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt((num_frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def clip_size(num_frames: int, height: int, width: int, params: VideoParams) -> tuple[int, int]:
    """The (height, width) every sampled frame is resized to, as Qwen3VLVideoProcessor.resize computes it:
    `video_size` over the sampled frames (before the odd-count padding), its max_pixels lowered or raised
    by the per-frame cap where the config turns it on (transformers' formula, copied). As for `video_size`,
    the caller has checked the aspect ratio and that there are temporal_patch_size frames or more
    (transformers raises ValueError on either)."""
    max_pixels = params.max_pixels
    if params.cap_pixels_per_frame:
        frame_cap = params.max_video_tokens * params.factor * params.factor
        per_frame = max(min(frame_cap, params.max_pixels // num_frames), int(params.min_pixels * 1.05))
        max_pixels = per_frame * num_frames
    return video_size(num_frames, height, width, factor=params.factor, min_pixels=params.min_pixels,
                      max_pixels=max_pixels, temporal_factor=params.temporal_patch_size)


def timestamps(indices: list[int], video_fps: float, temporal_patch_size: int) -> list[float]:
    """The time of each temporal patch, in seconds, that Qwen3VLProcessor writes into the prompt before
    its frame's tokens (`<{t:.1f} seconds>`): the mean of its first and last frame's index / video_fps,
    an odd count padded with the last index (transformers' _calculate_timestamps; it pads the caller's list
    in place, this does not)."""
    t = temporal_patch_size
    padded = list(indices) + [indices[-1]] * (-len(indices) % t)
    seconds = [i / video_fps for i in padded]
    return [(seconds[i] + seconds[i + t - 1]) / 2 for i in range(0, len(seconds), t)]

