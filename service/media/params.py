"""The media parameters and limits, one home with one set of defaults: how an image or a video becomes
patches (a checkpoint's preprocessor configs) and what input is refused before it is decoded. Settings
(service/config.py) takes its defaults from these classes and derives the instances the service uses.

The standard library only (no pydantic, numpy or torch): the video preprocessing and its fixture maker run
where only numpy, torch and transformers are installed, and VideoParams travels in engine/messages.py.
"""

from __future__ import annotations

from dataclasses import dataclass


class _Patches:
    """What the patch geometry of a parameter set (its patch_size, merge_size, temporal_patch_size) gives."""

    patch_size: int
    merge_size: int
    temporal_patch_size: int

    @property
    def factor(self) -> int:
        """Sides are resized to multiples of this: a merged token's side in pixels."""
        return self.patch_size * self.merge_size

    @property
    def patch_dim(self) -> int:
        """Values in one patch row: 3 channels x temporal patch x patch x patch."""
        return 3 * self.temporal_patch_size * self.patch_size * self.patch_size


@dataclass(frozen=True)
class PreprocessParams(_Patches):
    """How an image becomes patches: Qwen3-VL's preprocessor_config.json values (never Qwen2-VL's)."""

    min_pixels: int = 65536  # size.shortest_edge
    max_pixels: int = 16777216  # size.longest_edge
    patch_size: int = 16
    merge_size: int = 2
    temporal_patch_size: int = 2
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    rescale_factor: float = 1 / 255
    resample: int = 3  # PIL.Image.BICUBIC


@dataclass(frozen=True)
class ImageLimits:
    """Checked before an image is fully decoded, so hostile input costs little."""

    max_image_bytes: int = 32 * 1024 * 1024
    max_input_pixels: int = 64_000_000  # width * height as declared in the header
    max_aspect_ratio: float = 200.0  # Qwen's smart_resize rejects max/min > 200
    # Scans (SOS markers) of a JPEG's image. Each scan is a pass over every block of the image whatever its
    # size in bytes: a 4096x4096 progressive JPEG whose 33-byte last scan was repeated 200 times took 4 s
    # to decode, 20,000 times about 350 s. libjpeg's own progressive files have 10 scans (6 in grayscale),
    # encoders that tune their progression (mozjpeg) a few more, a baseline JPEG 1 (3 when not interleaved):
    # 64 leaves room for unusual encoders and bounds a 64 MP image's scans to a few seconds of one core.
    max_jpeg_scans: int = 64
    # Wall time one image's decode may take (checked between the decoder's chunks of input; a decoder that
    # cannot be stopped is ended with its decode process, procs/decoders.py's PoolDecoder). The largest
    # admitted image (64 MP) took 1.2 s to decode as a baseline JPEG and 2.8 s as a progressive one, 4 s with
    # its resize, on one core of a 2-core development machine: 10 s leaves room for a busy machine.
    decode_timeout_s: float = 10.0


@dataclass(frozen=True, kw_only=True)
class VideoLimits:
    """Checked from a video's header before any frame is decoded (media/video.read_header; the byte budgets
    where the request is keyed and where a process decodes), except the decode deadline."""

    max_bytes: int = 64 * 1024**2  # the encoded file (a JSON body is also bounded by --max-request-bytes)
    max_duration_s: float = 20 * 60.0  # by the header, before anything is decoded
    max_frames: int = 60 * 60 * 30  # frames in the stream (what a decode walks through), by the header
    max_frame_pixels: int = 3840 * 2160  # one frame's width x height (4K), the header's and every decoded frame's
    max_decode_s: float = 60.0  # wall time of one video's decode
    # The resized frames (uint8 after sampling and the clip size, padded to whole temporal groups), counted from
    # the header before any frame is decoded: what a decode holds besides a frame or two at full size. Qwen3-VL's
    # released video config (the whole clip within 25,165,824 pixels) resizes any clip to at most 72 MiB; a
    # 20-minute 1080p clip at its default sampling (768 frames of 224x128) to 63 MiB.
    max_request_bytes: int = 256 * 1024**2  # one request's videos: three of the largest such clips
    max_process_bytes: int = 512 * 1024**2  # the videos one process decodes at once: seven of them


@dataclass(frozen=True, kw_only=True)
class VideoParams(_Patches):
    """A checkpoint's video_preprocessor_config.json: every value the pipeline uses, with the defaults of
    transformers' Qwen3VLVideoProcessor (its class attributes, the same in transformers 5.17 and 5.24)."""

    min_pixels: int = 128 * 32 * 32  # size.shortest_edge: the whole clip's pixels (frames x h x w), not a frame's
    max_pixels: int = 32 * 32 * 768  # size.longest_edge, likewise
    fps: float = 2.0  # frames sampled per second of video
    min_frames: int = 4
    max_frames: int = 768
    do_sample_frames: bool = True  # False: every frame of the video is used
    patch_size: int = 16
    merge_size: int = 2
    temporal_patch_size: int = 2
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)  # IMAGENET_STANDARD_MEAN
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    rescale_factor: float = 1 / 255
    resample: int = 3  # PIL.Image.BICUBIC: torchvision's bicubic, antialiased
    # NOTE: transformers 5.17 and 5.24 both have the per-frame cap, off unless the config turns it on
    # (None there: off, with a warning that a later version makes it the default).
    cap_pixels_per_frame: bool = False
    max_video_tokens: int = 768  # the cap's tokens a frame

    @classmethod
    def from_config(cls, raw: dict) -> VideoParams:
        """From a video processor config as transformers reads it (keys absent: the class defaults).
        ValueError, naming the key, for a value this pipeline does not reproduce."""
        d = cls()
        size = raw.get("size")
        if size is None:
            min_pixels, max_pixels = d.min_pixels, d.max_pixels
        elif isinstance(size, dict) and size.get("shortest_edge") and size.get("longest_edge"):
            min_pixels, max_pixels = int(size["shortest_edge"]), int(size["longest_edge"])
        else:
            raise ValueError(f"size must have shortest_edge and longest_edge (as Qwen3VLVideoProcessor needs), got {size!r}")
        for flag in ("do_resize", "do_rescale", "do_normalize"):
            if raw.get(flag) is False:
                raise ValueError(f"{flag} is false; only Qwen3-VL's resize + rescale + normalize is reproduced")
        if raw.get("num_frames") is not None:
            raise ValueError("num_frames is set: only sampling by fps (num_frames null) is reproduced")
        fps = raw.get("fps", d.fps)
        if not isinstance(fps, (int, float)) or isinstance(fps, bool) or fps <= 0:
            raise ValueError(f"fps must be a positive number, got {fps!r}")
        resample = int(raw.get("resample", d.resample))
        if resample != 3:
            raise ValueError(f"resample {resample} is not bicubic (3), the only one reproduced")

        def three(key: str, default: tuple[float, float, float]) -> tuple[float, float, float]:
            v = raw.get(key, default)
            v = (v, v, v) if isinstance(v, (int, float)) else tuple(v)  # one number: every channel's
            if len(v) != 3:
                raise ValueError(f"{key} needs 3 values (or one), got {raw.get(key)!r}")
            return tuple(float(x) for x in v)

        def opt(key: str, default):
            v = raw.get(key)
            return default if v is None else v

        return cls(
            min_pixels=min_pixels,
            max_pixels=max_pixels,
            fps=float(fps),
            min_frames=int(opt("min_frames", d.min_frames)),
            max_frames=int(opt("max_frames", d.max_frames)),
            do_sample_frames=bool(opt("do_sample_frames", d.do_sample_frames)),
            patch_size=int(opt("patch_size", d.patch_size)),
            merge_size=int(opt("merge_size", d.merge_size)),
            temporal_patch_size=int(opt("temporal_patch_size", d.temporal_patch_size)),
            image_mean=three("image_mean", d.image_mean),
            image_std=three("image_std", d.image_std),
            rescale_factor=float(opt("rescale_factor", d.rescale_factor)),
            resample=resample,
            cap_pixels_per_frame=bool(opt("cap_pixels_per_frame", d.cap_pixels_per_frame)),
            max_video_tokens=int(opt("max_video_tokens", d.max_video_tokens)),
        )
