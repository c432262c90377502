"""What the load test sends: generated images and videos, your own files, and the /encode payloads
made of them. Every image is distinct unless --repeat (a run seed and an index per image). The
payloads are built in worker processes: what they are given (ImageSpec) and run is picklable."""

from __future__ import annotations

import base64
import functools
import io
import mimetypes
from dataclasses import dataclass
from pathlib import Path

import numpy as np


PATTERNS = ("gradient", "noise", "photo")
# scikit-image's bundled colour photographs (no download needed).
PHOTOS = ("astronaut", "coffee", "chelsea", "rocket", "immunohistochemistry", "hubble_deep_field")
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp", ".gif", ".bmp", ".tif", ".tiff")
VIDEO_SUFFIXES = (".mp4", ".webm", ".mkv", ".avi", ".mov", ".m4v")


def parse_sizes(text: str) -> list[tuple[int, int]]:
    """'448x448,1024x768' -> [(448, 448), (1024, 768)] as (width, height)."""
    sizes = []
    for part in text.split(","):
        w, sep, h = part.strip().lower().partition("x")
        if not sep or not w.isdigit() or not h.isdigit() or int(w) == 0 or int(h) == 0:
            raise ValueError(f"bad size {part!r}: expected WIDTHxHEIGHT, e.g. 448x448")
        sizes.append((int(w), int(h)))
    return sizes


def image_seed(request_index: int, image_index: int, images_per_request: int, n_sizes: int, unique: bool) -> int:
    """Distinct per image when unique; otherwise one seed per size slot, so images repeat exactly."""
    flat = request_index * images_per_request + image_index
    return flat if unique else flat % n_sizes


def make_image(width: int, height: int, seed: int, pattern: str = "gradient", run_seed: int = 0) -> np.ndarray:
    """An RGB uint8 [height, width, 3] test image; different (run_seed, seed) give different pixels."""
    rng = np.random.default_rng([run_seed, seed])
    if pattern == "noise":
        return rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    if pattern == "gradient":
        y = np.linspace(0.0, 1.0, height, dtype=np.float32)[:, None, None]
        x = np.linspace(0.0, 1.0, width, dtype=np.float32)[None, :, None]
        a, b, c = (rng.uniform(0, 255, size=3).astype(np.float32) for _ in range(3))
        img = a * (1 - x) * (1 - y) + b * x + c * y * (1 - x)
        return np.clip(img, 0, 255).astype(np.uint8)
    if pattern == "photo":
        from PIL import Image
        from skimage import data as skdata  # optional: pip install scikit-image

        photo = getattr(skdata, PHOTOS[seed % len(PHOTOS)])()
        ph, pw = photo.shape[:2]
        # A seed-dependent crop (at least half of each side), resized: distinct, still natural content.
        ch, cw = int(rng.integers(ph // 2, ph + 1)), int(rng.integers(pw // 2, pw + 1))
        top, left = int(rng.integers(0, ph - ch + 1)), int(rng.integers(0, pw - cw + 1))
        crop = Image.fromarray(np.ascontiguousarray(photo[top : top + ch, left : left + cw, :3]))
        return np.asarray(crop.resize((width, height), Image.BICUBIC))
    raise ValueError(f"unknown pattern {pattern!r}; choose from {PATTERNS}")


def encode_image(pixels: np.ndarray, fmt: str = "png") -> tuple[bytes, str]:
    """Compress an RGB array; returns (bytes, MIME type)."""
    from PIL import Image

    buf = io.BytesIO()
    if fmt == "png":
        Image.fromarray(pixels).save(buf, format="PNG", compress_level=1)  # fast; size matters little here
        return buf.getvalue(), "image/png"
    if fmt == "jpeg":
        Image.fromarray(pixels).save(buf, format="JPEG", quality=90)
        return buf.getvalue(), "image/jpeg"
    raise ValueError(f"unknown format {fmt!r}; choose png or jpeg")


def make_video(width: int, height: int, frames: int, fps: int, seed: int, pattern: str = "gradient",
               run_seed: int = 0, x264_preset: str = "ultrafast") -> bytes:
    """An H.264 MP4 clip made with PyAV (no network): `frames` frames of a camera pan, each a width x height
    window one step further across a picture 1.5 times the size (make_image's, for this seed). `x264_preset`:
    libx264's speed preset (ultrafast: no B-frames, no CABAC; `fast` and slower encode as cameras and
    sites do, and decode slower)."""
    import av
    from fractions import Fraction

    big = make_image(width * 3 // 2, height * 3 // 2, seed, pattern, run_seed)
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as out:
        stream = out.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.time_base = Fraction(1, fps)
        stream.options = {"preset": x264_preset, "crf": "23"}
        for i in range(frames):
            x = (big.shape[1] - width) * i // max(1, frames - 1)
            y = (big.shape[0] - height) * i // max(1, frames - 1)
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(big[y : y + height, x : x + width]), format="rgb24")
            frame.pts = i
            out.mux(stream.encode(frame))
        out.mux(stream.encode(None))
    return buf.getvalue()


def data_url(data: bytes, mime: str) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode('ascii')}"


def is_video_url(url: str) -> bool:
    return url.startswith("data:video/")


def build_payload(urls: list[str]) -> dict:
    """The JSON /encode body (OpenAI content-part shapes) for a list of data URLs: `video_url` parts for
    data:video/... URLs, `image_url` parts for the others."""
    return {"images": [{"type": "video_url", "video_url": {"url": u}} if is_video_url(u)
                       else {"type": "image_url", "image_url": {"url": u}} for u in urls]}


def build_chat(urls: list[str]) -> dict:
    """The body vLLM's EPD proxy posts to its encoder for a user's chat request with these media: the parts in
    one user message beside a text part, max_tokens 1, not streamed."""
    return {"messages": [{"role": "user", "content": [*build_payload(urls)["images"],
                                                      {"type": "text", "text": "Describe what you see."}]}],
            "max_tokens": 1, "stream": False}


@dataclass(frozen=True)
class ImageSpec:
    """What the images of a run look like (picklable: payloads are built in worker processes)."""

    sizes: tuple[tuple[int, int], ...]  # (width, height), cycled over the images
    images_per_request: int
    unique: bool
    pattern: str
    fmt: str
    run_seed: int  # fresh per run by default, so --unique images are not cache hits from an earlier run
    files: tuple[str, ...] = ()  # --images DIR: these files, cycled, instead of generated images
    videos_per_request: int = 0  # after the images in each request
    video_files: tuple[str, ...] = ()  # --videos DIR: these files, cycled, instead of generated clips
    video_size: tuple[int, int] = (320, 240)  # generated clips: (width, height), frames, fps
    video_frames: int = 24
    video_fps: int = 8


def image_url(spec: ImageSpec, w: int, h: int, seed: int) -> str:
    return data_url(*encode_image(make_image(w, h, seed, spec.pattern, spec.run_seed), spec.fmt))


# --repeat sends the same few images over and over: build each once per worker process.
_repeated_image_url = functools.lru_cache(maxsize=16)(image_url)


def request_urls(spec: ImageSpec, i: int) -> list[str]:
    """The data URLs of request i (generated images)."""
    return [url for url, _ in request_images(spec, i)]


def request_images(spec: ImageSpec, i: int, keep_every: int = 0) -> list[tuple[str, bytes | None]]:
    """Request i's images as (data URL, the encoded bytes or None). The bytes are kept only for images
    whose flat index is a multiple of keep_every (those verified against the reference).
    CPU-bound (~5-90 ms an image), hence run in a process pool."""
    out = []
    for j in range(spec.images_per_request):
        flat = i * spec.images_per_request + j
        keep = keep_every > 0 and flat % keep_every == 0
        if spec.files:
            path = spec.files[flat % len(spec.files)]
            blob = Path(path).read_bytes()
            out.append((data_url(blob, mimetypes.guess_type(path)[0] or "image/jpeg"), blob if keep else None))
            continue
        seed = image_seed(i, j, spec.images_per_request, len(spec.sizes), spec.unique)
        w, h = spec.sizes[flat % len(spec.sizes)]
        if keep:
            blob, mime = encode_image(make_image(w, h, seed, spec.pattern, spec.run_seed), spec.fmt)
            out.append((data_url(blob, mime), blob))
        else:
            out.append(((image_url if spec.unique else _repeated_image_url)(spec, w, h, seed), None))
    for j in range(spec.videos_per_request):
        flat = i * spec.videos_per_request + j
        if spec.video_files:
            path = spec.video_files[flat % len(spec.video_files)]
            mime = mimetypes.guess_type(path)[0] or ""
            out.append((data_url(Path(path).read_bytes(), mime if mime.startswith("video/") else "video/mp4"), None))
        else:
            out.append(((video_url if spec.unique else _repeated_video_url)(spec, flat if spec.unique else 0), None))
    return out


def video_url(spec: ImageSpec, seed: int) -> str:
    w, h = spec.video_size
    return data_url(make_video(w, h, spec.video_frames, spec.video_fps, seed, spec.pattern, spec.run_seed), "video/mp4")


_repeated_video_url = functools.lru_cache(maxsize=4)(video_url)


def video_files(folder: Path) -> list[str]:
    """The video files directly in `folder` (by suffix), sorted: what --videos DIR sends."""
    return sorted(str(p) for p in folder.iterdir() if p.is_file() and p.suffix.lower() in VIDEO_SUFFIXES)


def image_files(folder: Path) -> list[str]:
    """The image files directly in `folder` (by suffix), sorted: what --images DIR sends."""
    return sorted(str(p) for p in folder.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)
