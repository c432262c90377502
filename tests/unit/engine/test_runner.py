"""The Runner on the CPU: what staging writes into a slot's StepBuffers for a step of three images of
different sizes, that running the staged step equals calling the tower on those images directly, the
H2D copy plan of the GPU path (applied here with memmove), and that a step failing in staging gives
its slot back; a video grid there is an assert."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from service.config import Settings
from service.engine.graphs import padded_cu_seqlens
from service.engine.loader import load_model
from service.engine.pool import StepBuffers, StepSize
from service.engine.runner import Runner, _copies, _copy_table
from service.engine.tower import TowerBatch, build_batch, grid_geometry
from service.media.images import PreparedImage
from service.media.preprocess import patchify

# Small pixel limits keep the slots small: a step holds 4 * 256 = 1024 patches at most.
SETTINGS = Settings(model="tiny", device="cpu", dtype="float32", min_pixels=32 * 32, max_pixels=128 * 128,
                    max_batch_tokens=256, max_batch_images=4, pool_slots=2)
SIZES = [(32, 64), (64, 64), (96, 32)]  # (H, W): grids 2x4, 4x4 and 6x2 patches


@pytest.fixture(scope="module")
def model():
    return load_model(SETTINGS)


@pytest.fixture(scope="module")
def runner(model):
    return Runner(model, SETTINGS.runner_options())


def _image(h: int, w: int, seed: int) -> PreparedImage:
    pixels = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    grid = (1, h // 16, w // 16)
    return PreparedImage(pixels=pixels, grid_thw=grid, num_patches=grid[1] * grid[2],
                         num_tokens=grid[1] * grid[2] // 4)


def _images(seed: int = 0) -> list[PreparedImage]:
    return [_image(h, w, seed + i) for i, (h, w) in enumerate(SIZES)]


def test_staging_writes_each_image_back_to_back_into_the_slot_and_says_what_it_filled(runner, model):
    imgs = _images()
    lens = [img.num_patches for img in imgs]  # 8, 16, 12
    nbytes = [img.pixels.size for img in imgs]
    byte_off, row_off = np.cumsum([0, *nbytes]), np.cumsum([0, *lens])
    with runner.stage(imgs) as st:
        b = st.slot.buffers
        assert st.size == StepSize(pixel_bytes=sum(nbytes), images=3, patches=36, cu_seqlens=runner.cu_length)
        assert st.seq_lens == (8, 16, 12) and st.token_offsets == [0, 2, 6, 9] and st.graph is None
        assert st.grids == [(1, 2, 4), (1, 4, 4), (1, 6, 2)]
        for i, img in enumerate(imgs):
            h, w = img.pixels.shape[:2]
            assert b.images[i].tolist() == [byte_off[i], h, w, row_off[i]]
            assert np.array_equal(b.pixels[byte_off[i] : byte_off[i + 1]].numpy(), img.pixels.reshape(-1))
            geo = grid_geometry(h // 16, w // 16, model.spec.merge_size, model.spec.num_position_embeddings)
            rows = slice(row_off[i], row_off[i + 1])
            assert np.array_equal(b.pos_hw[rows].numpy(), geo.pos_hw)
            assert np.array_equal(b.interp_idx[rows].numpy(), geo.interp_idx)
            assert np.array_equal(b.interp_w[rows].numpy(), geo.interp_w)
        assert b.pos_hw[8].tolist() == [0, 0], "each image's rotary positions start again at its own origin"
        # No graph on the CPU, so no padding: the images' offsets, then the total to the fixed length.
        # (The buffer is longer, for video steps' segments: an image step fills its first cu_length.)
        cu = b.cu_seqlens[: runner.cu_length].tolist()
        assert cu == [0, 8, 24, 36] + [36] * (runner.cu_length - 4)
        assert cu == padded_cu_seqlens(lens, 36, runner.cu_length)
        runner.run(st)


def test_a_staged_step_runs_to_what_the_tower_gives_for_the_same_images_called_directly(runner, model):
    imgs = _images(seed=10)
    with runner.stage(imgs) as st:
        launched = runner.run(st)
    assert launched.done is None and launched.output is None  # CPU: synchronous, no output ring
    grids = [img.grid_thw for img in imgs]
    arr = build_batch(grids, model.spec)
    lut = torch.from_numpy(runner.lut_np)
    patches = torch.cat([patchify(torch.from_numpy(img.pixels), lut, model.params) for img in imgs])
    direct = TowerBatch(patches, *(torch.from_numpy(arr[k]) for k in ("pos_hw", "interp_idx", "interp_w", "cu_seqlens")),
                        seq_lens=tuple(img.num_patches for img in imgs))
    with torch.inference_mode():
        expected = model.tower(direct)
    assert launched.host_out.shape == (9, model.spec.out_width)
    assert torch.equal(launched.host_out, expected)
    # Each image's rows are its own: the last image alone gives the same rows as its slice of the step.
    with runner.stage(imgs[2:]) as st:
        alone = runner.run(st).host_out
    assert (alone - launched.host_out[6:9]).abs().max().item() <= 1e-5


def test_the_h2d_copies_move_exactly_the_rows_a_step_filled_of_every_buffer():
    # The GPU path's copy plan, applied with memmove between two host StepBuffers: for each buffer, the
    # leading rows StepSize.rows names, and nothing beyond them.
    capacity = StepSize(pixel_bytes=4096, images=4, patches=64, cu_seqlens=7)
    src, dst = StepBuffers.allocate(capacity, "cpu"), StepBuffers.allocate(capacity, "cpu", zeros=True)
    g = torch.Generator().manual_seed(0)
    for t in src.values():
        t.copy_(torch.randint(1, 100, t.shape, generator=g).to(t.dtype))  # no zeros: a copied row shows
    size = StepSize(pixel_bytes=1000, images=3, patches=36, cu_seqlens=7)
    copies = _copies(_copy_table(src, dst), size)
    assert [n for _, _, n in copies] == [1000, 3 * 4 * 4, 36 * 2 * 8, 36 * 4 * 8, 36 * 4 * 4, 7 * 4]
    for dst_ptr, src_ptr, n in copies:
        ctypes.memmove(dst_ptr, src_ptr, n)
    for s, d, rows in zip(src.values(), dst.values(), size.rows().values()):
        assert torch.equal(d[:rows], s[:rows]) and not d[rows:].any()


def test_a_step_that_fails_in_staging_gives_its_slot_back(runner, model):
    too_many = [_image(32, 32, i) for i in range(runner.max_images + 1)]  # more images than a step holds
    with pytest.raises(AssertionError, match="over staging capacity"):
        with runner.stage(too_many):
            pytest.fail("staging must refuse the step")  # pragma: no cover
    # Every slot comes round again (round robin) and stages and runs.
    imgs = _images(seed=20)
    outs = []
    for _ in range(runner.pool.num_slots + 1):
        with runner.stage(imgs) as st:
            outs.append(runner.run(st).host_out)
    assert all(torch.equal(o, outs[0]) for o in outs)


def test_a_video_grid_staged_as_an_image_is_a_bug_not_wrong_rows(runner):
    """An image is one frame and one attention segment: a video grid (t > 1) on a PreparedImage would be
    staged as one frame of h*w patches, silently wrong, so it is an assert (videos are PreparedVideo)."""
    video = PreparedImage(pixels=np.zeros((32, 64, 3), dtype=np.uint8), grid_thw=(2, 2, 4), num_patches=16,
                          num_tokens=4)
    with pytest.raises(AssertionError, match="an image of grid"):
        with runner.stage([video]):
            pytest.fail("staging must refuse a video grid")  # pragma: no cover
    with runner.stage(_images(seed=30)) as st:  # the slot came back
        runner.run(st)
