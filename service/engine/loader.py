"""Turns `--model PRESET_OR_DIR` into a ready vision tower and its preprocessing parameters.

Two sources, nothing else:
  * a preset name (service.presets): the real architecture with seeded random weights, logged loudly;
  * a local Hugging Face checkpoint directory: a full Qwen3-VL checkpoint, from which only the
    `model.visual.*` tensors are read (the shards named in model.safetensors.index.json, or a single
    model.safetensors), or a vision-only directory. Missing, unexpected or mis-shaped tensors stop
    start-up: random weights are never used silently for a checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import Qwen3VLConfig, Qwen3VLVisionConfig

from service.media.params import PreprocessParams, VideoParams
from service.config import Settings
from service.errors import ModelLoadError
from service.presets import PRESETS, check_model, preset_vision_config
from service.engine.tower import TowerSpec, VisionTower

log = logging.getLogger(__name__)

_FULL_TYPES = {"qwen3_vl", "qwen3_vl_moe"}  # the MoE models share the dense models' vision tower
_VISION_TYPES = {"qwen3_vl_vision", "qwen3_vl_moe_vision"}
# Where the tower's tensors live in each layout, tried in order.
_PREFIXES = ("model.visual.", "visual.", "")


@dataclass
class LoadedModel:
    tower: VisionTower  # eval mode, on the target device and dtype
    spec: TowerSpec
    params: PreprocessParams
    model_id: str  # identity for content-hash keys and store metadata
    random_weights: bool
    device: torch.device
    dtype: torch.dtype
    load_s: float = 0.0  # seconds load_model took (reported in the start-up log line and /ready)
    video: VideoParams = VideoParams()  # how a video becomes patches (its sampling, sizes and normalization)


def load_model(settings: Settings) -> LoadedModel:
    t0 = time.perf_counter()
    device = torch.device(settings.resolved_device())
    precision = settings.resolved_dtype()
    # fp8: the activations, the layers left in high precision and the output are bfloat16 (quantize_fp8)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "fp8": torch.bfloat16}[precision]
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"--device {settings.device} asked for CUDA, but torch sees no GPU; use --device cpu")
    if precision == "fp8":
        _check_fp8(device)
    name = settings.model
    check_model(name)
    if name in PRESETS:
        spec, params, tower = _from_preset(name, settings.seed, device, dtype)
        video = VideoParams()
        model_id, random_weights = f"preset:{name}:seed{settings.seed}", True
    else:
        spec, params, video, tower, model_id = _from_checkpoint(Path(name), device, dtype)
        random_weights = False
    params = replace(
        params,
        min_pixels=settings.min_pixels if settings.min_pixels is not None else params.min_pixels,
        max_pixels=settings.max_pixels if settings.max_pixels is not None else params.max_pixels,
    )
    if params.min_pixels > params.max_pixels:
        raise ModelLoadError(f"min_pixels {params.min_pixels} exceeds max_pixels {params.max_pixels}")
    tower.fuse_patch_embed()
    if precision == "fp8":
        over = [i for i in settings.fp8_bf16_blocks if i >= spec.depth]
        if over:
            raise ModelLoadError(f"--fp8-bf16-blocks {over}: the tower has blocks 0..{spec.depth - 1}")
        tower.quantize_fp8(keep=tuple(settings.fp8_bf16_blocks), gemms=tuple(settings.fp8_gemms))
    tower.eval().requires_grad_(False)
    return LoadedModel(tower, spec, params, model_id, random_weights, device, dtype,
                       load_s=round(time.perf_counter() - t0, 2), video=video)


def _check_fp8(device: torch.device) -> None:
    if device.type != "cuda":
        raise ModelLoadError(f"--dtype fp8 needs a CUDA GPU (FP8 GEMMs), not --device {device}; use bfloat16 or float32")
    cap = torch.cuda.get_device_capability(device)
    if cap < (8, 9):
        raise ModelLoadError(f"--dtype fp8 needs a GPU of compute capability 8.9 or newer (Ada, Hopper); "
                             f"{torch.cuda.get_device_name(device)} is {cap[0]}.{cap[1]}; use bfloat16")


# ---------------------------------------------------------------------------------------------------
def _from_preset(name: str, seed: int, device: torch.device, dtype: torch.dtype):
    cfg = preset_vision_config(name)
    spec = TowerSpec.from_config(cfg)
    tower = _empty_tower(spec, device, dtype)
    # Drawn on the CPU in float32 whatever the target, then cast and copied: a seed means the same
    # weights on every device and dtype, so a float32 CPU reference (the load tool's --verify, the
    # consumer's tests) reproduces a CUDA bf16 server's. (A generator on the device drew other numbers:
    # an H200 soak's verify found every tiny-preset embedding wrong against the CPU reference.)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        # transformers' initialisation: N(0, initializer_range) weights, zero biases, unit norms.
        for mod in tower.modules():
            if isinstance(mod, (torch.nn.Linear, torch.nn.Conv3d, torch.nn.Embedding)):
                drawn = torch.empty(mod.weight.shape, dtype=torch.float32).normal_(0.0, cfg.initializer_range, generator=gen)
                mod.weight.copy_(drawn)
                if getattr(mod, "bias", None) is not None:
                    mod.bias.zero_()
            elif isinstance(mod, torch.nn.LayerNorm):
                mod.weight.fill_(1.0)
                mod.bias.zero_()
    n = sum(p.numel() for p in tower.parameters())
    log.warning(
        "*** RANDOM WEIGHTS *** preset %r: the real Qwen3-VL architecture (%.1fM parameters) with seeded random "
        "weights (seed %d). Embeddings are meaningless to a real LM; pass a checkpoint directory for real ones.",
        name, n / 1e6, seed,
    )
    return spec, PreprocessParams(), tower


def _empty_tower(spec: TowerSpec, device: torch.device, dtype: torch.dtype) -> VisionTower:
    # Built on the meta device then materialised: no wasted random init of hundreds of MB.
    with torch.device("meta"):
        tower = VisionTower(spec)
    tower = tower.to_empty(device=device).to(dtype)
    quarter = spec.head_dim // 2
    tower.inv_freq = 1.0 / (spec.rope_theta ** (torch.arange(0, quarter, 2, dtype=torch.float, device=device) / quarter))
    return tower


# ---------------------------------------------------------------------------------------------------
def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelLoadError(f"{path} is missing: a Hugging Face checkpoint directory needs it") from None
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path} is not valid JSON: {e}") from None


def _vision_config(ckpt: Path) -> Qwen3VLVisionConfig:
    raw = _read_json(ckpt / "config.json")
    mtype = raw.get("model_type")
    try:
        if mtype in _FULL_TYPES:
            vc = raw.get("vision_config")
            if not isinstance(vc, dict):
                raise ModelLoadError(f"{ckpt}/config.json is a {mtype} config without a vision_config")
            return Qwen3VLConfig(vision_config=vc).vision_config
        if mtype in _VISION_TYPES:
            return Qwen3VLVisionConfig(**{k: v for k, v in raw.items() if k != "model_type"})
    except (TypeError, ValueError) as e:
        raise ModelLoadError(f"{ckpt}/config.json: invalid Qwen3-VL vision config: {e}") from None
    raise ModelLoadError(
        f"{ckpt}/config.json has model_type {mtype!r}; this service runs Qwen3-VL vision towers "
        f"(model_type one of {sorted(_FULL_TYPES | _VISION_TYPES)})"
    )


def _weight_files(ckpt: Path) -> dict[str, Path]:
    """tensor name -> file holding it, for every tensor of the checkpoint."""
    index = ckpt / "model.safetensors.index.json"
    if index.exists():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(f"{index} has no weight_map")
        return {name: ckpt / shard for name, shard in weight_map.items()}
    single = ckpt / "model.safetensors"
    if single.exists():
        with safe_open(single, framework="pt") as f:
            return {name: single for name in f.keys()}
    raise ModelLoadError(f"{ckpt} has no safetensors weights (model.safetensors or model.safetensors.index.json)")


def _preprocess_params(ckpt: Path, spec: TowerSpec) -> PreprocessParams:
    path = ckpt / "preprocessor_config.json"
    if not path.exists():
        log.warning("%s not found: using Qwen3-VL's default preprocessing", path)
        return PreprocessParams()
    raw = _read_json(path)
    size = raw.get("size") or {}
    d = PreprocessParams()
    params = PreprocessParams(
        min_pixels=int(size.get("shortest_edge", raw.get("min_pixels", d.min_pixels))),
        max_pixels=int(size.get("longest_edge", raw.get("max_pixels", d.max_pixels))),
        patch_size=int(raw.get("patch_size", d.patch_size)),
        merge_size=int(raw.get("merge_size", d.merge_size)),
        temporal_patch_size=int(raw.get("temporal_patch_size", d.temporal_patch_size)),
        image_mean=tuple(float(x) for x in raw.get("image_mean", d.image_mean)),
        image_std=tuple(float(x) for x in raw.get("image_std", d.image_std)),
        rescale_factor=float(raw.get("rescale_factor", d.rescale_factor)),
        resample=int(raw.get("resample", d.resample)),
    )
    _check_patches(path, params, spec)
    if len(params.image_mean) != 3 or len(params.image_std) != 3:
        raise ModelLoadError(f"{path}: image_mean and image_std need 3 values each")
    return params


def _video_params(ckpt: Path, spec: TowerSpec) -> VideoParams:
    """The video processor's config, found where transformers looks (VideoProcessorMixin.get_video_processor_dict,
    5.17 to 5.24): processor_config.json's "video_processor", else video_preprocessor_config.json, else
    preprocessor_config.json. NOTE: the last is the image processor's file; transformers reads it for videos
    when there is no video config, so a checkpoint without one gets the image's pixel limits for its videos."""
    raw, path = None, ckpt / "processor_config.json"
    if path.exists() and isinstance(nested := _read_json(path), dict):
        raw = nested.get("video_processor")
    for name in ("video_preprocessor_config.json", "preprocessor_config.json"):
        if raw is None and (ckpt / name).exists():
            path = ckpt / name
            raw = _read_json(path)
    if raw is None:
        log.warning("%s has no video processor config: using Qwen3-VL's default video preprocessing", ckpt)
        return VideoParams()
    try:
        params = VideoParams.from_config(raw)
    except (TypeError, ValueError) as e:
        raise ModelLoadError(f"{path}: {e}") from None
    _check_patches(path, params, spec)
    return params


def _check_patches(path: Path, params: PreprocessParams | VideoParams, spec: TowerSpec) -> None:
    mismatch = [
        f"{name} {a} != {b}"
        for name, a, b in (
            ("patch_size", params.patch_size, spec.patch_size),
            ("merge_size", params.merge_size, spec.merge_size),
            ("temporal_patch_size", params.temporal_patch_size, spec.temporal_patch_size),
        )
        if a != b
    ]
    if mismatch:
        raise ModelLoadError(f"{path} disagrees with config.json's vision_config: {', '.join(mismatch)}")


def _from_checkpoint(ckpt: Path, device: torch.device, dtype: torch.dtype):
    cfg = _vision_config(ckpt)
    spec = TowerSpec.from_config(cfg)
    params = _preprocess_params(ckpt, spec)
    video = _video_params(ckpt, spec)
    files = _weight_files(ckpt)
    prefix, names = _tower_tensors(ckpt, files)
    tower = _empty_tower(spec, device, dtype)
    expected = tower.state_dict()
    state: dict[str, torch.Tensor] = {}
    by_file: dict[Path, list[str]] = {}
    for n in names:
        by_file.setdefault(files[n], []).append(n)
    for file, keys in by_file.items():
        if not file.exists():
            raise ModelLoadError(f"{file} is named in the index but does not exist")
        with safe_open(file, framework="pt") as f:
            present = set(f.keys())
            for n in keys:
                if n not in present:
                    raise ModelLoadError(f"{file} does not hold {n!r} although the index says so")
                state[n[len(prefix):]] = f.get_tensor(n)
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    shapes = [
        f"{k}: checkpoint {tuple(state[k].shape)} vs model {tuple(expected[k].shape)}"
        for k in sorted(set(state) & set(expected))
        if state[k].shape != expected[k].shape
    ]
    problems = []
    if missing:
        problems.append(f"{len(missing)} missing (e.g. {', '.join(prefix + m for m in missing[:3])})")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected (e.g. {', '.join(prefix + u for u in unexpected[:3])})")
    if shapes:
        problems.append(f"{len(shapes)} mis-shaped (e.g. {'; '.join(shapes[:3])})")
    if problems:
        raise ModelLoadError(f"{ckpt}: vision-tower tensors do not match config.json: " + "; ".join(problems))
    with torch.no_grad():
        for k, t in state.items():
            expected[k].copy_(t)  # copy_ casts to the model dtype and device
    model_id = _model_id(ckpt, names, files)
    log.info("loaded %d vision-tower tensors from %s (%s)", len(state), ckpt, model_id)
    return spec, params, video, tower, model_id


def _tower_tensors(ckpt: Path, files: dict[str, Path]) -> tuple[str, list[str]]:
    """(prefix, names) of the tower's tensors among a checkpoint's: a full checkpoint holds the LM too, and
    only the tower's are read, from only the shards that hold them."""
    prefix = next((p for p in _PREFIXES if any(n.startswith(p + "blocks.") for n in files)), None)
    if prefix is None:
        raise ModelLoadError(f"{ckpt}: no vision-tower tensors found (expected names like 'model.visual.blocks.0...')")
    return prefix, sorted(n for n in files if n.startswith(prefix)) if prefix else sorted(files)


def checkpoint_model_id(ckpt: Path) -> str:
    """The identity `serve --model CKPT` gives this checkpoint's tower (/ready's `model`, every entry's `model`
    metadata), from its files alone, no tensor read: whose embeddings an LM of this checkpoint reads."""
    files = _weight_files(ckpt)
    return _model_id(ckpt, _tower_tensors(ckpt, files)[1], files)


def same_tower(a: str | None, b: str | None) -> bool:
    """Whether two model identities name one tower: equal, or checkpoints (`<directory>@<fingerprint>`) whose
    fingerprints are equal, mounted under other directory names (the encoder's and the LM's hosts)."""
    if a is None or b is None:
        return False
    if a == b:
        return True
    (_, at, fa), (_, bt, fb) = a.rpartition("@"), b.rpartition("@")
    return bool(at and bt and not a.startswith("preset:") and fa == fb)


def _model_id(ckpt: Path, names: list[str], files: dict[str, Path]) -> str:
    return f"{ckpt.resolve().name}@{_fingerprint(ckpt, names, files)}"


def _fingerprint(ckpt: Path, names: list[str], files: dict[str, Path]) -> str:
    """Cheap checkpoint identity: configs plus the size of every shard the tower was read from."""
    h = hashlib.sha256()
    for cfg in ("config.json", "preprocessor_config.json"):
        p = ckpt / cfg
        h.update(p.read_bytes() if p.exists() else b"-")
    for f in sorted({files[n] for n in names}):
        h.update(f"{f.name}:{f.stat().st_size}".encode())
    return h.hexdigest()[:16]
