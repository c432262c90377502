"""The vision tower on the CPU in float32 against transformers' Qwen3VLVisionModel with the same
weights (a tiny config): equal outputs within 1e-5, the deepstack taps in layer order even when the
config lists them out of order, batched attention (equal images) equal to per-image attention, and
the host's choice of attention kind. (The whole pipeline against transformers' processor and model,
from a checkpoint directory: test_core.py; varlen attention on a GPU: test_tower_cuda.py.)"""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3VLVisionModel

from service.engine.tower import (AttentionKind, TowerBatch, TowerSpec, VisionTower, attention_kind, build_batch,
                                  varlen_available)
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
