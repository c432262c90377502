"""--model DIR: full sharded checkpoints, single-file and vision-only layouts, and every way it can be wrong."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen3VLForConditionalGeneration

from service.config import Settings
from service.errors import ModelLoadError
from service.engine.loader import checkpoint_model_id, load_model, same_tower
from service.media.params import VideoParams
from tests.support.checkpoints import TEST_MAX_PIXELS, TEST_MIN_PIXELS, edit_json, make_vision_only_checkpoint


@pytest.fixture
def full_ckpt(tiny_checkpoint):
    return tiny_checkpoint


def _load(path, **kw):
    return load_model(Settings(model=str(path), device="cpu", **kw))


def test_full_sharded_checkpoint_reads_only_the_tower(full_ckpt):
    index = json.loads((full_ckpt / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 2  # really sharded
    m = _load(full_ckpt)
    ref = Qwen3VLForConditionalGeneration.from_pretrained(full_ckpt, dtype=torch.float32).model.visual
    ref_sd = ref.state_dict()
    ours = m.tower.state_dict()
    assert set(ours) == set(ref_sd)
    for k, v in ref_sd.items():
        assert torch.equal(ours[k], v), k
    assert not m.random_weights
    # preprocessing comes from the checkpoint's preprocessor_config.json
    assert (m.params.min_pixels, m.params.max_pixels) == (TEST_MIN_PIXELS, TEST_MAX_PIXELS)
    assert m.params.image_mean == (0.5, 0.5, 0.5) and m.params.patch_size == 16
    assert m.model_id.startswith(full_ckpt.name + "@")


def test_bfloat16_and_pixel_overrides(full_ckpt):
    m = _load(full_ckpt, dtype="bfloat16", max_pixels=200 * 200)
    assert m.dtype == torch.bfloat16 and m.tower.blocks[0].mlp.linear_fc1.weight.dtype == torch.bfloat16
    assert m.params.max_pixels == 40000 and m.params.min_pixels == TEST_MIN_PIXELS


def test_single_file_full_checkpoint(full_ckpt, tmp_path):
    merged = {}
    for f in sorted(full_ckpt.glob("model-*.safetensors")):
        merged.update(load_file(f))
    save_file(merged, tmp_path / "model.safetensors", metadata={"format": "pt"})
    shutil.copy(full_ckpt / "config.json", tmp_path / "config.json")
    m = _load(tmp_path)
    ref = _load(full_ckpt)
    assert torch.equal(m.tower.merger.linear_fc2.weight, ref.tower.merger.linear_fc2.weight)
    assert m.params.max_pixels == 16777216  # no preprocessor_config.json: Qwen3-VL defaults


def test_vision_only_directory(tmp_path):
    m = _load(make_vision_only_checkpoint(tmp_path))
    assert m.spec.depth == 3 and not m.random_weights


def test_a_checkpoints_model_id_is_known_without_loading_it_and_names_one_tower(full_ckpt, tmp_path):
    """The LM consumer compares its checkpoint's tower with the `model` of every entry it reads."""
    model_id = _load(full_ckpt).model_id
    assert checkpoint_model_id(full_ckpt) == model_id
    moved = tmp_path / "elsewhere"  # the same files under another directory name: the same tower
    shutil.copytree(full_ckpt, moved)
    assert checkpoint_model_id(moved) != model_id and same_tower(checkpoint_model_id(moved), model_id)
    assert not same_tower("preset:tiny:seed0", model_id) and not same_tower(None, model_id)
    assert same_tower("preset:tiny:seed0", "preset:tiny:seed0") and not same_tower("preset:tiny:seed0", "preset:tiny:seed1")
    assert not same_tower(model_id, model_id.split("@")[0] + "@0123456789abcdef")


def test_missing_directory():
    with pytest.raises(ModelLoadError, match="neither a preset .* nor an existing checkpoint directory"):
        _load("/nonexistent/qwen3-vl")


def test_not_qwen3_vl(full_ckpt, tmp_path):
    shutil.copytree(full_ckpt, tmp_path / "c")
    edit_json(tmp_path / "c" / "config.json", model_type="llava")
    with pytest.raises(ModelLoadError, match="model_type 'llava'"):
        _load(tmp_path / "c")


def test_missing_config(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="config.json is missing"):
        _load(tmp_path)


def _rewrite_shard(ckpt, tensor_name, fn):
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    shard = ckpt / index["weight_map"][tensor_name]
    tensors = load_file(shard)
    fn(tensors)
    save_file(tensors, shard, metadata={"format": "pt"})
    return index, tensors


def test_missing_tensor(full_ckpt, tmp_path):
    c = shutil.copytree(full_ckpt, tmp_path / "c")
    name = "model.visual.blocks.1.mlp.linear_fc1.weight"
    index, _ = _rewrite_shard(c, name, lambda t: t.pop(name))
    del index["weight_map"][name]
    (c / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelLoadError, match=r"1 missing \(e.g. model\.visual\.blocks\.1\.mlp\.linear_fc1\.weight\)"):
        _load(c)


def test_tensor_named_in_index_but_absent_from_shard(full_ckpt, tmp_path):
    c = shutil.copytree(full_ckpt, tmp_path / "c")
    name = "model.visual.blocks.0.norm1.weight"
    _rewrite_shard(c, name, lambda t: t.pop(name))
    with pytest.raises(ModelLoadError, match="does not hold 'model.visual.blocks.0.norm1.weight'"):
        _load(c)


def test_unexpected_tensor(full_ckpt, tmp_path):
    c = shutil.copytree(full_ckpt, tmp_path / "c")
    name = "model.visual.blocks.0.norm1.weight"
    index, _ = _rewrite_shard(c, name, lambda t: t.__setitem__("model.visual.blocks.9.extra.weight", torch.ones(3)))
    index["weight_map"]["model.visual.blocks.9.extra.weight"] = index["weight_map"][name]
    (c / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelLoadError, match=r"1 unexpected \(e.g. model\.visual\.blocks\.9\.extra\.weight\)"):
        _load(c)


def test_misshaped_tensor(full_ckpt, tmp_path):
    c = shutil.copytree(full_ckpt, tmp_path / "c")
    name = "model.visual.merger.linear_fc2.weight"
    _rewrite_shard(c, name, lambda t: t.__setitem__(name, torch.zeros(7, 256)))
    with pytest.raises(ModelLoadError, match=r"1 mis-shaped .*merger\.linear_fc2\.weight: checkpoint \(7, 256\) vs model \(48, 256\)"):
        _load(c)


def test_config_architecture_disagrees_with_weights(full_ckpt, tmp_path):
    c = shutil.copytree(full_ckpt, tmp_path / "c")
    cfg = json.loads((c / "config.json").read_text())
    cfg["vision_config"]["depth"] = 4
    (c / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"missing \(e.g. model\.visual\.blocks\.3\."):
        _load(c)


def test_preprocessor_disagrees_with_config(full_ckpt, tmp_path):
    c = shutil.copytree(full_ckpt, tmp_path / "c")
    edit_json(c / "preprocessor_config.json", patch_size=14)
    with pytest.raises(ModelLoadError, match="patch_size 14 != 16"):
        _load(c)


def test_no_weights(full_ckpt, tmp_path):
    shutil.copy(full_ckpt / "config.json", tmp_path / "config.json")
    with pytest.raises(ModelLoadError, match="no safetensors weights"):
        _load(tmp_path)


def test_unknown_preset_name():
    with pytest.raises(ModelLoadError, match="qwen3-vl-2b"):
        _load("qwen3-vl-3b")


def test_video_preprocessing_is_read_where_transformers_reads_it(full_ckpt, tmp_path):
    c = shutil.copytree(full_ckpt, tmp_path / "c")
    # No video config: transformers' video processor reads preprocessor_config.json (the image's) instead.
    m = _load(c)
    assert (m.video.min_pixels, m.video.max_pixels) == (TEST_MIN_PIXELS, TEST_MAX_PIXELS)
    assert (m.video.fps, m.video.max_frames, m.video.cap_pixels_per_frame) == (2.0, 768, False)
    (c / "video_preprocessor_config.json").write_text(json.dumps(
        {"size": {"shortest_edge": 4096, "longest_edge": 25165824}, "fps": 1, "max_frames": 64,
         "cap_pixels_per_frame": True, "max_video_tokens": 256, "patch_size": 16, "temporal_patch_size": 2}))
    m = _load(c)
    assert (m.video.min_pixels, m.video.max_pixels, m.video.fps, m.video.max_frames) == (4096, 25165824, 1.0, 64)
    assert (m.video.cap_pixels_per_frame, m.video.max_video_tokens) == (True, 256)
    assert m.params.max_pixels == TEST_MAX_PIXELS  # the image's own config is the image's still
    # processor_config.json's "video_processor" comes first, as in transformers 5.
    (c / "processor_config.json").write_text(json.dumps({"video_processor": {"fps": 4}}))
    assert _load(c).video == VideoParams(fps=4.0)
    (c / "processor_config.json").write_text(json.dumps({"video_processor": {"fps": 4, "resample": 1}}))
    with pytest.raises(ModelLoadError, match=r"processor_config\.json: resample 1 is not bicubic"):
        _load(c)
    (c / "processor_config.json").write_text(json.dumps({"video_processor": {"patch_size": 14}}))
    with pytest.raises(ModelLoadError, match=r"processor_config\.json disagrees with config\.json's vision_config: patch_size 14 != 16"):
        _load(c)


def test_a_preset_has_the_default_video_preprocessing():
    assert _load("tiny").video == VideoParams()


def test_fp8_is_refused_on_the_cpu_with_what_to_use_instead():
    with pytest.raises(ModelLoadError, match="--dtype fp8 needs a CUDA GPU .* use bfloat16 or float32"):
        load_model(Settings(model="tiny", device="cpu", dtype="fp8"))
