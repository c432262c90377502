"""A tiny Qwen3-VL checkpoint with random weights, written by transformers itself (save_pretrained): the
real architecture (text + vision), a word-level tokenizer with Qwen's special tokens and a chat
template, and a preprocessor_config.json. No real checkpoint can be downloaded where this project is
developed and tested; this one lets the whole pipeline run (`qwen3vl-encoder demo`, the tests). Its
answers are random words: it shows that the pieces fit, not what a model says.
"""

from __future__ import annotations

from pathlib import Path

# Token ids of the tiny tokenizer (inside its 512-token vocabulary; the real models' ids are
# 151652..151656). A word-level tokenizer with Qwen's special tokens and chat markup.
SPECIAL_TOKENS = {"<|image_pad|>": 500, "<|video_pad|>": 501, "<|vision_start|>": 502, "<|vision_end|>": 503,
                  "<|im_start|>": 504, "<|im_end|>": 505, "<|endoftext|>": 506}
WORDS = ["user", "assistant", "system", "describe", "the", "image", "images", "what", "is", "in", "this",
         "compare", "two", "and", "a", "photo", "of", "cat", "you", "are", "helpful"]
# Qwen3-VL's chat markup, reduced to what the tiny model needs: image and video parts become the vision
# placeholders (the real template's, `<|vision_start|><|video_pad|><|vision_end|>` for a video).
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif p['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif p['type'] == 'text' %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Qwen3-VL's own pixel bounds would make the tiny model's steps needlessly large on a CPU.
DEMO_MIN_PIXELS = 128 * 128
DEMO_MAX_PIXELS = 320 * 320
RANDOM_NOTE = ("RANDOM WEIGHTS: a tiny Qwen3-VL (the real architecture, seeded random weights, a 512-word "
               "tokenizer), written by qwen3vl-encoder. It answers random words; it exists to show the pipeline.\n")


def save_tiny_tokenizer(path: Path) -> None:
    """A 512-token word-level tokenizer with Qwen3-VL's special tokens and a chat template. Every id in
    the vocabulary decodes to a word."""
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


def tiny_config():
    """The text + vision config (the vision tower is the `tiny` preset's)."""
    from transformers import Qwen3VLConfig

    from service.presets import preset_vision_config

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


def image_processor(min_pixels: int = DEMO_MIN_PIXELS, max_pixels: int = DEMO_MAX_PIXELS):
    """transformers' PIL-backend image processor with Qwen3-VL's values (never its Qwen2-VL defaults)."""
    try:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil as Pil
    except ImportError:  # transformers before the PIL/torchvision backend split: the plain class is the PIL one
        from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor as Pil

    return Pil(size={"shortest_edge": min_pixels, "longest_edge": max_pixels}, patch_size=16, temporal_patch_size=2,
               merge_size=2, image_mean=[0.5] * 3, image_std=[0.5] * 3)


def write_tiny_checkpoint(path: Path, seed: int = 0, min_pixels: int = DEMO_MIN_PIXELS,
                          max_pixels: int = DEMO_MAX_PIXELS, max_shard_size: str = "200KB") -> Path:
    """A full (text + vision) Qwen3-VL checkpoint in `path`, sharded as released checkpoints are, with a
    preprocessor_config.json and a RANDOM_WEIGHTS.txt that says what it is."""
    import torch
    from transformers import Qwen3VLForConditionalGeneration

    torch.manual_seed(seed)
    model = Qwen3VLForConditionalGeneration(tiny_config()).eval()
    model.save_pretrained(path, max_shard_size=max_shard_size)
    image_processor(min_pixels, max_pixels).save_pretrained(path)
    save_tiny_tokenizer(path)
    (Path(path) / "RANDOM_WEIGHTS.txt").write_text(RANDOM_NOTE)
    return Path(path)
