"""Decode and validate client images; produce the resized uint8 pixels the step loop consumes.

Runs in decode worker processes (`prepare_image` is a module-level function so a ProcessPoolExecutor
can pickle it). Hostile input must cost little, so every limit that the header can answer is checked
before the pixels are decoded:

    empty / over max_image_bytes  ->  a JPEG's scans (max_jpeg_scans)  ->  format (by PIL's header parsers,
    restricted to SUPPORTED_FORMATS)  ->  declared width*height and aspect ratio  ->  full decode (load, within
    decode_timeout_s)  ->  EXIF orientation  ->  RGB  ->  smart_resize + resize  (service.media.preprocess,
    bit-exact with transformers)

Decode time is bounded as well as memory: a JPEG's scans are counted from its bytes (each scan is a pass
over the whole image, however few bytes it takes), and PIL's decode reads its input through a file whose
reads stop it past the image's deadline (`_Budgeted`); see prepare_image.

The header is parsed once, before any of that, by `read_header` (admission counts an image's tokens
from it, `header_tokens`); given to `prepare_image`, it picks the decode path without a second parse:
a plain JPEG is parsed once in all, another image once more by the PIL open that decodes it.

Every failure is one of service.errors' ImageError subclasses with a message that says what was wrong
and how to fix it; PIL's exceptions are caught where they can occur and never escape as a 500.
"""

from __future__ import annotations

import io
import os
import struct
import time
import warnings
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from PIL import (
    BmpImagePlugin,
    GifImagePlugin,
    Image,
    ImageFile,
    ImageOps,
    JpegImagePlugin,
    PngImagePlugin,
    TiffImagePlugin,
    UnidentifiedImageError,
    WebPImagePlugin,
)

from service.media import preprocess, sniff
from service.media.params import ImageLimits, PreprocessParams
from service.errors import ImageError

# PIL format names we accept. PIL reports JPEGs that carry a multi-picture index (most phone photos)
# as "MPO"; they are JPEGs and decode as their first picture.
SUPPORTED_FORMATS = ("JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF")
_FORMAT_ALIASES = {"MPO": "JPEG"}
_SUPPORTED_TEXT = "JPEG, PNG, WebP, GIF (first frame), BMP, TIFF"

# The header parser of each supported format, called directly only to learn *why* a file that starts
# with a supported signature cannot be opened (Image.open only says "cannot identify image file").
_PLUGINS: dict[str, type[ImageFile.ImageFile]] = {
    "PNG": PngImagePlugin.PngImageFile,
    "JPEG": JpegImagePlugin.JpegImageFile,
    "GIF": GifImagePlugin.GifImageFile,
    "BMP": BmpImagePlugin.BmpImageFile,
    "TIFF": TiffImagePlugin.TiffImageFile,
    "WEBP": WebPImagePlugin.WebPImageFile,
}

# What PIL's parsers and decoders raise for bad data (besides OSError, handled separately).
# TypeError is left out on purpose: from our calls it would be a bug, not bad input.
_PIL_DATA_ERRORS = (SyntaxError, ValueError, EOFError, IndexError, struct.error, zlib.error)


@dataclass
class PreparedImage:
    """One decoded, validated, resized image: what crosses from a decode worker to the batcher."""

    # [H', W', 3] uint8, C-contiguous, resized (H', W' multiples of patch*merge); a view of prepare_image's out if given
    pixels: np.ndarray
    grid_thw: tuple[int, int, int]  # (1, H'/patch, W'/patch)
    num_patches: int  # t*h*w: rows of pixel_values
    num_tokens: int  # num_patches // merge**2: rows of the embedding


@dataclass(frozen=True)
class ImageHeader:
    """What one parse of an image's header says (`read_header`): enough for admission (`header_tokens`) and
    for `prepare_image` to pick its decode path without parsing again. Plain values: it pickles to a decode
    worker process."""

    nbytes: int  # len() of the data it was read from
    format: str | None  # the supported format the data's signature names (sniff.sniff_format); None: none does
    size: tuple[int, int] | None  # (width, height) as declared, before EXIF orientation; None: no parser read it
    plain_jpeg: bool  # simplejpeg may decode it straight to the RGB pixels (see _decode_plain_jpeg)
    # A JPEG's scans (sniff.jpeg_scans: counted up to one more than the limit); 0 for other formats; None: a JPEG of
    # more marker segments than are worth walking (refused, and never given to PIL's header parser).
    scans: int | None = 0
    # Whether loading keeps it as it is, RGB with no transparency (not a palette, grey, CMYK or alpha image,
    # nor one with a transparent colour): what vLLM's image loader converts, and so keys otherwise
    # (store/keys.py's VllmKeys). None where no parser read the header.
    plain_rgb: bool | None = None


# Where prepare_image writes the final pixels: called with their size in bytes, it returns a writable flat
# uint8 array of exactly that size (e.g. a shared-memory arena cell).
PixelsOut = Callable[[int], np.ndarray]


def read_header(data: bytes, limits: ImageLimits) -> ImageHeader:
    """One parse of the image's header, nothing decoded: its format, declared size and whether it is a
    plain JPEG. Never raises for bad data: what the header's fault is, decoding says (the size is None
    then). Cheap enough for the event loop's thread hop (a header parse, no pixels)."""
    fmt = sniff.sniff_format(data)
    if fmt == "WEBP":  # PIL's WebP parser allocates the whole canvas when it opens a file: never here
        alpha = sniff.webp_alpha(data)
        return ImageHeader(len(data), fmt, sniff.declared_size("WEBP", data), plain_jpeg=False,
                           plain_rgb=None if alpha is None else not alpha)
    scans = sniff.count_scans(data, limits) if fmt == "JPEG" else 0
    if scans is None:  # PIL's parser walks the segments before the first scan in Python: 3 s per million
        return ImageHeader(len(data), fmt, None, plain_jpeg=False, scans=None)
    size, plain, plain_rgb = None, False, None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            with Image.open(io.BytesIO(data), formats=SUPPORTED_FORMATS) as img:
                size = img.size
                plain = fmt == "JPEG" and _is_plain_jpeg(img)
                plain_rgb = img.mode == "RGB" and "transparency" not in img.info
        except Exception:  # noqa: BLE001 - whatever the header's fault: the decode says what it is
            pass
    # simplejpeg never sees what decode_image refuses on its byte count alone (empty, over max_image_bytes),
    # nor a JPEG of more scans than sniff.FAST_JPEG_SCANS: it cannot be stopped, PIL's decode can (_Budgeted).
    plain = plain and 0 < len(data) <= limits.max_image_bytes and scans <= sniff.FAST_JPEG_SCANS
    return ImageHeader(len(data), fmt, size, plain_jpeg=plain, scans=scans, plain_rgb=plain_rgb)


def check_complexity(header: ImageHeader, limits: ImageLimits) -> None:
    """`image_too_complex` for a JPEG of more scans than limits.max_jpeg_scans (or of more marker segments than
    are worth counting): from the header alone, before a queue place or a decode is spent on it."""
    if header.scans is None:
        raise ImageError(
            f"the JPEG has more than {sniff.max_jpeg_segments(sniff.most_scans(limits)):,} marker segments (a photograph "
            "has a few dozen); re-encode it", code="image_too_complex")
    if header.scans > limits.max_jpeg_scans:
        raise ImageError(
            f"the JPEG has more than {limits.max_jpeg_scans} scans (a progressive JPEG has about 10, a baseline "
            "one 1), and each scan is a pass over the whole image; re-encode it as a baseline JPEG, or raise "
            "--max-jpeg-scans", code="image_too_complex")


def _is_plain_jpeg(img: ImageFile.ImageFile) -> bool:
    """A JPEG (PIL names one with a multi-picture index MPO) of YCbCr / RGB pixels, no EXIF orientation to apply."""
    if img.format != "JPEG" or img.mode != "RGB":
        return False
    try:
        return img.getexif().get(ImageOps.ExifTags.Base.Orientation, 1) == 1
    except Exception:  # noqa: BLE001 - malformed EXIF: PIL's path meets it again (exif_transpose) and names it
        return False


def header_tokens(header: ImageHeader, params: PreprocessParams, limits: ImageLimits) -> int:
    """The output tokens this image will take, from its header alone (nothing decoded): what admission
    counts before the image is decoded.

    1 when the header does not give an acceptable size: decoding will refuse the image with the reason,
    and until then it costs a queue place, not pixels. EXIF orientation does not matter: smart_resize
    is symmetric in height and width, so a transposed image has the same number of tokens."""
    if header.size is None:
        return 1
    try:
        _check_geometry(header.size, limits)
        height, width = preprocess.smart_resize(header.size[1], header.size[0], params)
    except ImageError:
        return 1
    return preprocess.num_tokens(preprocess.grid_for(height, width, params), params)


def prepare_image(data: bytes, params: PreprocessParams, limits: ImageLimits, header: ImageHeader | None = None,
                  out: PixelsOut | None = None) -> PreparedImage:
    """Encoded image bytes -> PreparedImage. Raises an ImageError subclass for bad input.

    header: `read_header(data, limits)` if the caller has it (admission read it): not parsed again then.
    out: where the pixels go (PixelsOut), called once, when their final size is known, and decoded or
      resized straight into, so that `pixels` is a [H', W', 3] view of its buffer; what it raises (a full
      arena) propagates as it is. If prepare_image raises after calling it, the buffer is still the
      caller's to release. Without it the pixels are a new array. The same pixels either way.
    """
    # The decode's budget starts now: what it costs before PIL's decode (a header parse) counts too.
    deadline = time.monotonic() + limits.decode_timeout_s
    if header is None and sniff.sniff_format(data) == "JPEG":
        # Only a JPEG's header picks its path: any other image goes to PIL's open (its one parse) at once.
        header = read_header(data, limits)
    assert header is None or header.nbytes == len(data), "a header read from other bytes: this is a bug"
    dest = _Destination(out)
    pixels = None
    if header is not None and header.plain_jpeg:
        check_complexity(header, limits)  # (sniff.FAST_JPEG_SCANS may be over a lowered --max-jpeg-scans)
        pixels = _decode_plain_jpeg(data, header.size, params, limits, dest)
    if pixels is None:
        img = decode_image(data, limits, header, deadline)
        new_h, new_w = preprocess.smart_resize(img.height, img.width, params)  # (what resize raises, it raises first)
        pixels = preprocess.resize(img, params, out=dest.get(new_h, new_w))
    grid = preprocess.grid_for(pixels.shape[0], pixels.shape[1], params)
    return PreparedImage(
        pixels=pixels,
        grid_thw=grid,
        num_patches=preprocess.num_patches(grid),
        num_tokens=preprocess.num_tokens(grid, params),
    )


class _Destination:
    """prepare_image's `out`, called at most once: a fallback to PIL after simplejpeg refused the data
    writes into the buffer the fast path already took (the same size: the same header)."""

    def __init__(self, out: PixelsOut | None):
        self._out = out
        self._pixels: np.ndarray | None = None  # [H', W', 3] uint8 view of out's buffer, once called

    def get(self, height: int, width: int) -> np.ndarray | None:
        """[height, width, 3] uint8 over out's buffer, or None without out (the decoder allocates)."""
        if self._out is None:
            return None
        if self._pixels is None:
            nbytes = height * width * 3
            flat = self._out(nbytes)
            assert flat.dtype == np.uint8 and flat.shape == (nbytes,) and flat.flags.writeable, (
                f"out({nbytes}) gave a {flat.dtype} array of shape {flat.shape}: it must be a writable flat uint8 "
                "array of exactly that size (this is a bug)")
            self._pixels = flat.reshape(height, width, 3)
        assert self._pixels.shape == (height, width, 3), "one image, one final size: this is a bug"
        return self._pixels


try:  # optional: a faster decoder for the most common input (see _decode_plain_jpeg)
    import simplejpeg as _simplejpeg
except ImportError:  # pragma: no cover - it is a dependency; a build without it takes PIL's path
    _simplejpeg = None


def _decode_plain_jpeg(data: bytes, size: tuple[int, int], params: PreprocessParams, limits: ImageLimits,
                       dest: _Destination) -> np.ndarray | None:
    """[H', W', 3] uint8 final pixels of a plain JPEG decoded by simplejpeg, or None: take decode_image's path.

    Why: PIL's decode plus its packing of RGBX into RGB bytes (Image.tobytes) cost ~1.5 ms of a 448px
    JPEG's ~2 ms in an API process, much of it holding the GIL; simplejpeg decodes straight into a numpy
    array with the same libjpeg-turbo settings as PIL (islow DCT, fancy upsampling), bit-identical on
    the corpus in tests/unit/media/test_images.py (4:4:4, 4:2:2, 4:2:0, baseline and progressive, real photos).
    Plain means (read_header): PIL's header parser calls it a JPEG (not an MPO) with YCbCr / RGB pixels
    (mode RGB) and no EXIF orientation to apply. Grayscale, CMYK, rotated and MPO files, and anything
    simplejpeg refuses (corrupt or truncated data: its strict mode errs on libjpeg's warnings), go through
    PIL, which says what is wrong. The checks before any pixel is decoded are decode_image's.
    An image that needs no resize is decoded into out's buffer (dest): its final pixels, in place."""
    if _simplejpeg is None:
        return None
    _check_geometry(size, limits)  # the header's size is what simplejpeg decodes: refuse a bomb first
    width, height = size
    try:
        target = preprocess.smart_resize(height, width, params)
    except ImageError:  # aspect_ratio_too_extreme: over the model's 200:1 (a looser --max-aspect-ratio): PIL's path says so, after its decode
        return None
    # Called before the decode (the header gives the size), outside the try: out's errors are not simplejpeg's.
    into = dest.get(height, width) if target == (height, width) else None
    try:
        rgb = _simplejpeg.decode_jpeg(data, colorspace="RGB", buffer=into)
    except Exception:  # noqa: BLE001 - whatever it is (corrupt, truncated), decode_image meets it again and names it
        return None
    if rgb.shape != (height, width, 3) or not rgb.flags.c_contiguous:
        return None
    if into is not None:
        return into  # rgb is a view of it: the final pixels, decoded in place
    if target == (height, width):
        return rgb  # PIL's resize to the same size is a copy: the same pixels
    return preprocess.resize(Image.fromarray(rgb), params, out=dest.get(*target))


def decode_image(data: bytes, limits: ImageLimits, header: ImageHeader | None = None,
                 deadline: float | None = None) -> Image.Image:
    """Encoded bytes -> an RGB PIL image, EXIF orientation applied, first frame of animations.

    The RGB conversion is transformers' (transparency composited on white), see preprocess.to_rgb.
    header: `read_header(data, limits)` if the caller has it (a JPEG's scans are not counted again).
    deadline: time.monotonic() past which the decode is stopped (`image_too_complex`); default
    limits.decode_timeout_s from now.
    """
    if deadline is None:
        deadline = time.monotonic() + limits.decode_timeout_s
    if len(data) == 0:
        raise ImageError("the image is empty (0 bytes); send the encoded file's bytes", code="empty_image")
    if len(data) > limits.max_image_bytes:
        raise ImageError(
            f"the encoded image is {_mb(len(data))}, over the limit of {_mb(limits.max_image_bytes)}; "
            "compress or downscale it, or raise --max-image-bytes", code="image_too_large"
        )
    sniffed = sniff.sniff_format(data)
    if sniffed == "JPEG":  # before PIL's parser walks its segments, and before any scan is decoded
        scans = header.scans if header is not None else sniff.count_scans(data, limits)
        check_complexity(ImageHeader(len(data), sniffed, None, False, scans), limits)
    if sniffed == "WEBP" and (declared := sniff.declared_size("WEBP", data)) is not None:
        # Before PIL sees the file: PIL's WebP parser allocates the whole canvas when it opens it.
        _check_geometry(declared, limits)

    # NOTE: our max_input_pixels check below is the limit; PIL's own decompression-bomb warning (above
    # Image.MAX_IMAGE_PIXELS) is silenced so it never surfaces as a warning, and its hard error (above
    # twice that) becomes `image_too_large`. PIL's other UserWarnings are about damage it recovered from
    # (e.g. "Corrupt EXIF data" in a TIFF): per-request noise, not actionable in the server log.
    # catch_warnings touches process-global state: fine in the decode worker processes, which handle
    # one image at a time; called from several threads at once, a warning could at worst leak.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        warnings.filterwarnings("ignore", category=UserWarning, module=r"PIL\.")
        img = _open(data, sniffed, limits, deadline)
        _check_geometry(img.size, limits)
        _load(img, data)
        img = _apply_exif_orientation(img)
    try:
        return preprocess.to_rgb(img)
    except ValueError as e:  # a pixel mode PIL cannot convert (e.g. 'La')
        raise ImageError(
            f"{img.format} image with pixel mode {img.mode!r} cannot be converted to RGB ({e}); "
            "re-encode it as 8-bit RGB or RGBA", code="unsupported_format"
        ) from e


def loaded_pid() -> int:
    """A decode worker's pid, answered once this module (and what prepare_image needs) is imported there:
    the probe that puts a new decode pool on the stall clock (procs/decoders.py). A bare os.getpid answered
    before those imports, and a fresh pool's first decode, paying seconds for them on a loaded machine,
    read as a stuck pool."""
    return os.getpid()


def warmup_png() -> bytes:
    """A synthetic image of Qwen3-VL's minimum size (256x256 = 65536 pixels): start-up decodes and encodes
    it once, so that the first client's image does not pay for the imports, worker starts and kernels."""
    rng = np.random.default_rng(0)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (256, 256, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def warmup_image(params: PreprocessParams) -> PreparedImage:
    """warmup_png prepared for the step loop's warm-up encode."""
    return prepare_image(warmup_png(), params, ImageLimits())


# ---- stages ---------------------------------------------------------------------------------------


def _open(data: bytes, sniffed: str | None, limits: ImageLimits, deadline: float) -> ImageFile.ImageFile:
    """Parse the header with the supported formats' parsers only; nothing is decoded yet. The image reads
    its data through _Budgeted: its decode (load) stops past `deadline`."""
    try:
        img = Image.open(_Budgeted(data, deadline, limits.decode_timeout_s), formats=SUPPORTED_FORMATS)
    except UnidentifiedImageError:
        raise _unidentified(data, sniffed) from None
    except Image.DecompressionBombError as e:
        # over twice Image.MAX_IMAGE_PIXELS: name the size where we can read it from the header ourselves
        declared = sniff.declared_size(sniffed, data) if sniffed is not None else None
        if declared is not None:
            _check_geometry(declared, limits)  # our limit, our message, if it is the one exceeded
        raise _pil_bomb_error(e, declared) from e
    except (OSError, *_PIL_DATA_ERRORS) as e:  # e.g. "Truncated File Read", "could not create decoder object"
        raise _data_error(sniffed or "image", data, e, stage="header") from e
    fmt = _FORMAT_ALIASES.get(img.format, img.format)
    assert fmt in SUPPORTED_FORMATS, f"Image.open(formats=SUPPORTED_FORMATS) returned {img.format}: this is a bug"
    return img


def _check_geometry(size: tuple[int, int], limits: ImageLimits) -> None:
    width, height = size
    if width <= 0 or height <= 0:
        raise ImageError(f"the image header declares a size of {width}x{height}; the file is corrupt", code="corrupt_image")
    pixels = width * height
    if pixels > limits.max_input_pixels:
        raise ImageError(
            f"image is {width}x{height} = {pixels / 1e6:.1f}M pixels, over the limit of "
            f"{limits.max_input_pixels / 1e6:.1f}M; downscale it or raise --max-input-pixels", code="image_too_large"
        )
    ratio = max(width, height) / min(width, height)
    if ratio > limits.max_aspect_ratio:
        raise ImageError(
            f"image is {width}x{height}, an aspect ratio of {ratio:.1f}:1, over the limit of "
            f"{limits.max_aspect_ratio:g}:1; crop or pad it to a less extreme shape", code="aspect_ratio_too_extreme"
        )


def _load(img: ImageFile.ImageFile, data: bytes) -> None:
    """Decode the pixels (the first frame of an animation: Image.open leaves the file on frame 0), within the
    deadline its file (_Budgeted) enforces."""
    fmt = _FORMAT_ALIASES.get(img.format, img.format)
    budget = img.fp if isinstance(img.fp, _Budgeted) else None  # (load drops img.fp)
    if budget is not None:
        budget.split_scans = fmt == "JPEG"
    try:
        img.load()
    except Image.DecompressionBombError as e:  # GIF frames can be larger than the logical screen
        raise _pil_bomb_error(e) from e
    except (OSError, *_PIL_DATA_ERRORS) as e:
        raise _data_error(fmt, data, e, stage="pixels") from e
    if budget is not None:
        budget.check()  # the last chunk's decode (a progressive JPEG's whole output pass) ran past it


class _Budgeted(io.BytesIO):
    """The file PIL parses and decodes an image from: a read past `deadline` raises `image_too_complex`.

    Why this stops a decode: PIL's ImageFile.load feeds its decoder the file in chunks (decodermaxblock,
    64 KiB), and libjpeg (a suspending source), zlib (PNG), GIF's LZW and BMP's RLE decode each chunk and
    return for the next, with the GIL released meanwhile; a raise between chunks ends the decode and frees
    the decoder. Decoders that take the whole file at once (WebP, libtiff's TIFF) are bounded by their pixels.

    With `split_scans` (a JPEG's load; never its header parse, whose reads must return all they ask for),
    a chunk also ends before each scan (SOS marker), so that one chunk is never hundreds of scans: a scan
    of a few bytes is a pass over the whole image (20 ms at 16 MP), and 64 KiB of such scans were 40 s in
    one chunk. Measured on a 16 MP (64 MP) scan bomb: at most 64 ms (129 ms) between two reads."""

    def __init__(self, data: bytes, deadline: float, timeout_s: float):
        super().__init__(data)  # (shares the bytes: no copy until written)
        self._data, self._deadline, self._timeout_s = data, deadline, timeout_s
        self.split_scans = False

    def check(self) -> None:
        if time.monotonic() > self._deadline:
            raise ImageError(
                f"decoding the image took over {self._timeout_s:g} s, its limit (a JPEG of many progressive scans "
                "is the usual cause); re-encode it as a baseline JPEG or PNG, downscale it, or raise --decode-timeout-s", code="image_too_complex")

    def read(self, size: int | None = -1) -> bytes:
        self.check()
        if self.split_scans and size is not None and size > 0:
            start = self.tell()
            # (a marker's 0xFF may also appear in an APP segment: then a chunk ends early, which is harmless)
            if (sos := self._data.find(b"\xff\xda", start + 1, start + size)) != -1:
                size = sos - start
        return super().read(size)


def _apply_exif_orientation(img: Image.Image) -> Image.Image:
    try:
        # in_place: no copy of the pixels when there is nothing to do (the common case)
        ImageOps.exif_transpose(img, in_place=True)
    except (OSError, *_PIL_DATA_ERRORS) as e:
        raise ImageError(
            f"the {img.format} image's EXIF metadata is malformed ({e}); strip the metadata or re-save the image", code="corrupt_image"
        ) from e
    return img


# ---- classification of failures -------------------------------------------------------------------


def _unidentified(data: bytes, sniffed: str | None) -> Exception:
    """PIL's supported parsers all refused the file: a broken supported file, another format, or no image."""
    if sniffed is not None:
        reason = _header_failure_reason(sniffed, data)
        if sniff.looks_truncated(sniffed, data):
            return ImageError(
                f"the data starts like a {sniffed} file but ends before its header does ({reason}); "
                "the file was cut off: send the complete file", code="truncated_image"
            )
        return ImageError(
            f"the data starts like a {sniffed} file but its header cannot be read ({reason}): the file is "
            f"corrupt or a {sniffed} variant that is not supported; re-encode it as PNG or JPEG", code="corrupt_image"
        )
    other = _identify_any_format(data)
    if other is not None:
        return ImageError(
            f"image format {other} is not supported; supported formats: {_SUPPORTED_TEXT}. Convert it to one of them", code="unsupported_format"
        )
    head = data[:16]
    return ImageError(
        f"the data is not an image in any known format ({len(data)} bytes starting {head!r}); "
        f"send the raw bytes of a {_SUPPORTED_TEXT} file", code="not_an_image"
    )


def _data_error(fmt: str, data: bytes, e: Exception, stage: str) -> Exception:
    """A parser or decoder failure on a file whose format is known: truncated or corrupt."""
    truncated = isinstance(e, EOFError) or "truncated" in str(e).lower() or sniff.looks_truncated(fmt, data)
    if truncated:
        return ImageError(
            f"the {fmt} file is truncated: its data ends before the image does ({_describe(e)}); "
            "send the complete file", code="truncated_image"
        )
    where = "header" if stage == "header" else "image data"
    return ImageError(
        f"the {fmt} file is corrupt: its {where} cannot be decoded ({_describe(e)}); re-encode or re-upload the image", code="corrupt_image"
    )


def _pil_bomb_error(e: Exception, size: tuple[int, int] | None = None) -> ImageError:
    """PIL refused the size itself: above 2 * Image.MAX_IMAGE_PIXELS, whatever --max-input-pixels says."""
    limit = 2 * (Image.MAX_IMAGE_PIXELS or 0)
    if size is not None and size[0] * size[1] <= limit:
        size = None  # PIL refused some other size than the one we read (e.g. a GIF frame bigger than its screen)
    if size is None:
        return ImageError(f"image is over PIL's decompression-bomb limit ({e}); downscale it", code="image_too_large")
    return ImageError(
        f"image is {size[0]}x{size[1]} = {size[0] * size[1] / 1e6:.1f}M pixels, over PIL's decompression-bomb "
        f"limit of {limit / 1e6:.1f}M (2 x Image.MAX_IMAGE_PIXELS); downscale it", code="image_too_large"
    )


def _header_failure_reason(fmt: str, data: bytes) -> str:
    """PIL's own reason for refusing the header (Image.open discards it)."""
    if (size := sniff.declared_size(fmt, data)) is not None and min(size) <= 0:
        return f"it declares a size of {size[0]}x{size[1]}"
    try:
        _PLUGINS[fmt](io.BytesIO(data)).close()
    except (OSError, *_PIL_DATA_ERRORS) as e:
        return _describe(e)
    return "unknown reason"  # the parser accepted it alone; Image.open's checks refused it


def _identify_any_format(data: bytes) -> str | None:
    """The format name if any PIL parser (supported or not) recognises the header, else None."""
    try:
        with Image.open(io.BytesIO(data)) as img:
            return img.format
    except (OSError, Image.DecompressionBombError, *_PIL_DATA_ERRORS):
        return None


def _describe(e: Exception) -> str:
    text = str(e)
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _mb(n: int) -> str:
    return f"{n:,} bytes ({n / (1024 * 1024):.1f} MiB)"
