"""Test images as encoded bytes, and the transformers reference the preprocessing is compared with.

Real photographs come from scikit-image's bundled data directory (read as files; nothing is
downloaded). Synthetic images cover the modes and containers real clients send: transparency,
palettes, grayscale, CMYK, EXIF orientation, every supported format, extreme shapes, tiny images.
`bad_images()` builds one example of each kind of bad input with the error it must raise.

    from tests.support.imagedata import valid_images, bad_images, photo, reference_pixel_values
"""

from __future__ import annotations

import functools
import importlib.util
import io
import struct
import zlib
from pathlib import Path

import numpy as np
from PIL import Image

from service.media.params import PreprocessParams
from service.errors import ImageError

# Located without importing skimage (its import is slow and not needed to read files).
SKIMAGE_DATA = Path(importlib.util.find_spec("skimage").submodule_search_locations[0]) / "data"


def encode(img: Image.Image, fmt: str, **save_kwargs) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **save_kwargs)
    return buf.getvalue()


@functools.cache
def photo(name: str, max_side: int | None = None) -> bytes:
    """A scikit-image photograph's bytes: the original file, or downscaled to max_side and re-encoded
    in its own format (JPEG at quality 90) to keep tests fast."""
    data = (SKIMAGE_DATA / name).read_bytes()
    if max_side is None:
        return data
    img = Image.open(io.BytesIO(data))
    img.thumbnail((max_side, max_side), Image.Resampling.LANCZOS)
    fmt = img.format or Image.open(io.BytesIO(data)).format
    return encode(img, fmt, **({"quality": 90} if fmt == "JPEG" else {}))


def textured_rgb(width: int, height: int, seed: int = 0) -> Image.Image:
    """Gradients plus noise: exercises bicubic rounding and every uint8 level, unlike a flat colour."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 / max(width - 1, 1), y * 255 / max(height - 1, 1), (x + y) % 256], axis=-1)
    noisy = base + rng.normal(0, 40, size=base.shape)
    return Image.fromarray(np.clip(noisy, 0, 255).astype(np.uint8), "RGB")


def quadrants(width: int, height: int) -> Image.Image:
    """Four flat colours (red top-left, green top-right, blue bottom-left, white bottom-right):
    orientation is visible from any pixel, and survives lossy JPEG within a few levels."""
    arr = np.zeros((height, width, 3), np.uint8)
    h2, w2 = height // 2, width // 2
    arr[:h2, :w2] = (255, 0, 0)
    arr[:h2, w2:] = (0, 255, 0)
    arr[h2:, :w2] = (0, 0, 255)
    arr[h2:, w2:] = (255, 255, 255)
    return Image.fromarray(arr, "RGB")


# ---- synthetic images of each mode / container -------------------------------------------------------


def rgba_png() -> bytes:
    """Partial transparency: alpha is a horizontal ramp from 0 to 255."""
    rgb = np.asarray(textured_rgb(96, 80, seed=1))
    alpha = np.tile(np.linspace(0, 255, 96).astype(np.uint8), (80, 1))[..., None]
    return encode(Image.fromarray(np.concatenate([rgb, alpha], axis=-1), "RGBA"), "PNG")


def palette_transparent_png() -> bytes:
    """Mode P with a transparent palette index (PNG tRNS): transformers composites it on white."""
    img = textured_rgb(90, 70, seed=2).quantize(colors=16)
    return encode(img, "PNG", transparency=3)


def la_png() -> bytes:
    gray = np.asarray(textured_rgb(64, 72, seed=3).convert("L"))
    alpha = np.tile(np.linspace(255, 0, 72).astype(np.uint8)[:, None], (1, 64))
    return encode(Image.fromarray(np.stack([gray, alpha], axis=-1), "LA"), "PNG")


def gray_png() -> bytes:
    return encode(textured_rgb(100, 60, seed=4).convert("L"), "PNG")


def one_bit_png() -> bytes:
    return encode(textured_rgb(80, 80, seed=5).convert("1"), "PNG")


def i16_png() -> bytes:
    """16-bit grayscale (mode I;16). NOTE: transformers' RGB conversion clips it to 0..255, not scales."""
    y, x = np.mgrid[0:64, 0:96]
    arr = (x * 3 + y * 2).astype(np.uint16)  # 0..410: both sides of the clip at 255
    return encode(Image.fromarray(arr), "PNG")


def rgb48_png(width: int = 30, height: int = 20) -> bytes:
    """16 bits per channel RGB (PIL cannot write it; built by hand). PIL reads it as 8-bit RGB."""
    rng = np.random.default_rng(13)
    rows = rng.integers(0, 65536, size=(height, width * 3), dtype=np.uint16).astype(">u2")
    raw = b"".join(b"\x00" + row.tobytes() for row in rows)  # filter type 0 per row
    ihdr = struct.pack(">IIBBBBB", width, height, 16, 2, 0, 0, 0)
    chunks = png_chunk(b"IHDR", ihdr) + png_chunk(b"IDAT", zlib.compress(raw)) + png_chunk(b"IEND", b"")
    return b"\x89PNG\r\n\x1a\n" + chunks


def float_tiff() -> bytes:
    """Mode F (32-bit float). NOTE: transformers' RGB conversion clips it to 0..255."""
    return encode(Image.fromarray(np.linspace(-20, 300, 48 * 40, dtype=np.float32).reshape(40, 48)), "TIFF")


def int32_tiff() -> bytes:
    return encode(Image.fromarray(np.arange(48 * 40, dtype=np.int32).reshape(40, 48) - 500), "TIFF")


def cmyk_jpeg() -> bytes:
    return encode(textured_rgb(120, 90, seed=6).convert("CMYK"), "JPEG", quality=92)


def exif_rotated(fmt: str = "JPEG", orientation: int = 6) -> bytes:
    """A 96x64 (w x h) quadrants image whose EXIF says: rotate for display (6: 90° clockwise)."""
    exif = Image.Exif()
    exif[0x0112] = orientation  # Orientation
    kwargs = {"quality": 95} if fmt == "JPEG" else {}
    return encode(quadrants(96, 64), fmt, exif=exif.tobytes(), **kwargs)


def gif_bytes(animated: bool = False) -> bytes:
    frames = [textured_rgb(72, 56, seed=7 + i).quantize(colors=64) for i in range(3 if animated else 1)]
    if not animated:
        return encode(frames[0], "GIF")
    return encode(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=50, loop=0)


def tiny_png(width: int = 10, height: int = 7) -> bytes:
    """Far below min_pixels: smart_resize scales it up."""
    return encode(textured_rgb(width, height, seed=8), "PNG")


def shaped_png(width: int, height: int) -> bytes:
    """A thin strip. Mode L keeps even 20000-pixel strips small and fast to build."""
    return encode(textured_rgb(width, height, seed=9).convert("L"), "PNG")


@functools.cache
def valid_images() -> dict[str, bytes]:
    """Every image the service must accept, by name: photographs at original size and downscaled,
    every supported format, every common pixel mode, extreme-but-allowed shapes, tiny images."""
    noise = textured_rgb(150, 110, seed=10)
    return {
        # photographs, original files
        "astronaut.png": photo("astronaut.png"),  # 512x512 RGB
        "chelsea.png": photo("chelsea.png"),  # 451x300 RGB
        "coffee.png": photo("coffee.png"),  # 600x400 RGB
        "rocket.jpg": photo("rocket.jpg"),  # 640x427 JPEG
        "camera.png": photo("camera.png"),  # 512x512 L
        "moon.png": photo("moon.png"),  # 512x512 L
        "page.png": photo("page.png"),  # 384x191 L
        "horse.png": photo("horse.png"),  # 400x328 RGBA (binary alpha)
        "logo.png": photo("logo.png"),  # 500x500 RGBA
        "no_time_for_that_tiny.gif": photo("no_time_for_that_tiny.gif"),  # animated GIF, 24 frames
        # photographs, downscaled (big originals cost seconds in the reference processor)
        "hubble_deep_field.jpg@400": photo("hubble_deep_field.jpg", 400),
        "retina.jpg@360": photo("retina.jpg", 360),
        "motorcycle_left.png@300": photo("motorcycle_left.png", 300),
        # every supported container
        "noise.webp.lossless": encode(noise, "WEBP", lossless=True),
        "noise.webp.lossy": encode(noise, "WEBP", quality=80),
        "noise.bmp": encode(noise, "BMP"),
        "noise.tiff": encode(noise, "TIFF"),
        "noise.tiff.lzw": encode(noise, "TIFF", compression="tiff_lzw"),
        "noise.gif": gif_bytes(),
        "noise.gif.animated": gif_bytes(animated=True),
        # modes
        "rgba.png": rgba_png(),
        "palette_transparent.png": palette_transparent_png(),
        "la.png": la_png(),
        "gray.png": gray_png(),
        "1bit.png": one_bit_png(),
        "i16.png": i16_png(),
        "cmyk.jpg": cmyk_jpeg(),
        "cmyk.tiff": encode(textured_rgb(60, 44, seed=14).convert("CMYK"), "TIFF"),
        "rgb48.png": rgb48_png(),
        "float.tiff": float_tiff(),
        "int32.tiff": int32_tiff(),
        "lab.tiff": encode(textured_rgb(40, 30, seed=15).convert("LAB"), "TIFF"),  # transformers: a* used as alpha
        "exif6.jpg": exif_rotated("JPEG", 6),
        "exif8.png": exif_rotated("PNG", 8),
        # shapes
        "tiny_10x7.png": tiny_png(),
        "one_pixel.png": tiny_png(1, 1),
        "wide_4000x40.png": shaped_png(4000, 40),  # ratio 100
        "tall_30x6000.png": shaped_png(30, 6000),  # ratio 200 exactly: allowed (the limit is > 200)
    }


# ---- bad input ------------------------------------------------------------------------------------------


def png_chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def png_header_only(width: int, height: int, mode_bits: tuple[int, int] = (8, 0)) -> bytes:
    """A PNG that declares width x height (bit depth, colour type) and carries a token IDAT: enough for
    every header check; decoding it would fail. Lets tests declare 10^8 pixels in 60 bytes."""
    depth, color = mode_bits
    ihdr = struct.pack(">IIBBBBB", width, height, depth, color, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + png_chunk(b"IHDR", ihdr)
        + png_chunk(b"IDAT", zlib.compress(b"\x00" * 64))
        + png_chunk(b"IEND", b"")
    )


def corrupt_png_idat() -> bytes:
    """A valid PNG whose IDAT payload has bytes flipped mid-stream (zlib fails; header is fine)."""
    data = bytearray(encode(textured_rgb(64, 48, seed=11), "PNG"))
    start = data.index(b"IDAT") + 4
    length = struct.unpack(">I", data[start - 8 : start - 4])[0]
    for i in range(start + length // 3, start + length // 3 + 32):
        data[i] ^= 0xFF
    return bytes(data)


def corrupt_jpeg() -> bytes:
    """A JPEG with garbage in its Huffman tables (the DHT segment): libjpeg refuses to decode it.

    NOTE: garbage in the entropy-coded scan data is *not* detectable this way: libjpeg reports it as a
    warning ("Corrupt JPEG data: ...") that PIL drops, and decodes a damaged picture.
    """
    data = bytearray(encode(textured_rgb(64, 48, seed=12), "JPEG", quality=90))
    dht = data.index(b"\xff\xc4")
    for i in range(dht + 5, dht + 13):
        data[i] ^= 0xFF
    return bytes(data)


def scans(jpeg: bytes) -> list[tuple[int, int]]:
    """(start, end) of each scan of a JPEG PIL wrote: its SOS marker up to the next scan's (the last: up to EOI).
    (PIL writes no thumbnail and no other segment between scans, so each 0xFF 0xDA is a scan's.)"""
    starts = [i for i in range(len(jpeg) - 1) if jpeg[i : i + 2] == b"\xff\xda"]
    return list(zip(starts, starts[1:] + [jpeg.rindex(b"\xff\xd9")]))


@functools.cache
def progressive_photo(side: int, smooth: bool = False) -> bytes:
    """A photograph (astronaut.png) at side x side as a progressive JPEG (PIL's progressive=True: libjpeg's
    script of 10 scans). smooth: upscaled from 64x64 (a blurred photo), so that some scans are a few dozen
    bytes: the cheapest scans for a scan bomb."""
    img = Image.open(SKIMAGE_DATA / "astronaut.png").convert("RGB")
    if smooth:
        img = img.resize((64, 64), Image.Resampling.LANCZOS)
    return encode(img.resize((side, side), Image.Resampling.BICUBIC), "JPEG", quality=75, progressive=True)


def scan_bomb(jpeg: bytes, repeats: int, which: str = "smallest") -> bytes:
    """Issue 23's decode-time bomb: a progressive JPEG with one of its scans (its `smallest` in bytes, or its
    `last`) repeated `repeats` more times, right after itself. libjpeg warns of the bogus progression and
    decodes every repetition, each a pass over every block of the image however few bytes it takes (a
    4096x4096 image's last scan repeated 20,000 times took about 350 s)."""
    spans = scans(jpeg)
    start, end = min(spans, key=lambda s: s[1] - s[0]) if which == "smallest" else spans[-1]
    return jpeg[:end] + jpeg[start:end] * repeats + jpeg[end:]


def jpeg_marker_flood(segments: int = 300_000) -> bytes:
    """A small JPEG with `segments` empty COM segments after its SOI: each costs PIL's header parser (Python)
    about 3 us, libjpeg nothing to speak of."""
    jpeg = encode(textured_rgb(32, 32, seed=16), "JPEG", quality=90)
    return jpeg[:2] + b"\xff\xfe\x00\x02" * segments + jpeg[2:]


def truncated(data: bytes, keep: float = 0.6) -> bytes:
    return data[: int(len(data) * keep)]


def bad_images() -> dict[str, tuple[bytes, str, str]]:
    """name -> (bytes, the ImageError code it must raise with default ImageLimits, a fact its message must state)."""
    return {
        "empty": (b"", "empty_image", "0 bytes"),
        "text": (b"hello, this is definitely not an image\n", "not_an_image", "not an image"),
        "json": (b'{"images": [1, 2, 3]}', "not_an_image", "not an image"),
        "ico": (encode(textured_rgb(32, 32), "ICO"), "unsupported_format", "ICO"),
        "ppm": (encode(textured_rgb(32, 32), "PPM"), "unsupported_format", "PPM"),
        "corrupt_png_idat": (corrupt_png_idat(), "corrupt_image", "PNG"),
        "corrupt_jpeg": (corrupt_jpeg(), "corrupt_image", "JPEG"),
        "truncated_png": (truncated(encode(textured_rgb(64, 48), "PNG")), "truncated_image", "truncated"),
        "truncated_jpeg": (truncated(encode(textured_rgb(64, 48), "JPEG")), "truncated_image", "truncated"),
        "truncated_webp": (truncated(encode(textured_rgb(64, 48), "WEBP")), "truncated_image", "truncated"),
        "truncated_gif": (truncated(gif_bytes()), "truncated_image", "truncated"),
        "bomb_9000x9000": (png_header_only(9000, 9000), "image_too_large", "9000x9000 = 81.0M pixels"),
        "aspect_4020x20": (png_header_only(4020, 20), "aspect_ratio_too_extreme", "201.0:1"),
        "zero_width": (png_header_only(0, 20), "corrupt_image", "0x20"),
        "jpeg_scan_bomb": (scan_bomb(progressive_photo(512), 100), "image_too_complex", "more than 64 scans"),
        "jpeg_marker_flood": (jpeg_marker_flood(), "image_too_complex", "marker segments"),
    }


# ---- the reference ----------------------------------------------------------------------------------------


@functools.cache
def qwen3vl_processor(params: PreprocessParams = PreprocessParams()):
    """transformers' PIL-backend Qwen2-VL processor with Qwen3-VL's values (never its Qwen2-VL defaults)."""
    from tests.support.checkpoints import PilProcessor as Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(
        patch_size=params.patch_size,
        merge_size=params.merge_size,
        temporal_patch_size=params.temporal_patch_size,
        image_mean=list(params.image_mean),
        image_std=list(params.image_std),
        rescale_factor=params.rescale_factor,
        size={"shortest_edge": params.min_pixels, "longest_edge": params.max_pixels},
        resample=Image.Resampling(params.resample),
    )


def reference_pixel_values(pil_images: list[Image.Image], params: PreprocessParams = PreprocessParams()):
    """(pixel_values [sum patches, 1536] float32 torch, grid_thw [n, 3] int64 torch) from transformers."""
    out = qwen3vl_processor(params)(images=list(pil_images), return_tensors="pt")
    return out["pixel_values"], out["image_grid_thw"]


def webp_declaring(width: int, height: int) -> bytes:
    """A small lossless WebP whose VP8L header is patched to declare width x height (max 16384)."""
    data = bytearray(encode(textured_rgb(8, 8), "WEBP", lossless=True))
    assert data[12:16] == b"VP8L" and data[20] == 0x2F, "Pillow wrote an unexpected WebP layout"
    bits = int.from_bytes(data[21:25], "little")
    bits = (bits & ~((1 << 28) - 1)) | (width - 1) | ((height - 1) << 14)
    data[21:25] = bits.to_bytes(4, "little")
    return bytes(data)
