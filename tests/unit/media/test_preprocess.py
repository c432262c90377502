"""service.media.preprocess against transformers' PIL-backend Qwen2-VL processor with Qwen3-VL's values.

The contract is bit-exactness: every comparison with the reference is torch.equal / np.array_equal
(tolerance 0), so any drift in resize, rounding, float order or patch layout fails.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps
from transformers.image_transforms import convert_to_rgb as hf_convert_to_rgb
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as hf_smart_resize

from service.media import preprocess
from service.media.params import ImageLimits, PreprocessParams
from service.errors import ImageError
from service.media.images import prepare_image
from tests.support.imagedata import (
    encode,
    la_png,
    palette_transparent_png,
    photo,
    qwen3vl_processor,
    reference_pixel_values,
    rgba_png,
    textured_rgb,
    valid_images,
)
from tests.support.errors import raises_code

P = PreprocessParams()
LUT = torch.from_numpy(preprocess.normalize_lut(P))

# min/max pixels as a deployment might override them; each hits a different smart_resize branch
PARAM_SETS = {
    "qwen3vl": P,
    "small_max": PreprocessParams(max_pixels=128 * 32 * 32),  # downscales every photo
    "large_min": PreprocessParams(min_pixels=512 * 512),  # upscales most test images
    "qwen2vl_pixels": PreprocessParams(min_pixels=56 * 56, max_pixels=28 * 28 * 1280),
    # >= 6x downscales: where PIL's reducing_gap (which the processor leaves off) would change the result
    "tiny_max": PreprocessParams(min_pixels=32 * 32, max_pixels=64 * 64),
}


def _sizes() -> list[tuple[int, int]]:
    fixed = [(1, 1), (7, 10), (15, 16), (16, 16), (31, 33), (48, 48), (80, 48), (255, 256), (512, 512),
             (872, 1000), (1411, 1411), (4096, 4096), (4097, 4095), (9000, 9000), (20, 4000), (1, 200),
             (200, 1), (30, 6000), (6000, 6000 // 199), (3, 599), (65536 // 32, 32), (1, 31), (100000, 600)]
    rng = np.random.default_rng(0)
    rand = [(int(h), int(w)) for h, w in rng.integers(1, 5000, size=(300, 2)) if max(h, w) / min(h, w) <= 200]
    return fixed + rand


# ---- smart_resize ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", PARAM_SETS)
def test_smart_resize_equals_transformers(name):
    params = PARAM_SETS[name]
    for h, w in _sizes():
        expected = hf_smart_resize(h, w, params.factor, min_pixels=params.min_pixels, max_pixels=params.max_pixels)
        assert preprocess.smart_resize(h, w, params) == expected, (h, w)


def test_smart_resize_known_values():
    assert preprocess.smart_resize(1, 1, P) == (256, 256)  # upscaled to min_pixels = 256*256
    assert preprocess.smart_resize(7, 10, P) == (224, 320)
    assert preprocess.smart_resize(512, 512, P) == (512, 512)  # already a multiple of 32: unchanged
    assert preprocess.smart_resize(872, 1000, P) == (864, 992)  # rounded to multiples of 32
    assert preprocess.smart_resize(9000, 9000, P) == (4096, 4096)  # downscaled to max_pixels = 4096^2
    assert preprocess.smart_resize(20, 4000, P) == (32, 4000)


def test_smart_resize_aspect_ratio_limit_is_strictly_greater_than_200():
    # exactly 200 passes in both
    assert preprocess.smart_resize(1, 200, P) == hf_smart_resize(1, 200, 32, P.min_pixels, P.max_pixels)
    assert preprocess.smart_resize(6000, 30, P) == (6016, 32)
    # just over 200 fails in both
    with pytest.raises(ValueError, match="aspect ratio"):
        hf_smart_resize(20, 4020, 32, P.min_pixels, P.max_pixels)
    with raises_code(ImageError, "aspect_ratio_too_extreme") as info:
        preprocess.smart_resize(20, 4020, P)
    assert info.value.code == "aspect_ratio_too_extreme"
    assert "4020x20" in info.value.message and "201.0:1" in info.value.message and "200:1" in info.value.message


def test_grid_and_token_counts():
    assert preprocess.grid_for(864, 992, P) == (1, 54, 62)
    assert preprocess.num_patches((1, 54, 62)) == 3348
    assert preprocess.num_tokens((1, 54, 62), P) == 837


# ---- rescale + normalize as a lookup table --------------------------------------------------------------


def test_normalize_lut_equals_processor_rescale_normalize():
    lut = preprocess.normalize_lut(P)
    assert lut.dtype == np.float32 and lut.shape == (3, 256)
    proc = qwen3vl_processor(P)
    levels = np.tile(np.arange(256, dtype=np.uint8), (3, 1))[:, None, :]  # [C, 1, 256], channels first
    ref = proc.normalize(proc.rescale(levels, P.rescale_factor), list(P.image_mean), list(P.image_std))
    assert ref.dtype == np.float32
    np.testing.assert_array_equal(lut, ref[:, 0, :])
    assert (lut[:, 0] == -1.0).all() and (lut[:, 255] == 1.0).all()
    # (float32(128/255) - 0.5) / 0.5 in float32: not the same bits as 2*128/255 - 1 computed in float64
    assert lut[1, 128] == (np.float32(128 / 255) - np.float32(0.5)) / np.float32(0.5)


def test_normalize_lut_per_channel_mean_std():
    # OpenAI CLIP's values (Qwen2-VL's): three different channels
    params = PreprocessParams(
        image_mean=(0.48145466, 0.4578275, 0.40821073), image_std=(0.26862954, 0.26130258, 0.27577711)
    )
    lut = preprocess.normalize_lut(params)
    proc = qwen3vl_processor(params)
    levels = np.tile(np.arange(256, dtype=np.uint8), (3, 1))[:, None, :]
    ref = proc.normalize(proc.rescale(levels, params.rescale_factor), list(params.image_mean), list(params.image_std))
    np.testing.assert_array_equal(lut, ref[:, 0, :])
    assert not np.array_equal(lut[0], lut[2])


# ---- the whole pipeline, bitwise ---------------------------------------------------------------------------


def _reference_input(data: bytes) -> Image.Image:
    """What a transformers user hands the processor: the opened file, EXIF orientation applied
    (the processor itself ignores EXIF), *not* converted to RGB (the processor does that)."""
    img = Image.open(io.BytesIO(data))
    ImageOps.exif_transpose(img, in_place=True)
    return img


def _ours(data: bytes, params: PreprocessParams, temporal: bool = True):
    prepared = prepare_image(data, params, ImageLimits())
    lut = torch.from_numpy(preprocess.normalize_lut(params))
    return prepared, preprocess.patchify(torch.from_numpy(prepared.pixels), lut, params, temporal=temporal)


@pytest.mark.parametrize("name", list(valid_images()))
def test_pipeline_equals_transformers_bitwise(name):
    data = valid_images()[name]
    ref_pv, ref_grid = reference_pixel_values([_reference_input(data)], P)
    prepared, pv = _ours(data, P)
    assert tuple(ref_grid[0].tolist()) == prepared.grid_thw
    assert pv.shape == ref_pv.shape == (prepared.num_patches, 1536)
    assert pv.dtype == ref_pv.dtype == torch.float32
    assert torch.equal(pv, ref_pv)
    assert prepared.num_tokens == prepared.num_patches // 4


@pytest.mark.parametrize("params_name", ["small_max", "large_min", "qwen2vl_pixels", "tiny_max"])
@pytest.mark.parametrize("name", ["coffee.png", "rocket.jpg", "tiny_10x7.png", "rgba.png"])
def test_pipeline_equals_transformers_with_custom_pixel_limits(name, params_name):
    params = PARAM_SETS[params_name]
    data = valid_images()[name]
    ref_pv, ref_grid = reference_pixel_values([_reference_input(data)], params)
    prepared, pv = _ours(data, params)
    assert tuple(ref_grid[0].tolist()) == prepared.grid_thw
    assert torch.equal(pv, ref_pv)


def test_pipeline_equals_transformers_on_a_batch():
    # the processor concatenates images' rows: ours, concatenated, must match as a whole
    names = ["chelsea.png", "camera.png", "noise.webp.lossy", "palette_transparent.png"]
    ref_pv, ref_grid = reference_pixel_values([_reference_input(valid_images()[n]) for n in names], P)
    ours = [_ours(valid_images()[n], P) for n in names]
    assert [p.grid_thw for p, _ in ours] == [tuple(g) for g in ref_grid.tolist()]
    assert torch.equal(torch.cat([pv for _, pv in ours]), ref_pv)


def test_full_size_photo_downscaled_to_max_pixels():
    # hubble_deep_field.jpg at its original 1000x872, with max_pixels forcing a real bicubic downscale
    params = PreprocessParams(max_pixels=400 * 400)
    data = photo("hubble_deep_field.jpg")
    ref_pv, ref_grid = reference_pixel_values([_reference_input(data)], params)
    prepared, pv = _ours(data, params)
    assert prepared.pixels.shape == (352, 416, 3) and prepared.grid_thw == (1, 22, 26)
    assert tuple(ref_grid[0].tolist()) == prepared.grid_thw
    assert torch.equal(pv, ref_pv)


# ---- patchify layout -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["astronaut.png", "tall_30x6000.png", "exif6.jpg", "i16.png"])
def test_patchify_without_temporal_is_the_t0_half(name):
    prepared, pv = _ours(valid_images()[name], P, temporal=True)
    _, half = _ours(valid_images()[name], P, temporal=False)
    n = prepared.num_patches
    by_t = pv.view(n, 3, 2, 16 * 16)  # columns (c, t, py, px)
    assert half.shape == (n, 768)
    assert torch.equal(half, by_t[:, :, 0].reshape(n, 768))
    assert torch.equal(by_t[:, :, 0], by_t[:, :, 1])  # the frame is repeated over t


def test_patchify_row_and_column_order():
    # 64x96 image (gh=4, gw=6): each pixel encodes its own position, so each output element says where
    # it came from. Rows: (gh/2, gw/2, 2, 2); columns: (c, py, px).
    h, w = 64, 96
    y, x = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    pixels = np.stack([y, x, (y * 7 + x * 3) % 256], axis=-1).astype(np.uint8)
    out = preprocess.patchify(torch.from_numpy(pixels), LUT, P, temporal=False)
    assert out.shape == (24, 768)
    lut = LUT.numpy()
    for row in range(24):
        block, within = divmod(row, 4)
        by, bx = divmod(block, 3)  # merge blocks in raster order over a 2 x 3 block grid
        my, mx = divmod(within, 2)  # patches in raster order within the block
        py0, px0 = (by * 2 + my) * 16, (bx * 2 + mx) * 16
        for c in range(3):
            for py, px in [(0, 0), (0, 15), (15, 0), (7, 9)]:
                expected = lut[c, pixels[py0 + py, px0 + px, c]]
                assert out[row, c * 256 + py * 16 + px].item() == expected, (row, c, py, px)


def test_patchify_writes_into_out():
    pixels = torch.from_numpy(np.array(textured_rgb(64, 32)))
    out = torch.full((8, 768), float("nan"))
    result = preprocess.patchify(pixels, LUT, P, out=out)
    assert result is out and not out.isnan().any()
    assert torch.equal(out, preprocess.patchify(pixels, LUT, P))


def test_patchify_rejects_bad_input_as_bugs():
    with pytest.raises(AssertionError, match="multiple of 32"):
        preprocess.patchify(torch.zeros((48, 64, 3), dtype=torch.uint8), LUT, P)
    with pytest.raises(AssertionError, match="uint8"):
        preprocess.patchify(torch.zeros((64, 64, 3), dtype=torch.float32), LUT, P)


def test_resize_output_is_writable_contiguous_uint8():
    pixels = preprocess.resize(textured_rgb(150, 110), P)
    assert pixels.dtype == np.uint8 and pixels.shape == (224, 320, 3)
    assert pixels.flags.c_contiguous and pixels.flags.writeable and pixels.flags.owndata



def test_resize_writes_into_out():
    img = textured_rgb(150, 110)
    out = np.zeros((224, 320, 3), np.uint8)
    result = preprocess.resize(img, P, out=out)
    assert result is out and np.array_equal(out, preprocess.resize(img, P))
    with pytest.raises(AssertionError, match=r"\[224, 320, 3\] uint8"):
        preprocess.resize(img, P, out=np.zeros((320, 224, 3), np.uint8))

# ---- RGB conversion --------------------------------------------------------------------------------------


def _mode_images() -> dict[str, Image.Image]:
    base = textured_rgb(40, 30, seed=3)
    rgb_with_key = base.copy()
    rgb_with_key.info["transparency"] = (0, 0, 0)  # PNG tRNS for RGB: one colour is transparent
    i16 = Image.fromarray((np.arange(40 * 30, dtype=np.uint16).reshape(30, 40) * 3))
    return {
        "RGBA": Image.open(io.BytesIO(rgba_png())),
        "P+transparency": Image.open(io.BytesIO(palette_transparent_png())),
        "P": base.quantize(colors=32),
        "PA": base.quantize(colors=32).convert("PA"),
        "LA": Image.open(io.BytesIO(la_png())),
        "L": base.convert("L"),
        "1": base.convert("1"),
        "CMYK": Image.open(io.BytesIO(encode(base.convert("CMYK"), "JPEG"))),
        "YCbCr": base.convert("YCbCr"),
        "I;16": i16,
        "I": i16.convert("I"),
        "F": Image.fromarray(np.linspace(-10, 300, 40 * 30, dtype=np.float32).reshape(30, 40)),
        "RGB+transparency": rgb_with_key,
        "RGB": base,
    }


@pytest.mark.parametrize("mode", list(_mode_images()))
def test_to_rgb_equals_transformers(mode):
    img = _mode_images()[mode]
    ours = preprocess.to_rgb(img)
    assert ours.mode == "RGB" and ours.size == img.size
    np.testing.assert_array_equal(np.asarray(ours), hf_convert_to_rgb(img, return_numpy=True))


def test_to_rgb_composites_transparency_on_white():
    rgba = np.zeros((1, 3, 4), np.uint8)
    rgba[0, 0] = (10, 20, 30, 0)  # fully transparent -> white
    rgba[0, 1] = (10, 20, 30, 255)  # opaque -> itself
    rgba[0, 2] = (0, 0, 0, 128)  # half black over white -> mid grey
    out = np.asarray(preprocess.to_rgb(Image.fromarray(rgba, "RGBA")))
    assert out[0, 0].tolist() == [255, 255, 255]
    assert out[0, 1].tolist() == [10, 20, 30]
    assert out[0, 2].tolist() == [127, 127, 127]


def test_to_rgb_clips_16_bit_like_transformers():
    # NOTE: transformers (PIL's convert) clips 16-bit gray at 255 instead of scaling it; we match it.
    img = Image.fromarray(np.array([[0, 100, 255, 256, 4000, 65535]], dtype=np.uint16))
    assert img.mode == "I;16"
    assert np.asarray(preprocess.to_rgb(img))[0, :, 0].tolist() == [0, 100, 255, 255, 255, 255]
