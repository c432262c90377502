"""The vision tower on the CPU in float32 against transformers' Qwen3VLVisionModel with the same
weights (a tiny config): equal outputs within 1e-5, the deepstack taps in layer order even when the
config lists them out of order, batched attention (equal images) equal to per-image attention, and
the host's choice of attention kind; videos (temporal groups of two distinct frames: the real Conv3d,
one attention segment per group) alone, in a step with images, and split across steps at group
boundaries. (The whole pipeline against transformers' processor and model,
from a checkpoint directory: test_core.py; varlen attention on a GPU: test_tower_cuda.py.)"""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch
from transformers import Qwen3VLVisionModel

from service.engine.tower import (AttentionKind, TowerBatch, TowerSpec, VisionTower, attention_kind, build_batch,
                                  segments, step_segments, varlen_available, video_groups)
from service.presets import preset_vision_config

TAPS = [2, 0]  # deepstack taps listed out of layer order: the output must still be main, layer 0, layer 2
TOL = 1e-5


@pytest.fixture(scope="module")
def towers():
    """(transformers' tower, ours) with the same random weights; every parameter perturbed, so that no
    zero bias or unit norm hides a wiring mistake."""
    cfg = preset_vision_config("tiny")
    cfg.deepstack_visual_indexes = TAPS
    torch.manual_seed(0)
    hf = Qwen3VLVisionModel._from_config(cfg, attn_implementation="sdpa", dtype=torch.float32).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    ours = VisionTower(TowerSpec.from_config(cfg))
    ours.load_state_dict(hf.state_dict(), strict=True)
    ours.fuse_patch_embed()
    return hf, ours.eval().requires_grad_(False)


def _inputs(spec: TowerSpec, grids: list[tuple[int, int, int]], seed: int = 0):
    """Our TowerBatch of random frame patches for `grids`, and transformers' inputs of the same rows."""
    n = sum(t * h * w for t, h, w in grids)
    frames = torch.randn(n, spec.frame_patch_dim, generator=torch.Generator().manual_seed(seed))
    arr = build_batch(grids, spec)
    batch = TowerBatch(frames, *(torch.from_numpy(arr[k]) for k in ("pos_hw", "interp_idx", "interp_w", "cu_seqlens")),
                       seq_lens=tuple(t * h * w for t, h, w in grids))
    # transformers' patch rows hold both temporal frames, columns (c, t, py, px): the frame repeated over t.
    p2 = spec.patch_size**2
    pixel_values = frames.view(n, 3, 1, p2).expand(-1, -1, spec.temporal_patch_size, -1).reshape(n, -1)
    return batch, pixel_values, torch.tensor(grids)


def test_the_tower_equals_transformers_and_its_deepstack_taps_come_in_layer_order(towers):
    hf, ours = towers
    spec, d = ours.spec, ours.spec.out_hidden_size
    grids = [(1, 8, 12), (1, 16, 16), (1, 4, 20)]  # unequal: per-image attention
    batch, pixel_values, grid_thw = _inputs(spec, grids)
    assert attention_kind(batch, torch.device("cpu"), torch.float32) == AttentionKind.LOOP
    block_out: dict[int, torch.Tensor] = {}
    hooks = [blk.register_forward_hook(lambda _m, _a, out, i=i: block_out.__setitem__(i, out))
             for i, blk in enumerate(hf.blocks)]
    try:
        with torch.no_grad():
            ref = hf(pixel_values, grid_thw=grid_thw)
            out = ours(batch)
            # The taps by hand: layer 0's hidden states through its merger (second in the config's list),
            # then layer 2's (first in the list).
            by_layer = [hf.deepstack_merger_list[TAPS.index(layer)](block_out[layer]) for layer in sorted(TAPS)]
    finally:
        for h in hooks:
            h.remove()
    tokens = sum(t * h * w for t, h, w in grids) // 4
    assert out.shape == (tokens, d * (1 + len(TAPS))) and out.dtype == torch.float32
    parts = [ref.pooler_output, *ref.deepstack_features]
    for level, expected in enumerate(parts):
        diff = (out[:, level * d : (level + 1) * d] - expected).abs().max().item()
        assert diff <= TOL, f"level {level}: max abs diff {diff}"
    for level, expected in enumerate(by_layer, start=1):
        assert (out[:, level * d : (level + 1) * d] - expected).abs().max().item() <= TOL, f"tap {level}"
    # The two orders really differ: the check above would catch taps in the config's order.
    assert (out[:, d : 2 * d] - by_layer[1]).abs().max().item() > 100 * TOL


def test_batched_attention_of_equal_images_equals_each_image_attended_alone(towers):
    hf, ours = towers
    spec = ours.spec
    grids = [(1, 12, 8)] * 3
    batch, pixel_values, grid_thw = _inputs(spec, grids, seed=1)
    assert attention_kind(batch, torch.device("cpu"), torch.float32) == AttentionKind.BATCHED
    with torch.no_grad():
        together = ours(batch)
        ref = hf(pixel_values, grid_thw=grid_thw)
        alone = []
        for i in range(3):  # one image: per-image attention (LOOP) on the CPU
            rows = slice(i * 96, (i + 1) * 96)
            one = TowerBatch(batch.patches[rows], batch.pos_hw[rows], batch.interp_idx[rows], batch.interp_w[rows],
                             torch.tensor([0, 96], dtype=torch.int32), seq_lens=(96,))
            assert attention_kind(one, torch.device("cpu"), torch.float32) == AttentionKind.LOOP
            alone.append(ours(one))
    assert (together - torch.cat(alone)).abs().max().item() <= TOL
    expected = torch.cat([ref.pooler_output, *ref.deepstack_features], dim=1)
    assert (together - expected).abs().max().item() <= TOL


def _step(*lens: int, attention: AttentionKind | None = None) -> TowerBatch:
    n = sum(lens)
    empty = torch.empty(n, 0)
    return TowerBatch(empty, empty, empty, empty, empty, seq_lens=lens, attention=attention)


@pytest.mark.skipif(not varlen_available(), reason="this torch build has no varlen_attn: no fast device to decide for")
def test_the_attention_kind_is_decided_on_the_host_from_the_step_lengths():
    cuda, bf16 = torch.device("cuda"), torch.bfloat16  # only their names are read: no device is touched
    cpu, f32 = torch.device("cpu"), torch.float32
    V, B, L = AttentionKind.VARLEN, AttentionKind.BATCHED, AttentionKind.LOOP
    cases = [
        # (step, device, dtype) -> kind
        ((_step(784), cuda, bf16), V),  # one image: varlen, not a batch of one (see attention_kind)
        ((_step(784, 784), cuda, bf16), B),
        ((_step(784, 400), cuda, bf16), V),
        ((_step(784, 784, attention=V), cuda, bf16), V),  # a graph forces its kind
        ((_step(784, attention=B), cuda, bf16), B),
        ((_step(784, 784), cuda, f32), B),  # float32 on CUDA: no varlen
        ((_step(784, 400), cuda, f32), L),
        ((_step(784), cpu, f32), L),
        ((_step(784, 784), cpu, f32), B),
        ((_step(784, 400, attention=V), cpu, f32), L),  # forcing applies on a fast device only
    ]
    assert [attention_kind(*args) for args, _ in cases] == [kind for _, kind in cases]
    with pytest.raises(AssertionError, match="batched attention needs equal lengths"):
        attention_kind(_step(784, 400, attention=B), cuda, bf16)


# ---- video: temporal groups -------------------------------------------------------------------------
class _Item(NamedTuple):
    grid: tuple[int, int, int]
    pixel_values: torch.Tensor  # [t*h*w, 3*T*P*P] transformers' rows, columns (c, t, py, px)
    video: bool  # an image: one frame repeated over t; a video: distinct frames


def _image(spec: TowerSpec, h: int, w: int, seed: int) -> _Item:
    n, p2 = h * w, spec.patch_size**2
    frame = torch.randn(n, 3, 1, p2, generator=torch.Generator().manual_seed(seed))
    return _Item((1, h, w), frame.expand(-1, -1, spec.temporal_patch_size, -1).reshape(n, -1), video=False)


def _video(spec: TowerSpec, grid: tuple[int, int, int], seed: int) -> _Item:
    t, h, w = grid
    pv = torch.randn(t * h * w, 3 * spec.temporal_patch_size * spec.patch_size**2,
                     generator=torch.Generator().manual_seed(seed))
    return _Item(grid, pv, video=True)


def _frames(pixel_values: torch.Tensor, spec: TowerSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """A patch row's two frames, each a 768-wide row in the staging kernel's (c, py, px) layout."""
    n = pixel_values.shape[0]
    f = pixel_values.view(n, 3, spec.temporal_patch_size, -1)
    return f[:, :, 0].reshape(n, -1), f[:, :, 1].reshape(n, -1)


def _our_step(spec: TowerSpec, items: list[_Item]) -> tuple[TowerBatch, list[int]]:
    """Our TowerBatch of `items` as the runner stages a step: images first, then videos (their first
    frames in `patches`, their second in `frame1`); and the items' indices in that order."""
    order = [i for i, it in enumerate(items) if not it.video] + [i for i, it in enumerate(items) if it.video]
    grids = [items[i].grid for i in order]
    arr = build_batch(grids, spec)
    frames = [_frames(items[i].pixel_values, spec) for i in order]
    second = [f1 for i, (_, f1) in zip(order, frames) if items[i].video]
    batch = TowerBatch(torch.cat([f0 for f0, _ in frames]),
                       *(torch.from_numpy(arr[k]) for k in ("pos_hw", "interp_idx", "interp_w", "cu_seqlens")),
                       seq_lens=step_segments(grids), frame1=torch.cat(second) if second else None)
    return batch, order


def _tokens(grid: tuple[int, int, int]) -> int:
    t, h, w = grid
    return t * h * w // 4


def _ours(tower: VisionTower, items: list[_Item]) -> list[torch.Tensor]:
    """Our output of one step of `items`, split back into the items' order."""
    batch, order = _our_step(tower.spec, items)
    with torch.no_grad():
        out = tower(batch)
    by_item = dict(zip(order, out.split([_tokens(items[i].grid) for i in order])))
    return [by_item[i] for i in range(len(items))]


def _theirs(hf, items: list[_Item]) -> list[torch.Tensor]:
    """transformers' output (main, then the deepstack taps: our columns) of `items`, in their order."""
    with torch.no_grad():
        ref = hf(torch.cat([it.pixel_values for it in items]), grid_thw=torch.tensor([it.grid for it in items]))
    out = torch.cat([ref.pooler_output, *ref.deepstack_features], dim=1)
    return list(out.split([_tokens(it.grid) for it in items]))


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    assert [x.shape for x in a] == [y.shape for y in b]
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def test_a_video_of_distinct_frames_equals_transformers(towers):
    hf, ours = towers
    spec = ours.spec
    video = _video(spec, (3, 8, 12), seed=2)
    f0, f1 = _frames(video.pixel_values, spec)
    assert (f0 - f1).abs().max().item() > 1  # really two different frames per group
    assert segments(video.grid) == (96, 96, 96)  # one attention segment per temporal group
    batch, _ = _our_step(spec, [video])
    assert batch.cu_seqlens.tolist() == [0, 96, 192, 288] and batch.frame1.shape == (288, 768)
    image = build_batch([(1, 8, 12)], spec)
    for name in ("pos_hw", "interp_idx", "interp_w"):  # an image's positions, once per group
        assert torch.equal(getattr(batch, name), torch.from_numpy(image[name]).repeat(3, 1)), name
    expected = _theirs(hf, [video])
    out = _ours(ours, [video])
    diff = _max_diff(out, expected)
    print(f"video (3, 8, 12) alone: max abs diff {diff:.2e}")
    assert out[0].shape == (72, ours.spec.out_width) and diff <= TOL
    # What the test tells apart: the image path (frame 1 ignored, weights summed) and one segment over
    # the whole clip (groups attending to each other) are both far off.
    with torch.no_grad():
        as_image = ours(TowerBatch(batch.patches, batch.pos_hw, batch.interp_idx, batch.interp_w, batch.cu_seqlens,
                                   batch.seq_lens))
        one_segment = ours(TowerBatch(batch.patches, batch.pos_hw, batch.interp_idx, batch.interp_w,
                                      torch.tensor([0, 288], dtype=torch.int32), seq_lens=(288,), frame1=batch.frame1))
    assert (as_image - expected[0]).abs().max().item() > 100 * TOL
    assert (one_segment - expected[0]).abs().max().item() > 100 * TOL


def test_a_step_of_images_and_videos_equals_transformers_on_the_same_rows(towers):
    hf, ours = towers
    spec = ours.spec
    # transformers' order interleaves them; ours puts the videos' rows last (see _our_step).
    items = [_video(spec, (2, 8, 12), seed=3), _image(spec, 16, 16, seed=4), _video(spec, (3, 4, 8), seed=5),
             _image(spec, 4, 20, seed=6)]
    batch, order = _our_step(spec, items)
    assert order == [1, 3, 0, 2] and batch.seq_lens == (256, 80, 96, 96, 32, 32, 32)
    assert batch.frame1.shape == (2 * 96 + 3 * 32, 768)
    assert attention_kind(batch, torch.device("cpu"), torch.float32) == AttentionKind.LOOP
    diff = _max_diff(_ours(ours, items), _theirs(hf, items))
    print(f"2 images + 2 videos: max abs diff {diff:.2e}")
    assert diff <= TOL


def test_a_video_split_across_two_steps_at_a_group_boundary_equals_the_video_in_one(towers):
    hf, ours = towers
    spec = ours.spec
    video = _video(spec, (4, 8, 12), seed=7)
    whole = _ours(ours, [video])[0]
    expected = _theirs(hf, [video])[0]
    split = 1
    parts = []
    for k, (start, stop) in enumerate(((0, split), (split, 4))):
        groups = video_groups(video.grid, start, stop, spec.merge_size)
        assert groups.grid == (stop - start, 8, 12) and groups.rows == slice(start * 96, stop * 96)
        part = _Item(groups.grid, video.pixel_values[groups.rows], video=True)
        # other images in each step, before and after the video in transformers' order
        step = [_image(spec, 8, 8, seed=8 + k), part, _image(spec, 12, 4 * (k + 1), seed=10 + k)]
        out = _ours(ours, step)
        assert _max_diff(out, _theirs(hf, step)) <= TOL
        assert (out[1] - whole[groups.tokens]).abs().max().item() <= TOL
        parts.append(out[1])
    joined = torch.cat(parts)
    vs_whole, vs_ref = (joined - whole).abs().max().item(), (joined - expected).abs().max().item()
    print(f"video (4, 8, 12) split 1 + 3 groups: max abs diff {vs_whole:.2e} vs one step, {vs_ref:.2e} vs transformers")
    assert joined.shape == whole.shape and vs_whole <= TOL and vs_ref <= TOL


def test_a_video_group_of_two_equal_frames_equals_the_image_path(towers):
    """Conv3d's t=0 and t=1 slices sum to the image path's weight: the slices are taken along t."""
    _, ours = towers
    spec = ours.spec
    image = _image(spec, 8, 8, seed=12)
    stills = [_image(spec, 8, 12, seed=13 + g) for g in range(2)]  # each group's frame, repeated over t
    still_video = _Item((2, 8, 12), torch.cat([s.pixel_values for s in stills]), video=True)
    as_video = _ours(ours, [image, still_video])
    as_images = _ours(ours, [image, *stills])
    batch, _ = _our_step(spec, [image, *stills])
    assert batch.frame1 is None  # the image path
    diff = _max_diff(as_video, [as_images[0], torch.cat(as_images[1:])])
    print(f"video of equal frames vs the image path: max abs diff {diff:.2e}")
    assert diff <= TOL


# ---- FP8 (the quantisation; its GEMMs on a GPU: test_tower_cuda.py) -------------------------------------
def test_row_wise_fp8_keeps_each_value_within_e4m3s_rounding_of_its_row_scale():
    from service.engine.tower import FP8_MAX, quantize_rows

    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 256, generator=g) * torch.logspace(-3, 2, 64)[:, None]  # rows five decades apart
    x[3] = 0.0  # an all-zero row (a graph's padding) must not divide by zero
    q, scale = quantize_rows(x.to(torch.bfloat16))
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (64, 1) and scale.dtype == torch.float32
    back = q.float() * scale
    assert torch.isfinite(back).all() and torch.equal(back[3], torch.zeros(256))
    xb = x.to(torch.bfloat16).float()
    # each row's largest magnitude maps to e4m3's largest value; 3 mantissa bits: half an ulp is 2**-4 of a
    # normal value, and below e4m3's smallest normal (2**-6) the step is 2**-9 of the scale
    assert torch.allclose(q.float().abs().amax(dim=1)[torch.arange(64) != 3], torch.tensor(FP8_MAX))
    assert ((back - xb).abs() <= xb.abs() * 2**-4 + scale * 2**-10 + 1e-30).all()


def test_an_fp8_tower_is_the_bf16_tower_in_the_kept_blocks_and_close_to_it_in_the_rest(towers):
    """quantize_fp8 with every block kept changes nothing (bit for bit); with none kept every token stays
    within cosine 0.99 of the float32 tower (random weights: no trained outlier channels), and a block
    kept in high precision is closer still."""
    import copy

    from service.engine.tower import fp8_linear, quantize_rows

    _, ours = towers
    spec = ours.spec
    batch, _, _ = _inputs(spec, [(1, 8, 12), (1, 16, 16)], seed=3)
    with torch.inference_mode():
        ref = ours(batch)
        kept = copy.deepcopy(ours)
        kept.quantize_fp8(keep=tuple(range(spec.depth)))
        assert kept.fp8_blocks == () and torch.equal(kept(batch), ref)
        outs = {}
        for keep in ((), (0,)):
            t = copy.deepcopy(ours)
            t.quantize_fp8(keep=keep)
            assert t.fp8_blocks == tuple(i for i in range(spec.depth) if i not in keep)
            w = t._block_weights[spec.depth - 1]
            assert w.qkv_w.dtype == w.fc1_w.dtype == w.fc2_w.dtype == torch.float8_e4m3fn
            assert w.proj_w.dtype == torch.float32 and w.qkv_s.shape == (1, 3 * spec.hidden_size)
            outs[keep] = t(batch)
    cos = {k: torch.nn.functional.cosine_similarity(o, ref, dim=1) for k, o in outs.items()}
    rel = {k: ((o - ref).norm() / ref.norm()).item() for k, o in outs.items()}
    print(f"fp8 vs float32, tiny tower: min cosine {cos[()].min():.5f} rel {rel[()]:.2e}; block 0 kept "
          f"{cos[(0,)].min():.5f} rel {rel[(0,)]:.2e}")
    assert cos[()].min() > 0.99 and rel[()] < 0.1
    assert rel[(0,)] < rel[()]
    # one GEMM: the quantised product against the float one
    x = torch.randn(40, 64, generator=torch.Generator().manual_seed(1))
    w = ours.blocks[0].attn.qkv.weight
    wq, ws = quantize_rows(w)
    y = fp8_linear(x, wq, ws.t().contiguous(), ours.blocks[0].attn.qkv.bias)
    want = torch.nn.functional.linear(x, w, ours.blocks[0].attn.qkv.bias)
    assert ((y - want).norm() / want.norm()).item() < 5e-2
