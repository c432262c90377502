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


def make_byte_level_checkpoint(src: Path, path: Path) -> Path:
    """The checkpoint `src` (make_full_checkpoint's) with a byte-level BPE tokenizer in place of its word-level
    one, as Qwen's is: its special tokens keep their ids (500-506, the model's config), and no text but the
    tokens themselves encodes to them (a BPE vocabulary has no merge that makes `<|im_end|>`), where the
    word-level vocabulary reads the word `<|im_end|>` as its token. Trained on this project's README, 500
    tokens (256 bytes and 244 merges)."""
    import shutil

    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from service.lm.tiny import CHAT_TEMPLATE

    shutil.copytree(src, path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        (path / name).unlink(missing_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    tok.train_from_iterator([readme], trainers.BpeTrainer(vocab_size=500, show_progress=False,
                                                          initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    assert tok.get_vocab_size() == 500, "the README gave fewer merges than the special tokens' ids need"
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    assert all(tok.token_to_id(t) == i for t, i in SPECIAL_TOKENS.items())
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                            chat_template=CHAT_TEMPLATE).save_pretrained(path)
    return path
