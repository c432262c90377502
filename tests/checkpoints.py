"""Tiny Qwen3-VL checkpoints written by transformers itself (save_pretrained), in the layouts users have."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration, Qwen3VLVisionModel
try:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil as PilProcessor
except ImportError:  # transformers before the PIL/torchvision backend split: the plain class is the PIL one
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor as PilProcessor

from service.presets import preset_vision_config

# Pixel limits deliberately unlike Qwen3-VL's defaults (65536 / 16777216): the service must take them
# from preprocessor_config.json. Small max keeps CPU tests fast; big photos get downscaled.
TEST_MIN_PIXELS = 128 * 128
TEST_MAX_PIXELS = 320 * 320


# Token ids of the tiny checkpoint's tokenizer (inside its 512-token vocabulary; the real models' ids
# are 151652..151656). The tokenizer is a word-level one with Qwen's special tokens and chat markup.
SPECIAL_TOKENS = {"<|image_pad|>": 500, "<|video_pad|>": 501, "<|vision_start|>": 502, "<|vision_end|>": 503,
                  "<|im_start|>": 504, "<|im_end|>": 505, "<|endoftext|>": 506}
WORDS = ["user", "assistant", "system", "describe", "the", "image", "images", "what", "is", "in", "this",
         "compare", "two", "and", "a", "photo", "of", "cat", "you", "are", "helpful"]
# Qwen3-VL's chat markup, reduced to what the tests use: image parts become the vision placeholders.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif p['type'] == 'text' %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def save_tiny_tokenizer(path: Path) -> None:
    """A 512-token word-level tokenizer with Qwen3-VL's special tokens and a chat template (no real
    Qwen tokenizer can be downloaded). Every id in the vocabulary decodes to a word."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(WORDS)}
    vocab.update({f"w{i}": i for i in range(len(WORDS), 499)})
    vocab["[UNK]"] = 499
    vocab.update(SPECIAL_TOKENS)
    vocab.update({f"w{i}": i for i in range(507, 512)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", chat_template=CHAT_TEMPLATE)
    fast.add_special_tokens({"additional_special_tokens": [t for t in SPECIAL_TOKENS if t not in ("<|im_end|>", "<|endoftext|>")]})
    fast.save_pretrained(path)


def tiny_config() -> Qwen3VLConfig:
    return Qwen3VLConfig(
        image_token_id=SPECIAL_TOKENS["<|image_pad|>"], video_token_id=SPECIAL_TOKENS["<|video_pad|>"],
        vision_start_token_id=SPECIAL_TOKENS["<|vision_start|>"], vision_end_token_id=SPECIAL_TOKENS["<|vision_end|>"],
        vision_config=preset_vision_config("tiny").to_dict(),
        text_config=dict(
            vocab_size=512, hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=24,
            rope_parameters={"rope_type": "default", "rope_theta": 5e6, "mrope_section": [4, 4, 4], "mrope_interleaved": True},
        ),
    )


def image_processor(min_pixels: int = TEST_MIN_PIXELS, max_pixels: int = TEST_MAX_PIXELS) -> PilProcessor:
    """transformers' PIL-backend processor with Qwen3-VL's values (never its Qwen2-VL defaults)."""
    return PilProcessor(
        size={"shortest_edge": min_pixels, "longest_edge": max_pixels},
        patch_size=16, temporal_patch_size=2, merge_size=2, image_mean=[0.5] * 3, image_std=[0.5] * 3,
    )


def make_full_checkpoint(path: Path, seed: int = 0, max_shard_size: str = "200KB") -> Path:
    """A full (text + vision) Qwen3-VL checkpoint, sharded, with a preprocessor_config.json."""
    torch.manual_seed(seed)
    model = Qwen3VLForConditionalGeneration(tiny_config()).eval()
    model.save_pretrained(path, max_shard_size=max_shard_size)
    image_processor().save_pretrained(path)
    save_tiny_tokenizer(path)
    return path


def make_vision_only_checkpoint(path: Path, seed: int = 1) -> Path:
    torch.manual_seed(seed)
    Qwen3VLVisionModel._from_config(preset_vision_config("tiny")).save_pretrained(path)
    return path


def edit_json(path: Path, **changes) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))
