"""Tiny Qwen3-VL checkpoints written by transformers itself (save_pretrained), in the layouts users have."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import Qwen3VLVisionModel

from service.lm.tiny import DEMO_MAX_PIXELS, DEMO_MIN_PIXELS, SPECIAL_TOKENS, image_processor, write_tiny_checkpoint
from service.presets import preset_vision_config

__all__ = ["SPECIAL_TOKENS", "PilProcessor", "image_processor", "make_full_checkpoint"]

# Pixel limits deliberately unlike Qwen3-VL's defaults (65536 / 16777216): the service must take them
# from preprocessor_config.json. Small max keeps CPU tests fast; big photos get downscaled.
TEST_MIN_PIXELS, TEST_MAX_PIXELS = DEMO_MIN_PIXELS, DEMO_MAX_PIXELS
# transformers' PIL-backend image processor class (the exact CPU reference the tests compare against).
PilProcessor = type(image_processor())


def make_full_checkpoint(path: Path, seed: int = 0, max_shard_size: str = "200KB") -> Path:
    """A full (text + vision) Qwen3-VL checkpoint, sharded, with the test pixel limits: the package's own
    tiny checkpoint (service/lm/tiny.py, what `qwen3vl-encoder demo` runs)."""
    return write_tiny_checkpoint(path, seed, TEST_MIN_PIXELS, TEST_MAX_PIXELS, max_shard_size)


def make_vision_only_checkpoint(path: Path, seed: int = 1) -> Path:
    torch.manual_seed(seed)
    Qwen3VLVisionModel._from_config(preset_vision_config("tiny")).save_pretrained(path)
    return path


def edit_json(path: Path, **changes) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))
