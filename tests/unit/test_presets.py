"""Each preset builds the architecture of its released checkpoint."""

import pytest
import torch
from transformers import Qwen3VLVisionModel

from service.config import Settings
from service.engine.loader import load_model
from service.presets import PRESETS, preset_vision_config
from service.engine.tower import TowerSpec, VisionTower

# From the released checkpoints' vision_config (config.json): depth, hidden, intermediate, heads, out_hidden, taps, params(M)
RELEASED = {
    "qwen3-vl-2b": (24, 1024, 4096, 16, 2048, (5, 11, 17), 407.0),
    "qwen3-vl-4b": (24, 1024, 4096, 16, 2560, (5, 11, 17), 415.3),
    "qwen3-vl-8b": (27, 1152, 4304, 16, 4096, (8, 16, 24), 576.4),
    "qwen3-vl-32b": (27, 1152, 4304, 16, 5120, (8, 16, 24), 595.3),
}


def _meta_param_count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


@pytest.mark.parametrize("name", list(RELEASED))
def test_preset_matches_released_architecture(name):
    depth, hidden, inter, heads, out_hidden, taps, params_m = RELEASED[name]
    cfg = preset_vision_config(name)
    assert (cfg.depth, cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.out_hidden_size) == (
        depth, hidden, inter, heads, out_hidden)
    assert tuple(cfg.deepstack_visual_indexes) == taps
    assert (cfg.patch_size, cfg.spatial_merge_size, cfg.temporal_patch_size, cfg.num_position_embeddings) == (16, 2, 2, 2304)
    assert cfg.hidden_act == "gelu_pytorch_tanh"
    with torch.device("meta"):
        ours = VisionTower(TowerSpec.from_config(cfg))
        ref = Qwen3VLVisionModel._from_config(cfg)
    # Same parameter names and shapes as transformers' model: a released checkpoint loads strictly.
    ours_shapes = {k: tuple(v.shape) for k, v in ours.state_dict().items()}
    ref_shapes = {k: tuple(v.shape) for k, v in ref.state_dict().items()}
    assert ours_shapes == ref_shapes
    n = _meta_param_count(ours)
    assert n == _meta_param_count(ref)
    assert round(n / 1e6, 1) == params_m
    assert len(ours.blocks) == depth and len(ours.deepstack_merger_list) == len(taps)
    assert ours.spec.out_width == out_hidden * 4


def test_tiny_preset_builds_and_is_seeded():
    a = load_model(Settings(model="tiny", device="cpu", seed=3))
    b = load_model(Settings(model="tiny", device="cpu", seed=3))
    c = load_model(Settings(model="tiny", device="cpu", seed=4))
    assert a.random_weights and a.model_id == "preset:tiny:seed3"
    wa, wb, wc = (m.tower.blocks[0].attn.qkv.weight for m in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)
    assert 0.015 < wa.std().item() < 0.025  # N(0, 0.02) like transformers' init
    assert a.dtype == torch.float32 and a.device.type == "cpu"
    assert set(PRESETS) == set(RELEASED) | {"tiny"}


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU")])])
def test_a_seed_means_the_same_weights_on_every_device_and_dtype(device):
    # The load tool's --verify rebuilds the server's preset on the CPU in float32: the server's weights
    # (cuda, bf16) must be those cast. Drawn on the device or in bf16 they were other numbers entirely.
    ref = load_model(Settings(model="tiny", device="cpu", dtype="float32", seed=5))
    other = load_model(Settings(model="tiny", device=device, dtype="bfloat16", seed=5))
    for (name, p32), (_, p16) in zip(ref.tower.named_parameters(), other.tower.named_parameters()):
        assert p16.dtype == torch.bfloat16
        assert torch.equal(p16.cpu(), p32.to(torch.bfloat16)), name
