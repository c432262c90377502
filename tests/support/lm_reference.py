"""transformers' monolithic Qwen3-VL as the reference for the LM side: the same chat, pixels in, one
model, greedy; for videos, the pixels our media/video*.py compute (equal to transformers' processor's)
and the prompt transformers' own Qwen3VLProcessor code expands. Shared by the consumer's process tests (a directory store, Mooncake across hosts) and the
compose-stack test."""

from __future__ import annotations

import io
import types
from dataclasses import dataclass
from pathlib import Path

import torch
from PIL import Image
from transformers import AutoTokenizer, Qwen3VLForConditionalGeneration

from service.media.preprocess import to_rgb
from service.media.params import VideoLimits, VideoParams
from service.media.video import clip_size, decode_frames, read_header, sample_indices, timestamps
from service.media.video_preprocess import patchify_video, resize_frames, video_grid, video_lut
from tests.support.checkpoints import SPECIAL_TOKENS, PilProcessor
from tests.support.live import data_url

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




# ---- video (issue 22) -------------------------------------------------------------------------------
@dataclass(frozen=True)
class VideoInputs:
    """One clip as transformers' Qwen3VLVideoProcessor hands it to the model, computed by this project's
    media/video*.py: its pixels equal the processor's bit for bit (tests/unit/media/test_video.py's fixture test,
    made where torchvision is), which cannot be instantiated here (no torchvision)."""

    pixel_values_videos: torch.Tensor  # [grid_t*gh*gw, 3*2*16*16] float32
    grid_thw: tuple[int, int, int]  # video_grid_thw
    frames_indices: list[int]
    fps: float  # the source's
    timestamps: list[float]  # one per temporal group


def video_inputs(blob: bytes, params: VideoParams | None = None) -> VideoInputs:
    params = params or VideoParams()  # the tiny checkpoint has no video_preprocessor_config.json: the defaults
    header = read_header(blob, VideoLimits())
    idx = sample_indices(header.frames, header.fps, params)
    frames = decode_frames(blob, header, idx, VideoLimits())
    h, w = clip_size(len(idx), header.height, header.width, params)
    pixels = patchify_video(torch.from_numpy(resize_frames(frames, h, w)), torch.from_numpy(video_lut(params)), params)
    return VideoInputs(pixels, video_grid(len(idx), h, w, params), idx, header.fps,
                       timestamps(idx, header.fps, params.temporal_patch_size))


def processor_text(tok, text: str, image_grids: list[tuple[int, int, int]], videos: list[VideoInputs]) -> str:
    """`text` (the chat template's) expanded by transformers' own Qwen3VLProcessor code: its
    replace_image_token / replace_video_token and ProcessorMixin.get_text_with_replacements, on a processor
    built without __init__ (which needs the video processor class, so torchvision). Only the sub-processors'
    merge and temporal patch sizes are stood in for."""
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.video_utils import VideoMetadata

    proc = object.__new__(Qwen3VLProcessor)
    proc.tokenizer = tok
    proc.image_processor = types.SimpleNamespace(merge_size=2)
    proc.video_processor = types.SimpleNamespace(merge_size=2, temporal_patch_size=2)
    proc.image_token, proc.video_token = "<|image_pad|>", "<|video_pad|>"
    proc.vision_start_token, proc.vision_end_token = "<|vision_start|>", "<|vision_end|>"
    image_inputs = {"image_grid_thw": torch.tensor(image_grids).view(-1, 3)}
    video_inputs_ = {"video_grid_thw": torch.tensor([v.grid_thw for v in videos]).view(-1, 3),
                     "video_metadata": [VideoMetadata(total_num_frames=v.frames_indices[-1] + 1, fps=v.fps,
                                                      frames_indices=list(v.frames_indices)) for v in videos]}
    images = [proc.replace_image_token(image_inputs, i) for i in range(len(image_grids))]
    vids = [proc.replace_video_token(video_inputs_, i) for i in range(len(videos))]
    (expanded,), _ = proc.get_text_with_replacements([text], images_replacements=images, videos_replacements=vids)
    return expanded


def monolithic_media(ckpt: Path, blobs: list[bytes], videos: list[VideoInputs], text: str,
                     ) -> tuple[list[int], list[int], str]:
    """transformers alone on a user turn of images (processor pixels), then videos, then `text`: its tower
    encodes both, its processor code expands the prompt. (prompt ids, new ids, prompt text)"""
    tok = AutoTokenizer.from_pretrained(ckpt)
    model = Qwen3VLForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32).eval()
    kwargs = {}
    grids = []
    if blobs:
        inputs = PilProcessor.from_pretrained(ckpt)(images=[to_rgb(Image.open(io.BytesIO(b))) for b in blobs],
                                                    return_tensors="pt")
        kwargs.update(pixel_values=inputs["pixel_values"], image_grid_thw=inputs["image_grid_thw"])
        grids = [tuple(g) for g in inputs["image_grid_thw"].tolist()]
    if videos:
        kwargs.update(pixel_values_videos=torch.cat([v.pixel_values_videos for v in videos]),
                      video_grid_thw=torch.tensor([v.grid_thw for v in videos]))
    msgs = [{"role": "system", "content": "you are helpful"},
            {"role": "user", "content": [*({"type": "image"} for _ in blobs), *({"type": "video"} for _ in videos),
                                         {"type": "text", "text": text}]}]
    prompt = processor_text(tok, tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False), grids, videos)
    ids = torch.tensor([tok(prompt, add_special_tokens=False)["input_ids"]])
    types_ = (ids == SPECIAL_TOKENS["<|image_pad|>"]).int() + 2 * (ids == SPECIAL_TOKENS["<|video_pad|>"]).int()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=types_,
                             max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=[SPECIAL_TOKENS["<|im_end|>"]],
                             pad_token_id=SPECIAL_TOKENS["<|endoftext|>"], **kwargs)
    return ids[0].tolist(), out[0, ids.shape[1]:].tolist(), prompt


def visual_ec_cache(ckpt: Path, pixels: torch.Tensor, grid_thw: tuple[int, int, int]) -> torch.Tensor:
    """transformers' own vision tower on `pixels`: the ec_cache rows the encoder stores, [n, 48 * 3]."""
    visual = Qwen3VLForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32).model.visual.eval()
    with torch.inference_mode():
        out = visual(pixels, grid_thw=torch.tensor([grid_thw]))
    return torch.cat([out.pooler_output, *out.deepstack_features], dim=1).contiguous()
