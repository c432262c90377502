"""transformers' monolithic Qwen3-VL as the reference for the LM side: the same chat, pixels in, one
model, greedy. Shared by the consumer's process tests (a directory store, Mooncake across hosts) and the
compose-stack test."""

from __future__ import annotations

import io
from pathlib import Path

import torch
from PIL import Image
from transformers import AutoTokenizer, Qwen3VLForConditionalGeneration

from service.media.preprocess import to_rgb
from tests.checkpoints import SPECIAL_TOKENS, PilProcessor
from tests.live import data_url

MAX_TOKENS = 12


def chat_messages(blobs: list[bytes], text: str) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": data_url(b)}} for b in blobs]
    return [{"role": "system", "content": "you are helpful"},
            {"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


def monolithic(ckpt: Path, blobs: list[bytes], text: str) -> tuple[list[int], list[int]]:
    """transformers alone: processor pixels -> Qwen3-VL (tower + LM) -> greedy tokens. (prompt ids, new ids)"""
    tok = AutoTokenizer.from_pretrained(ckpt)
    model = Qwen3VLForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32).eval()
    inputs = PilProcessor.from_pretrained(ckpt)(images=[to_rgb(Image.open(io.BytesIO(b))) for b in blobs],
                                                return_tensors="pt")
    tokens = (inputs["image_grid_thw"].prod(-1) // 4).tolist()
    msgs = [{"role": "system", "content": "you are helpful"},
            {"role": "user", "content": [*({"type": "image"} for _ in blobs), {"type": "text", "text": text}]}]
    prompt = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    for n in tokens:  # expand each placeholder to its image's rows, in order
        prompt = prompt.replace("<|vision_start|><|image_pad|>", "<|vision_start|>" + "<|IMG|>" * n, 1)
    prompt = prompt.replace("<|IMG|>", "<|image_pad|>")
    ids = torch.tensor([tok(prompt, add_special_tokens=False)["input_ids"]])
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=inputs["pixel_values"],
                             image_grid_thw=inputs["image_grid_thw"],
                             mm_token_type_ids=(ids == SPECIAL_TOKENS["<|image_pad|>"]).int(),
                             max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=[SPECIAL_TOKENS["<|im_end|>"]],
                             pad_token_id=SPECIAL_TOKENS["<|endoftext|>"])
    return ids[0].tolist(), out[0, ids.shape[1]:].tolist()


