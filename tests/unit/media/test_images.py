"""service.media.images: every kind of bad input gets its own error, code and actionable message; every
supported format decodes to the right pixels; limits are enforced from the header."""

from __future__ import annotations

import functools
import io
import pickle
import time

import numpy as np
import pytest
from PIL import Image, ImageFile

from service.media import images, preprocess

from service.media.params import ImageLimits, PreprocessParams
from service.errors import http_status, ImageError
from service.media.images import ImageHeader, PreparedImage, decode_image, header_tokens, prepare_image, read_header
from tests.support.imagedata import (
    SKIMAGE_DATA,
    bad_images,
    encode,
    exif_rotated,
    gif_bytes,
    jpeg_marker_flood,
    png_header_only,
    progressive_photo,
    quadrants,
    scan_bomb,
    shaped_png,
    textured_rgb,
    truncated,
    valid_images,
    webp_declaring,
)
from tests.support.errors import raises_code

P = PreprocessParams()
LIMITS = ImageLimits()


def _raises(data: bytes, code: str, limits: ImageLimits = LIMITS) -> ImageError:
    with raises_code(ImageError, code) as info:
        decode_image(data, limits)
    err = info.value
    assert 400 <= http_status(err) < 500  # never a 500 for something the client sent
    return err


# ---- one test per kind of bad input -----------------------------------------------------------------------


@pytest.mark.filterwarnings("error")  # nothing PIL says may escape as a warning
@pytest.mark.parametrize("name", list(bad_images()))
def test_bad_image_raises_its_error(name):
    data, code, fact = bad_images()[name]
    err = _raises(data, code)
    assert fact in err.message, err.message
    # prepare_image (what the decode workers run) raises the same error, given the header admission read or not
    for header in (None, read_header(data, LIMITS)):
        with raises_code(ImageError, code) as info:
            prepare_image(data, P, LIMITS, header=header)
        assert info.value.message == err.message


def test_empty():
    err = _raises(b"", "empty_image")
    assert err.code == "empty_image" and "0 bytes" in err.message


def test_not_an_image_shows_the_start_of_the_data():
    err = _raises(b'{"url": "https://example.com/cat.png"}', "not_an_image")
    assert err.code == "not_an_image"
    assert "{\"url\": " in err.message and "PNG" in err.message  # what we got, and what to send


def test_unsupported_format_names_it_and_the_supported_list():
    err = _raises(encode(textured_rgb(16, 16), "ICO"), "unsupported_format")
    assert err.code == "unsupported_format" and http_status(err) == 415
    assert "ICO" in err.message
    for fmt in ("JPEG", "PNG", "WebP", "GIF", "BMP", "TIFF"):
        assert fmt in err.message


def test_over_max_bytes_is_checked_before_anything_else():
    data = encode(textured_rgb(64, 64), "BMP")  # 12 KiB
    err = _raises(data, "image_too_large", ImageLimits(max_image_bytes=4096))
    assert err.code == "image_too_large" and http_status(err) == 413
    assert f"{len(data):,} bytes" in err.message and "4,096 bytes" in err.message
    assert "--max-image-bytes" in err.message
    _raises(b"x" * 5000, "image_too_large", ImageLimits(max_image_bytes=4096))  # even when it is not an image


def test_decompression_bomb_is_refused_from_the_header():
    err = _raises(png_header_only(9000, 9000), "image_too_large")
    assert "9000x9000 = 81.0M pixels" in err.message and "64.0M" in err.message
    assert "--max-input-pixels" in err.message


@pytest.mark.filterwarnings("error")
def test_pil_bomb_warning_range_never_warns():
    # 10000x10000 = 100M is over Image.MAX_IMAGE_PIXELS (89.5M): PIL warns, we raise our error instead.
    assert 10000 * 10000 > Image.MAX_IMAGE_PIXELS
    err = _raises(png_header_only(10000, 10000), "image_too_large")
    assert "10000x10000 = 100.0M pixels" in err.message


@pytest.mark.filterwarnings("error")
def test_pil_bomb_error_range_becomes_our_error():
    # 20000x10000 = 200M is over 2 * Image.MAX_IMAGE_PIXELS: PIL raises DecompressionBombError in open
    assert 20000 * 10000 > 2 * Image.MAX_IMAGE_PIXELS
    err = _raises(png_header_only(20000, 10000), "image_too_large", ImageLimits(max_input_pixels=10**9))
    assert "20000x10000 = 200.0M pixels" in err.message and "179.0M" in err.message
    # a format whose size we do not read ourselves: PIL's message, still our error
    tiff = bytearray(encode(Image.new("L", (8, 8)), "TIFF"))
    err = _raises(_tiff_with_size(bytes(tiff), 20000, 10000), "image_too_large", ImageLimits(max_input_pixels=10**9))
    assert "decompression-bomb" in err.message and "200000000 pixels" in err.message


@pytest.mark.filterwarnings("error")
def test_pil_bomb_limits_do_not_override_ours(monkeypatch):
    # With Image.MAX_IMAGE_PIXELS low, an image over PIL's warning threshold but within our limit
    # decodes silently; one over PIL's hard limit is refused as "image_too_large".
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)
    assert decode_image(encode(textured_rgb(40, 40), "PNG"), LIMITS).size == (40, 40)  # 1600 > 1000
    err = _raises(encode(textured_rgb(50, 50), "JPEG"), "image_too_large")  # 2500 > 2000
    assert "decompression-bomb" in err.message


def test_webp_canvas_is_checked_before_pil_opens_it(monkeypatch):
    # PIL's WebP parser allocates the whole canvas at open: our check must come first.
    def no_open(*args, **kwargs):
        raise AssertionError("Image.open called for an oversized WebP")

    monkeypatch.setattr(Image, "open", no_open)
    err = _raises(webp_declaring(16000, 16000), "image_too_large")
    assert "16000x16000 = 256.0M pixels" in err.message


def test_extreme_aspect_ratio_is_refused_from_the_header():
    err = _raises(png_header_only(4020, 20), "aspect_ratio_too_extreme")  # no pixel data: only the header was read
    assert err.code == "aspect_ratio_too_extreme" and http_status(err) == 422
    assert "4020x20" in err.message and "201.0:1" in err.message and "200:1" in err.message
    # exactly 200 is allowed (transformers raises only above 200)
    assert decode_image(shaped_png(4000, 20), LIMITS).size == (4000, 20)
    # a stricter configured limit
    err = _raises(shaped_png(4000, 40), "aspect_ratio_too_extreme", ImageLimits(max_aspect_ratio=50))
    assert "100.0:1" in err.message and "50:1" in err.message


def test_model_aspect_ratio_limit_applies_even_if_the_service_limit_is_looser():
    # the header check uses the configured limit; smart_resize still enforces the model's 200
    data = shaped_png(4020, 20)
    assert decode_image(data, ImageLimits(max_aspect_ratio=1000)).size == (4020, 20)
    with raises_code(ImageError, "aspect_ratio_too_extreme", match="model's limit of 200:1"):
        prepare_image(data, P, ImageLimits(max_aspect_ratio=1000))


def test_zero_size_image_is_corrupt():
    err = _raises(png_header_only(0, 20), "corrupt_image")
    assert "0x20" in err.message


@pytest.mark.filterwarnings("error")
@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF"])
@pytest.mark.parametrize("keep", [30, 0.3, 0.6, 0.95])
def test_truncated_file_of_each_format(fmt, keep):
    img = textured_rgb(64, 48).quantize(colors=64) if fmt == "GIF" else textured_rgb(64, 48)
    data = encode(img, fmt)
    cut = data[:keep] if isinstance(keep, int) else truncated(data, keep)
    err = _raises(cut, "truncated_image")
    assert err.code == "truncated_image"
    assert fmt in err.message and "complete file" in err.message


def test_truncated_images_are_not_loaded_leniently():
    # PIL would fill a truncated image with grey if this were on; nothing we import may turn it on.
    import transformers  # noqa: F401

    assert ImageFile.LOAD_TRUNCATED_IMAGES is False


def test_corrupt_png_and_jpeg_bodies():
    err = _raises(bad_images()["corrupt_png_idat"][0], "corrupt_image")
    assert "PNG" in err.message and "corrupt" in err.message
    err = _raises(bad_images()["corrupt_jpeg"][0], "corrupt_image")
    assert "JPEG" in err.message and "corrupt" in err.message


def test_tiff_variant_pil_cannot_read_is_reported_with_pils_reason():
    # scikit-image's multipage_rgb.tif is a real TIFF whose pixel layout PIL does not support
    err = _raises((SKIMAGE_DATA / "multipage_rgb.tif").read_bytes(), "corrupt_image")
    assert "TIFF" in err.message and "unknown pixel mode" in err.message


def test_mode_pil_cannot_convert_is_unsupported(monkeypatch):
    def refuse(img):
        raise ValueError("conversion from La to RGB not supported")

    monkeypatch.setattr(preprocess, "to_rgb", refuse)
    err = _raises(encode(textured_rgb(16, 16), "PNG"), "unsupported_format")
    assert "'RGB'" in err.message and "re-encode" in err.message


def test_errors_survive_pickling():
    # decode workers are processes: errors cross back pickled
    err = _raises(png_header_only(9000, 9000), "image_too_large")
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is ImageError and back.message == err.message and back.code == "image_too_large"


# ---- good input -------------------------------------------------------------------------------------------


@pytest.mark.filterwarnings("error")
@pytest.mark.parametrize("name", list(valid_images()))
def test_valid_image_decodes_to_rgb(name):
    data = valid_images()[name]
    img = decode_image(data, LIMITS)
    assert img.mode == "RGB"
    raw = Image.open(io.BytesIO(data))
    assert img.size in (raw.size, raw.size[::-1])  # swapped only by EXIF orientation


@pytest.mark.parametrize(
    ("fmt", "kwargs", "tolerance"),
    [
        ("PNG", {}, 0),
        ("BMP", {}, 0),
        ("TIFF", {}, 0),
        ("TIFF", {"compression": "tiff_lzw"}, 0),
        ("GIF", {}, 0),
        ("WEBP", {"lossless": True}, 0),
        ("WEBP", {"quality": 90}, 24),
        ("JPEG", {"quality": 95}, 8),
    ],
)
def test_every_supported_format_decodes_its_pixels(fmt, kwargs, tolerance):
    original = np.asarray(quadrants(64, 48)).astype(int)
    decoded = np.asarray(decode_image(encode(quadrants(64, 48), fmt, **kwargs), LIMITS)).astype(int)
    assert decoded.shape == (48, 64, 3)
    # away from the colour edges (lossy codecs blur them)
    inner = (slice(4, 20), slice(4, 28)), (slice(4, 20), slice(36, 60)), (slice(28, 44), slice(4, 28))
    for rows, cols in inner:
        assert np.abs(decoded[rows, cols] - original[rows, cols]).max() <= tolerance


def test_mpo_jpeg_decodes_as_its_first_picture():
    # Most phone cameras write MPO (JPEG + a multi-picture index); PIL names it "MPO"
    first, second = quadrants(64, 48), textured_rgb(64, 48)
    data = encode(first, "MPO", save_all=True, append_images=[second], quality=95)
    assert Image.open(io.BytesIO(data)).format == "MPO"
    decoded = np.asarray(decode_image(data, LIMITS)).astype(int)
    assert np.abs(decoded[4:20, 4:28] - [255, 0, 0]).max() <= 8  # the red quadrant of the first picture


@pytest.mark.parametrize("fmt", ["JPEG", "PNG"])
def test_exif_orientation_6_rotates_clockwise(fmt):
    data = exif_rotated(fmt, 6)  # stored 96x64, displayed 64x96
    stored = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
    assert stored.shape == (64, 96, 3)
    img = decode_image(data, LIMITS)
    assert img.size == (64, 96)  # (w, h): swapped
    decoded = np.asarray(img)
    np.testing.assert_array_equal(decoded, np.rot90(stored, k=-1))  # exactly the clockwise rotation
    # stored top-left is red, bottom-left blue: after a clockwise turn, blue is top-left, red top-right
    assert np.abs(decoded[5, 5].astype(int) - [0, 0, 255]).max() <= 8
    assert np.abs(decoded[5, 58].astype(int) - [255, 0, 0]).max() <= 8


def test_exif_orientation_8_rotates_counterclockwise():
    data = exif_rotated("PNG", 8)
    stored = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
    decoded = np.asarray(decode_image(data, LIMITS))
    np.testing.assert_array_equal(decoded, np.rot90(stored, k=1))
    assert decoded[5, 5].tolist() == [0, 255, 0]  # stored top-right (green) is now top-left


def test_exif_orientation_sets_prepared_geometry():
    prepared = prepare_image(exif_rotated("JPEG", 6), P, LIMITS)  # stored 96x64, displayed 64x96
    assert prepared.pixels.shape == (320, 224, 3) and prepared.grid_thw == (1, 20, 14)  # (224, 320, 3) unrotated


def test_gif_decodes_its_first_frame():
    data = gif_bytes(animated=True)
    frames = Image.open(io.BytesIO(data))
    assert frames.n_frames == 3
    first = np.asarray(frames.convert("RGB"))
    frames.seek(1)
    second = np.asarray(frames.convert("RGB"))
    decoded = np.asarray(decode_image(data, LIMITS))
    np.testing.assert_array_equal(decoded, first)
    assert not np.array_equal(decoded, second)


def test_transparency_is_composited_on_white():
    decoded = np.asarray(decode_image(valid_images()["palette_transparent.png"], LIMITS))
    palette = Image.open(io.BytesIO(valid_images()["palette_transparent.png"]))
    transparent = np.asarray(palette) == 3  # the transparent palette index
    assert transparent.any() and (decoded[transparent] == 255).all()
    rgba = np.asarray(decode_image(valid_images()["rgba.png"], LIMITS))  # alpha ramps 0 -> 255 along x
    assert (rgba[:, 0] == 255).all()  # alpha 0: white
    original = np.asarray(Image.open(io.BytesIO(valid_images()["rgba.png"])))
    np.testing.assert_array_equal(rgba[:, -1], original[:, -1, :3])  # alpha 255: the colour itself


def test_cmyk_16bit_1bit_and_la_decode_to_rgb():
    for name, size in [("cmyk.jpg", (120, 90)), ("i16.png", (96, 64)), ("1bit.png", (80, 80)), ("la.png", (64, 72))]:
        img = decode_image(valid_images()[name], LIMITS)
        assert img.mode == "RGB" and img.size == size, name
    bits = np.asarray(decode_image(valid_images()["1bit.png"], LIMITS))
    assert set(np.unique(bits).tolist()) == {0, 255}


# ---- PreparedImage ---------------------------------------------------------------------------------------


def test_prepared_image_fields():
    prepared = prepare_image(valid_images()["astronaut.png"], P, LIMITS)
    assert prepared.pixels.shape == (512, 512, 3) and prepared.pixels.dtype == np.uint8
    assert prepared.pixels.flags.c_contiguous
    assert prepared.grid_thw == (1, 32, 32) and prepared.num_patches == 1024 and prepared.num_tokens == 256
    tiny = prepare_image(valid_images()["tiny_10x7.png"], P, LIMITS)
    assert tiny.pixels.shape == (224, 320, 3) and tiny.num_tokens == 70  # 10x7 upscaled to min_pixels


def test_prepared_image_and_function_are_picklable():
    prepared = prepare_image(valid_images()["chelsea.png"], P, LIMITS)
    back = pickle.loads(pickle.dumps(prepared))
    assert isinstance(back, PreparedImage) and back.grid_thw == prepared.grid_thw
    np.testing.assert_array_equal(back.pixels, prepared.pixels)
    assert pickle.loads(pickle.dumps(prepare_image)) is prepare_image  # module-level: process pools can ship it


# ---- helpers ----------------------------------------------------------------------------------------------


def _tiff_with_size(data: bytes, width: int, height: int) -> bytes:
    """Patch ImageWidth (256) and ImageLength (257) of a little-endian TIFF's first IFD."""
    import struct

    out = bytearray(data)
    assert out[:4] == b"II*\x00"
    ifd = struct.unpack("<I", out[4:8])[0]
    (count,) = struct.unpack("<H", out[ifd : ifd + 2])
    for i in range(count):
        entry = ifd + 2 + 12 * i
        tag, typ = struct.unpack("<HH", out[entry : entry + 4])
        if tag in (256, 257):
            value = width if tag == 256 else height
            fmt = "<H" if typ == 3 else "<I"
            out[entry + 8 : entry + 12] = struct.pack(fmt, value).ljust(4, b"\x00")
    return bytes(out)


def test_header_tokens_are_the_tokens_decoding_gives_without_decoding():
    from tests.support import imagedata as data

    params, limits = PreprocessParams(), ImageLimits()

    def tokens(blob: bytes) -> int:
        return header_tokens(read_header(blob, limits), params, limits)

    for name, blob in data.valid_images().items():
        assert tokens(blob) == prepare_image(blob, params, limits).num_tokens, name
    # what decoding would refuse costs one token until the decode says why
    for blob in (b"", b"not an image", data.png_header_only(9000, 9000), data.png_header_only(4020, 20),
                 data.png_header_only(0, 20), data.webp_declaring(16000, 16000), data.png_header_only(20000, 10000)):
        assert tokens(blob) == 1
    assert tokens(data.webp_declaring(4000, 4000)) == 15625  # read, never allocated


# ---- the header, parsed once ---------------------------------------------------------------------------


def test_read_header_names_the_format_the_declared_size_and_whether_simplejpeg_may_decode_it(monkeypatch):
    plain = encode(textured_rgb(64, 48), "JPEG", quality=90)
    assert read_header(plain, LIMITS) == ImageHeader(len(plain), "JPEG", (64, 48), plain_jpeg=True, scans=1,
                                                      plain_rgb=True)
    rotated = exif_rotated("JPEG", 6)
    assert read_header(rotated, LIMITS) == ImageHeader(len(rotated), "JPEG", (96, 64), False, 1, True)  # as stored
    mpo = encode(quadrants(64, 48), "MPO", save_all=True, append_images=[textured_rgb(64, 48)])
    for data in (encode(textured_rgb(64, 48).convert("L"), "JPEG"), valid_images()["cmyk.jpg"], mpo):
        header = read_header(data, LIMITS)
        assert header.format == "JPEG" and header.size is not None and not header.plain_jpeg
    assert not read_header(plain, ImageLimits(max_image_bytes=len(plain) - 1)).plain_jpeg  # decode refuses it
    png = valid_images()["astronaut.png"]
    assert read_header(png, LIMITS) == ImageHeader(len(png), "PNG", (512, 512), False, plain_rgb=True)
    assert read_header(png_header_only(9000, 9000), LIMITS).size == (9000, 9000)  # the limits are header_tokens'
    assert read_header(png_header_only(20000, 10000), LIMITS).size is None  # PIL's own bomb limit refused it
    assert read_header(b"not an image", LIMITS) == ImageHeader(12, None, None, False)
    assert read_header(encode(textured_rgb(16, 16), "ICO"), LIMITS).size is None  # not a supported format
    # a WebP's size comes from its fixed header fields: PIL's WebP parser allocates the canvas at open
    monkeypatch.setattr(Image, "open", _no_open)
    header = read_header(webp_declaring(16000, 16000), LIMITS)
    assert header == ImageHeader(header.nbytes, "WEBP", (16000, 16000), False, plain_rgb=True)  # (no alpha chunk)
    assert pickle.loads(pickle.dumps(header)) == header  # it crosses to decode worker processes


def _no_open(*args, **kwargs):
    raise AssertionError("Image.open called")


def _photo_jpegs(name: str, subsampling: int, progressive: bool) -> list[bytes]:
    """A photograph as a JPEG at 448x448 (no resize: the decoded pixels are the step's pixels) and at its
    own size (resized by PIL)."""
    photo = Image.open(SKIMAGE_DATA / name).convert("RGB")
    return [encode(img, "JPEG", quality=90, subsampling=subsampling, progressive=progressive)
            for img in (photo.resize((448, 448), Image.Resampling.BICUBIC), photo)]


PHOTOS = ["astronaut.png", "chelsea.png", "coffee.png", "rocket.jpg"]


@functools.cache
def _corpus() -> dict[str, bytes]:
    """Every valid image, the photographs as plain JPEGs of each chroma subsampling, baseline and progressive,
    and the JPEGs that are not plain (grayscale, MPO)."""
    corpus = dict(valid_images())
    for name in PHOTOS:
        for subsampling in (0, 1, 2):
            for progressive in (False, True):
                for i, data in enumerate(_photo_jpegs(name, subsampling, progressive)):
                    corpus[f"{name}.{subsampling}.{progressive}.{i}.jpg"] = data
    corpus["gray.jpg"] = encode(textured_rgb(320, 224).convert("L"), "JPEG", quality=90)
    corpus["two.mpo"] = encode(quadrants(448, 448), "MPO", save_all=True, append_images=[textured_rgb(448, 448)])
    return corpus


def _count_opens(monkeypatch) -> list[tuple]:
    """Every Image.open call from now on (a header parse each), by its arguments."""
    calls, real = [], Image.open

    def counted(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(Image, "open", counted)
    return calls


def test_a_plain_jpeg_is_parsed_once_and_any_other_image_at_most_twice(monkeypatch):
    corpus = _corpus()
    opens = _count_opens(monkeypatch)
    plain = set()
    for name, data in corpus.items():
        del opens[:]
        header = read_header(data, LIMITS)  # admission's probe, then the decode given its header
        header_tokens(header, P, LIMITS)
        prepare_image(data, P, LIMITS, header=header)
        if header.plain_jpeg:
            plain.add(name)
        # a WebP's probe reads fixed fields, no parser; any other image is opened again by the PIL decode
        assert len(opens) == (1 if header.plain_jpeg or header.format == "WEBP" else 2), name
        del opens[:]
        prepare_image(data, P, LIMITS)  # without a header: no more parses than before there was one
        assert len(opens) == (2 if header.format == "JPEG" and not header.plain_jpeg else 1), name
    jpegs = {n for n in corpus if n.endswith(".jpg") or n.endswith(".jpg@400") or n.endswith(".jpg@360")}
    assert plain == jpegs - {"cmyk.jpg", "exif6.jpg", "gray.jpg"} and len(plain) == 3 + 4 * 3 * 2 * 2


def test_prepare_image_given_its_header_prepares_the_same_image():
    for name, data in _corpus().items():
        given, alone = prepare_image(data, P, LIMITS, header=read_header(data, LIMITS)), prepare_image(data, P, LIMITS)
        assert np.array_equal(given.pixels, alone.pixels), name
        assert (given.grid_thw, given.num_patches, given.num_tokens) == (alone.grid_thw, alone.num_patches,
                                                                         alone.num_tokens), name


def test_a_header_of_other_bytes_is_a_bug():
    with pytest.raises(AssertionError, match="other bytes"):
        prepare_image(valid_images()["rocket.jpg"], P, LIMITS, header=read_header(valid_images()["retina.jpg@360"], LIMITS))


# ---- the simplejpeg fast path for plain JPEGs ----------------------------------------------------------
def _both_paths(data: bytes, monkeypatch, limits: ImageLimits = LIMITS):
    """prepare_image of `data` through the fast path (counting simplejpeg decodes) and through PIL alone."""
    import simplejpeg

    calls = []
    real = simplejpeg.decode_jpeg

    def counted(*a, **k):
        calls.append(1)
        return real(*a, **k)

    with monkeypatch.context() as m:
        m.setattr(images, "_simplejpeg", type("SJ", (), {"decode_jpeg": staticmethod(counted)}))
        fast = prepare_image(data, P, limits)
    with monkeypatch.context() as m:
        m.setattr(images, "_simplejpeg", None)
        pil = prepare_image(data, P, limits)
    return fast, pil, len(calls)


@pytest.mark.parametrize("name", PHOTOS)
@pytest.mark.parametrize("subsampling", [0, 1, 2], ids=["444", "422", "420"])
@pytest.mark.parametrize("progressive", [False, True], ids=["baseline", "progressive"])
def test_plain_jpegs_decode_bit_identically_through_simplejpeg(name, subsampling, progressive, monkeypatch):
    """Real photographs as JPEGs of every chroma subsampling, baseline and progressive, at 448x448 and at
    the photo's own size (_photo_jpegs)."""
    for data in _photo_jpegs(name, subsampling, progressive):
        fast, pil, decodes = _both_paths(data, monkeypatch)
        assert decodes == 1, "a plain JPEG must take the fast path"
        assert np.array_equal(fast.pixels, pil.pixels), (name, fast.pixels.shape)
        assert fast.pixels.flags.c_contiguous and fast.pixels.flags.writeable and fast.pixels.dtype == np.uint8
        assert (fast.grid_thw, fast.num_tokens) == (pil.grid_thw, pil.num_tokens)


def test_jpegs_that_are_not_plain_go_through_pil(monkeypatch):
    photo = Image.open(SKIMAGE_DATA / "chelsea.png").convert("RGB").resize((320, 224))
    cases = {
        "grayscale": encode(photo.convert("L"), "JPEG", quality=90),
        "cmyk": encode(photo.convert("CMYK"), "JPEG", quality=90),
        "exif rotated": exif_rotated("JPEG", orientation=6),
    }
    for what, data in cases.items():
        fast, pil, decodes = _both_paths(data, monkeypatch)
        assert decodes == 0, what
        assert np.array_equal(fast.pixels, pil.pixels) and fast.grid_thw == pil.grid_thw, what
    assert _both_paths(cases["exif rotated"], monkeypatch)[0].pixels.shape == (320, 224, 3)  # rotated for display


def test_broken_and_oversized_jpegs_get_the_same_errors_with_or_without_simplejpeg_or_a_header(monkeypatch):
    good = encode(textured_rgb(448, 448, seed=3), "JPEG", quality=90)
    strip = encode(textured_rgb(4020, 20, seed=3), "JPEG", quality=90)  # 201:1, over the model's limit
    cases = [(truncated(good), LIMITS), (good[:2] + b"\xff\xd8garbage" + good[200:], LIMITS),
             (bad_images()["corrupt_jpeg"][0], LIMITS),  # a readable header, a broken Huffman table
             (good, ImageLimits(max_input_pixels=448 * 400)), (good, ImageLimits(max_image_bytes=len(good) - 1)),
             (strip, ImageLimits(max_aspect_ratio=1000))]
    for data, limits in cases:
        outcomes = []
        for sj, header in (("real", None), ("real", read_header(data, limits)), (None, None)):
            with monkeypatch.context() as m:
                if sj is None:
                    m.setattr(images, "_simplejpeg", None)
                with pytest.raises(ImageError) as e:
                    prepare_image(data, P, limits, header=header)
            outcomes.append((type(e.value), e.value.message))
        assert outcomes[0] == outcomes[1] == outcomes[2], outcomes
    assert read_header(bad_images()["corrupt_jpeg"][0], LIMITS).plain_jpeg  # so simplejpeg met it first


# ---- decode time: scans counted before decoding, a deadline inside the decode (issue 23) -------------------


def _no_decode(*args, **kwargs):
    raise AssertionError("a decode started")


def test_a_progressive_photo_with_its_last_scan_repeated_is_refused_before_anything_is_decoded(monkeypatch):
    """Issue 23's finding: a progressive JPEG whose last scan repeats thousands of times decodes for minutes
    (each scan is a pass over the whole image). Its scans are counted from its bytes, before a decode."""
    photo = progressive_photo(512)
    assert read_header(photo, LIMITS).scans == 10  # libjpeg's progression (PIL's progressive=True)
    bomb = scan_bomb(photo, 100, which="last")
    header = read_header(bomb, LIMITS)
    assert header.scans == LIMITS.max_jpeg_scans + 1 and not header.plain_jpeg  # (counted no further)
    monkeypatch.setattr(ImageFile.ImageFile, "load", _no_decode)
    monkeypatch.setattr(images, "_simplejpeg", type("SJ", (), {"decode_jpeg": staticmethod(_no_decode)}))
    for given in (None, header):
        with raises_code(ImageError, "image_too_complex") as e:
            prepare_image(bomb, P, LIMITS, header=given)
        assert e.value.code == "image_too_complex" and http_status(e.value) == 422
        assert "more than 64 scans" in e.value.message and "--max-jpeg-scans" in e.value.message
    _raises(bomb, "image_too_complex")  # decode_image alone too
    with raises_code(ImageError, "image_too_complex"):
        images.check_complexity(header, LIMITS)  # what admission asks (api/encode.py), from the header alone
    images.check_complexity(read_header(bomb, ImageLimits(max_jpeg_scans=110)), ImageLimits(max_jpeg_scans=110))


def test_the_decode_deadline_stops_a_scan_bomb_between_its_scans():
    """A JPEG under the scan limit can still cost more than its size explains (a raised limit here): PIL's
    decode is stopped at the deadline, between two chunks of its input, each ending before a scan. This bomb
    (a 4096x4096 photo, its 65-byte scan repeated 2000 times: 0.5 MB) took 9 s to decode in full."""
    bomb = scan_bomb(progressive_photo(4096, smooth=True), 2000)
    limits = ImageLimits(max_jpeg_scans=10**6, decode_timeout_s=0.5)
    assert not read_header(bomb, limits).plain_jpeg  # (over _FAST_JPEG_SCANS: simplejpeg cannot be stopped)
    for header in (None, read_header(bomb, limits)):
        start = time.monotonic()
        with raises_code(ImageError, "image_too_complex") as e:
            prepare_image(bomb, P, limits, header=header)
        took = time.monotonic() - start
        assert "took over 0.5 s" in e.value.message and "--decode-timeout-s" in e.value.message
        assert took < 0.5 + 2.5, f"stopped {took:.2f} s after it started"  # (slack for a busy machine)


def test_a_scan_bomb_under_the_limits_decodes_as_pil_decodes_it():
    """A JPEG of more scans than simplejpeg is given (16) but within the limit goes through PIL's decode,
    whose input is cut before each scan: the same pixels as PIL's decode of the file in one piece."""
    bomb = scan_bomb(progressive_photo(448), 20)
    header = read_header(bomb, LIMITS)
    assert header.scans == 30 and not header.plain_jpeg
    whole = np.asarray(Image.open(io.BytesIO(bomb)).convert("RGB"))
    assert np.array_equal(prepare_image(bomb, P, LIMITS, header=header).pixels, whole)


@pytest.mark.parametrize("side", [448, 1000])
def test_pils_decode_cut_before_each_scan_gives_the_pixels_of_the_file_in_one_piece(side):
    """decode_image feeds PIL's decoder chunks that end before each scan (_Budgeted): libjpeg's output does
    not depend on where its input is cut. Baseline and progressive photographs, a COM segment holding a
    whole JPEG (0xFF 0xDA pairs that are no scan of this image), and simplejpeg's decode of the same files."""
    import simplejpeg

    photo = Image.open(SKIMAGE_DATA / "coffee.png").convert("RGB").resize((side, side), Image.Resampling.BICUBIC)
    baseline = encode(photo, "JPEG", quality=90)
    progressive = encode(photo, "JPEG", quality=90, progressive=True)
    inner = progressive_photo(448)
    commented = progressive[:2] + b"\xff\xfe" + (len(inner) + 2).to_bytes(2, "big") + inner + progressive[2:]
    for data in (baseline, progressive, commented):
        whole = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
        assert np.array_equal(np.asarray(decode_image(data, LIMITS)), whole)
        assert np.array_equal(simplejpeg.decode_jpeg(data, colorspace="RGB"), whole)
    assert [read_header(d, LIMITS).scans for d in (baseline, progressive, commented)] == [1, 10, 10]


def test_scans_are_counted_as_libjpeg_reads_them():
    """Only the scans of the image that is decoded: not a thumbnail's inside a segment, not those of an
    MPO's other pictures, not 0xFF 0xDA pairs in data appended after EOI (a phone's motion photo appends
    a video: one such pair per 64 KiB of compressed data). Restart markers and stuffed bytes do not end a
    scan's data."""
    gray = encode(textured_rgb(320, 224).convert("L"), "JPEG", quality=90, progressive=True)
    restarts = encode(textured_rgb(320, 224), "JPEG", quality=90, restart_marker_blocks=1)
    assert restarts.count(b"\xff\xd0") > 0
    mpo = encode(quadrants(448, 448), "MPO", save_all=True, append_images=[textured_rgb(448, 448)], progressive=True)
    assert mpo.count(b"\xff\xda") == 20
    rng = np.random.default_rng(0)
    trailer = rng.integers(0, 256, 6_000_000, dtype=np.uint8).tobytes()  # (6 MB: a few seconds of video)
    assert trailer.count(b"\xff\xda") > 64
    photo = progressive_photo(448)
    motion = photo + trailer
    counts = {name: read_header(d, LIMITS).scans for name, d in
              [("gray", gray), ("restarts", restarts), ("mpo", mpo), ("motion", motion)]}
    assert counts == {"gray": 6, "restarts": 1, "mpo": 10, "motion": 10}
    assert np.array_equal(prepare_image(motion, P, LIMITS).pixels, prepare_image(photo, P, LIMITS).pixels)


def test_a_jpeg_of_more_marker_segments_than_are_worth_walking_never_reaches_pils_parser(monkeypatch):
    """300,000 empty COM segments (1.2 MB) cost PIL's header parser about a second of Python holding the GIL
    (a million: 3 s); the walk that counts scans stops after a few thousand segments and the file is refused."""
    flood = jpeg_marker_flood()
    monkeypatch.setattr(Image, "open", _no_open)
    start = time.monotonic()
    header = read_header(flood, LIMITS)
    assert header.scans is None and header.size is None and not header.plain_jpeg
    with raises_code(ImageError, "image_too_complex", match="marker segments"):
        prepare_image(flood, P, LIMITS, header=header)
    with raises_code(ImageError, "image_too_complex", match="marker segments"):
        prepare_image(flood, P, LIMITS)
    assert time.monotonic() - start < 1.0  # (a few ms: the walk stops at its cap)


# ---- decoding into the caller's buffer (out) -------------------------------------------------------------


class _Cell:
    """An `out` for prepare_image: a cell in the middle of a larger buffer, whose guard bytes either side
    nothing may write; it records every call."""

    GUARD = 64

    def __init__(self):
        self.calls: list[int] = []
        self.buf = np.empty(0, np.uint8)

    def __call__(self, nbytes: int) -> np.ndarray:
        self.calls.append(nbytes)
        self.buf = np.full(nbytes + 2 * self.GUARD, 0xA5, np.uint8)
        return self.buf[self.GUARD : self.GUARD + nbytes]

    def guards_intact(self) -> bool:
        return bool((self.buf[: self.GUARD] == 0xA5).all() and (self.buf[-self.GUARD :] == 0xA5).all())


def test_decoding_into_out_gives_the_same_pixels_in_its_buffer_for_every_image():
    for name, data in _corpus().items():
        alone = prepare_image(data, P, LIMITS)
        for header in (read_header(data, LIMITS), None):
            cell = _Cell()
            into = prepare_image(data, P, LIMITS, header=header, out=cell)
            assert cell.calls == [alone.pixels.nbytes], name  # once, with the final size
            assert np.shares_memory(into.pixels, cell.buf) and cell.guards_intact(), name
            assert into.pixels.shape == alone.pixels.shape and into.pixels.flags.c_contiguous, name
            assert np.array_equal(into.pixels, alone.pixels), name
            assert (into.grid_thw, into.num_patches, into.num_tokens) == (alone.grid_thw, alone.num_patches,
                                                                          alone.num_tokens), name


def test_a_plain_jpeg_that_needs_no_resize_is_decoded_in_place(monkeypatch):
    import simplejpeg

    data = _photo_jpegs("chelsea.png", 2, False)[0]  # 448x448: the decoded pixels are the final pixels
    buffers, real = [], simplejpeg.decode_jpeg

    def spy(*args, **kwargs):
        buffers.append(kwargs.get("buffer"))
        return real(*args, **kwargs)

    monkeypatch.setattr(images, "_simplejpeg", type("SJ", (), {"decode_jpeg": staticmethod(spy)}))
    cell = _Cell()
    prepare_image(data, P, LIMITS, out=cell)
    assert len(buffers) == 1 and buffers[0] is not None and np.shares_memory(buffers[0], cell.buf)
    prepare_image(_photo_jpegs("chelsea.png", 2, False)[1], P, LIMITS, out=_Cell())  # 451x300: resized
    assert len(buffers) == 2 and buffers[1] is None  # decoded to its own array, then resized into out


def test_a_jpeg_simplejpeg_refuses_after_taking_out_is_decoded_by_pil_into_the_same_buffer():
    # Zeroed bytes in the scan data: libjpeg's warning, an error in simplejpeg's strict mode; PIL decodes it.
    data = bytearray(encode(textured_rgb(448, 448, seed=3), "JPEG", quality=90))
    scan = data.index(b"\xff\xda") + 2000
    data[scan : scan + 4] = bytes(0 if b != 0xFF else 0xFF for b in data[scan : scan + 4])
    data = bytes(data)
    assert read_header(data, LIMITS).plain_jpeg
    alone, cell = prepare_image(data, P, LIMITS), _Cell()
    into = prepare_image(data, P, LIMITS, out=cell)
    assert cell.calls == [448 * 448 * 3] and np.shares_memory(into.pixels, cell.buf)
    assert np.array_equal(into.pixels, alone.pixels) and cell.guards_intact()


def test_what_out_raises_comes_out_of_prepare_image_as_it_is():
    class Full(Exception):
        pass

    def full(nbytes):
        raise Full(f"no {nbytes}-byte cell")

    # simplejpeg in place (448x448), PIL without a resize (512x512), simplejpeg then a resize (640x427 -> 640x416)
    cases = [(_photo_jpegs("chelsea.png", 2, False)[0], 448 * 448), (valid_images()["astronaut.png"], 512 * 512),
             (valid_images()["rocket.jpg"], 640 * 416)]
    for data, pixels in cases:
        with pytest.raises(Full, match=f"^no {pixels * 3}-byte cell$"):
            prepare_image(data, P, LIMITS, header=read_header(data, LIMITS), out=full)


def test_bad_images_raise_the_same_errors_with_out():
    for name, (data, code, _) in bad_images().items():
        with raises_code(ImageError, code) as plain:
            prepare_image(data, P, LIMITS)
        with raises_code(ImageError, code) as into:
            prepare_image(data, P, LIMITS, header=read_header(data, LIMITS), out=_Cell())
        assert into.value.message == plain.value.message, name


def test_warmup_image_is_the_smallest_image_the_model_takes():
    # 256x256 = min_pixels: no resize; the same bytes each call (start-up decodes it in every worker)
    assert images.warmup_png() == images.warmup_png()
    prepared = images.warmup_image(P)
    assert prepared.pixels.shape == (256, 256, 3) and prepared.grid_thw == (1, 16, 16) and prepared.num_tokens == 64
    np.testing.assert_array_equal(prepared.pixels, np.asarray(Image.open(io.BytesIO(images.warmup_png()))))
