"""The LM side: an OpenAI-style chat endpoint answered by Qwen3-VL's language model, which reads each
image's and video's embeddings from the encoder's store and never runs the vision tower.

    python -m service consume --model CHECKPOINT_DIR --encoder-url http://127.0.0.1:8080 --store DIR --port 8090

Per request (`POST /v1/chat/completions`, a subset of OpenAI's: text, `image_url` and `video_url` content
parts, `max_tokens`, greedy decoding only):
  1. every image and video part goes to the encoder's `/encode` (the same content-part shapes, one call
     for all) -> key, modality, grid_thw, num_tokens;
  2. the key's entry is read from the store (store/reader.py: a directory, or Mooncake Store) -> the main
     embeddings, the deepstack features and, for a video, its timestamps;
  3. the prompt is the checkpoint's chat template with one `<|image_pad|>` per image embedding row, and
     each video's `<|video_pad|>` expanded as Qwen3VLProcessor.replace_video_token does: per temporal
     group `<{t:.1f} seconds><|vision_start|>` + one `<|video_pad|>` per row + `<|vision_end|>`;
  4. transformers' Qwen3-VL generates greedily from the embeddings (`mm_encoder_outputs`), taking
     the 3-D rotary positions from image_grid_thw / video_grid_thw and mm_token_type_ids (its
     get_rope_index splits a video into one grid per temporal group, with the timestamp text between),
     and the answer carries OpenAI's `usage` counts.
A key evicted between the encoder's answer and the read is re-requested once; still missing -> 424.
Errors are the encoder's JSON error shape: `{"error": {"code", "message"}}`.

The preprocessing rule (as with vLLM): the LM's image placeholders come from the encoder's
num_tokens, so the encoder's pixel limits decide the tokens; this side never re-derives them.
"""

from __future__ import annotations

import asyncio
import logging
import re
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

import httpx
import torch
from fastapi import FastAPI, Request
from pydantic import BaseModel, Field, ValidationError

from service.lm.client import apost
from service.api.schemas import ImagePart
from service.api.server import error_response, install_error_handlers
from service.errors import (
    BadGateway,
    BadRequest,
    EmbeddingsMissing,
    ModelLoadError,
    Relayed,
    ServiceError,
)
from service.store.format import StoredEmbeddings, StoreFormatError
from service.store.reader import is_mooncake, open_reader

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ChatConfig:
    model: Path  # a local Qwen3-VL checkpoint directory with its tokenizer and chat template
    encoder_url: str  # the encoder service, e.g. http://127.0.0.1:8080
    store: Path | str  # the encoder's store: its root as mounted here (read-only is enough), or mooncake://...
    device: str = "cpu"
    dtype: str = "auto"  # float32 | bfloat16; auto: bfloat16 on cuda, float32 on cpu
    max_tokens_limit: int = 1024  # the most tokens one request may ask for
    encoder_timeout_s: float = 300.0
    mooncake_local_host: str = "127.0.0.1"  # with a mooncake:// store: the address the pool reaches this host at


# ---- request / response schemas (OpenAI chat-completions subset) ------------------------------------
class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class VideoURL(BaseModel):
    url: str = Field(description="data:video/...;base64,... or an http(s) URL on the encoder's allow-list")


class VideoPart(BaseModel):
    """A video as /encode takes it (issue 22's contract). NOTE: the encoder's own schema (api/schemas.py)
    gains the same part with its video support; this one goes when both are merged."""

    type: Literal["video_url"] = "video_url"
    video_url: VideoURL
    uuid: str | None = Field(None, description="optional store key; default: content hash")


class Message(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: str | list[Annotated[TextPart | ImagePart | VideoPart, Field(discriminator="type")]]


class ChatRequest(BaseModel):
    model: str | None = None
    messages: list[Message] = Field(min_length=1)
    max_tokens: int = Field(16, ge=1)
    temperature: float | None = None
    return_token_ids: bool = Field(False, description="also answer the generated token ids (as vLLM does)")


# ---- the language model -------------------------------------------------------------------------
class LanguageModel:
    """Qwen3-VL from a checkpoint directory, fed precomputed image embeddings. One generation at a time."""

    def __init__(self, cfg: ChatConfig):
        from transformers import AutoTokenizer, Qwen3VLForConditionalGeneration

        if not (cfg.model / "config.json").is_file():
            raise ModelLoadError(f"--model {cfg.model} is not a Qwen3-VL checkpoint directory (no config.json); "
                                 "the LM side needs a real checkpoint with its tokenizer")
        cuda = cfg.device.startswith("cuda")
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(cfg.dtype, torch.bfloat16 if cuda else torch.float32)
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model)
        self.model = Qwen3VLForConditionalGeneration.from_pretrained(cfg.model, dtype=dtype).to(cfg.device).eval()
        self.device, self.dtype = torch.device(cfg.device), dtype
        mc = self.model.config
        self.image_token_id, self.video_token_id = mc.image_token_id, mc.video_token_id
        self.image_pad = self.tokenizer.convert_ids_to_tokens(mc.image_token_id)
        self.video_pad = self.tokenizer.convert_ids_to_tokens(mc.video_token_id)
        self.vision_start = self.tokenizer.convert_ids_to_tokens(mc.vision_start_token_id)
        self.vision_end = self.tokenizer.convert_ids_to_tokens(mc.vision_end_token_id)
        self.hidden_size = mc.text_config.hidden_size
        self.deepstack_levels = len(mc.vision_config.deepstack_visual_indexes)
        self.merge = mc.vision_config.spatial_merge_size
        self.eos_ids = {i for i in (self.tokenizer.eos_token_id, self.model.generation_config.eos_token_id) if isinstance(i, int)}
        self.name = cfg.model.resolve().name
        self._lock = threading.Lock()  # generate() is not re-entrant on one model

    def prompt_text(self, messages: list[dict], media: list[StoredEmbeddings]) -> str:
        """The chat template's text with each placeholder expanded, in order: an image's `<|image_pad|>` to
        its rows, a video's `<|video_pad|>` to Qwen3VLProcessor.replace_video_token's text (transformers 5.x
        replaces the bare video token, so the template's own `<|vision_start|>`/`<|vision_end|>` around it
        stay; vLLM's Qwen3-VL processor does the same for transformers >= 5.10)."""
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        pieces = re.split(f"({re.escape(self.image_pad)}|{re.escape(self.video_pad)})", text)
        found = [("image" if p == self.image_pad else "video") for p in pieces[1::2]]
        if found != [e.modality for e in media]:
            raise BadRequest(f"the chat template placed placeholders for {found or 'nothing'}, the request has "
                             f"{[e.modality for e in media] or 'no media'}")
        out = [pieces[0]]
        for e, after in zip(media, pieces[2::2]):
            out.append(self.image_pad * e.main.shape[0] if e.modality == "image" else self.video_text(e))
            out.append(after)
        return "".join(out)

    def video_text(self, e: StoredEmbeddings) -> str:
        """A video's placeholder text: per temporal group its time, then its rows between vision markers."""
        t, h, w = e.grid_thw
        per_group = h * w // self.merge**2
        return "".join(f"<{s:.1f} seconds>" + self.vision_start + self.video_pad * per_group + self.vision_end
                       for s in e.timestamps)

    def prompt_ids(self, messages: list[dict], media: list[StoredEmbeddings]) -> list[int]:
        return self.tokenizer(self.prompt_text(messages, media), add_special_tokens=False)["input_ids"]

    def generate(self, input_ids: list[int], media: list[StoredEmbeddings], max_new_tokens: int) -> list[int]:
        """Greedy tokens after `input_ids`, with `media` (images and videos, prompt order) as the encoder
        outputs: transformers scatters each modality's rows into its own placeholders and its deepstack
        features at those positions, and takes the rotary positions from the grids (get_rope_index)."""
        from transformers.models.qwen3_vl.modeling_qwen3_vl import BaseModelOutputWithDeepstackFeatures

        ids = torch.tensor([input_ids], device=self.device)
        kwargs: dict = {}
        cast = lambda t: t.to(self.device, self.dtype)  # noqa: E731
        outputs = {}
        for modality in ("image", "video"):
            items = [e for e in media if e.modality == modality]
            if not items:
                continue
            kwargs[f"{modality}_grid_thw"] = torch.tensor([e.grid_thw for e in items], device=self.device)
            outputs[modality] = BaseModelOutputWithDeepstackFeatures(
                pooler_output=tuple(cast(e.main) for e in items),
                deepstack_features=[tuple(cast(e.deepstack[i]) for e in items) for i in range(self.deepstack_levels)],
            )
        if outputs:  # Qwen3-VL's token types: 0 text, 1 image, 2 video
            kwargs["mm_token_type_ids"] = (ids == self.image_token_id).int() + 2 * (ids == self.video_token_id).int()
            kwargs["mm_encoder_outputs"] = outputs
        with self._lock, torch.inference_mode():
            out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                      do_sample=False, eos_token_id=sorted(self.eos_ids) or None,
                                      pad_token_id=self.tokenizer.pad_token_id, **kwargs)
        return out[0, len(input_ids):].tolist()

    def check(self, key: str, emb: StoredEmbeddings, item: dict) -> None:
        """The stored tensor must be what this LM consumes (vLLM checks none of this and truncates), and
        the entry the modality the encoder answered."""
        t, h, w = emb.grid_thw
        num_tokens = item["num_tokens"]
        problems = []
        if emb.modality != item.get("modality", "image"):
            problems.append(f"the entry is an {emb.modality}, the encoder answered a {item.get('modality', 'image')}")
        if emb.modality == "video" and (emb.timestamps is None or len(emb.timestamps) != t):
            problems.append(f"video timestamps {emb.timestamps} for {t} temporal groups")
        if emb.main.shape != (num_tokens, self.hidden_size):
            problems.append(f"main embeddings {tuple(emb.main.shape)}, expected ({num_tokens}, {self.hidden_size})")
        if len(emb.deepstack) != self.deepstack_levels:
            problems.append(f"{len(emb.deepstack)} deepstack levels, expected {self.deepstack_levels}")
        if t * h * w // self.merge**2 != num_tokens:
            problems.append(f"grid_thw {emb.grid_thw} gives {t * h * w // self.merge**2} tokens, answered {num_tokens}")
        if problems:
            raise BadGateway(f"store entry {key!r} does not fit this language model: " + "; ".join(problems)
                             + ". Do encoder and LM use the same checkpoint?", code="embeddings_mismatch")


# ---- the request path ---------------------------------------------------------------------------
class Chat:
    def __init__(self, cfg: ChatConfig, lm: LanguageModel):
        self.cfg, self.lm = cfg, lm
        self.http = httpx.AsyncClient(base_url=cfg.encoder_url, timeout=cfg.encoder_timeout_s)
        self.reader = open_reader(cfg.store, local_host=cfg.mooncake_local_host) if is_mooncake(cfg.store) else \
            open_reader(cfg.store)

    async def encode(self, parts: list[ImagePart | VideoPart]) -> list[dict]:
        """POST the image and video parts to the encoder; its items, in order. Its 4xx/503 pass through as ours."""
        body = {"images": [p.model_dump(exclude_none=True) for p in parts]}
        try:
            r, _ = await apost(self.http, "/encode", json=body)  # retried once if the connection was stale
        except httpx.HTTPError as e:
            raise BadGateway(f"the encoder at {self.cfg.encoder_url} could not be reached: {type(e).__name__}: {e}",
                             code="encoder_unavailable") from None
        if r.status_code != 200:
            try:
                err = r.json()["error"]
                code, message = err["code"], f"encoder: {err['message']}"
            except (ValueError, KeyError, TypeError):
                code, message = "encoder_error", f"encoder answered {r.status_code}"
            status = r.status_code if r.status_code < 500 or r.status_code == 503 else 502
            retry = r.headers.get("Retry-After")
            raise Relayed(status, code, message, int(retry) if retry and retry.isdigit() else None)
        return r.json()["items"]

    async def embeddings(self, parts: list[ImagePart | VideoPart]) -> list[tuple[dict, StoredEmbeddings]]:
        items = await self.encode(parts) if parts else []
        out = []
        for part, item in zip(parts, items):
            emb = self._read(item)
            if emb is None:  # evicted (or its host lost) between the encoder's answer and this read: ask once more
                log.warning("store entry %s missing after /encode answered it; re-requesting once", item["key"])
                (item,) = await self.encode([part])
                emb = self._read(item)
            if emb is None:
                raise EmbeddingsMissing(f"the encoder answered key {item['key']!r} twice, but {self.cfg.store} does not "
                                        "hold it: is --store the encoder's store root, and is the store large enough?")
            sent = "image" if isinstance(part, ImagePart) else "video"
            if item.get("modality", "image") != sent:
                raise BadGateway(f"the encoder answered {item['key']!r} as an {item.get('modality', 'image')} for a "
                                 f"{sent} part: does it take videos (issue 22)?", code="embeddings_mismatch")
            try:
                self.lm.check(item["key"], emb, item)
            except StoreFormatError as e:
                raise BadGateway(f"store entry {item['key']!r}: {e}", code="embeddings_mismatch") from None
            out.append((item, emb))
        return out

    def _read(self, item: dict) -> StoredEmbeddings | None:
        try:
            return self.reader.read(item["key"], item.get("store_key"))
        except KeyError:
            return None
        except StoreFormatError as e:
            raise BadGateway(str(e), code="embeddings_mismatch") from None

    async def complete(self, req: ChatRequest) -> dict:
        if req.temperature not in (None, 0, 0.0):
            raise BadRequest(f"temperature {req.temperature}: only greedy decoding is supported; "
                                                "send temperature 0 or leave it out")
        if req.max_tokens > self.cfg.max_tokens_limit:
            raise BadRequest(f"max_tokens {req.max_tokens} is over this server's limit of "
                                                f"{self.cfg.max_tokens_limit}")
        parts, messages = [], []
        for m in req.messages:
            if isinstance(m.content, str):
                messages.append({"role": m.role, "content": m.content})
                continue
            content = []
            for p in m.content:
                if isinstance(p, (ImagePart, VideoPart)):
                    parts.append(p)
                    content.append({"type": "image" if isinstance(p, ImagePart) else "video"})
                else:
                    content.append({"type": "text", "text": p.text})
            messages.append({"role": m.role, "content": content})
        media = [e for _, e in await self.embeddings(parts)]
        input_ids = self.lm.prompt_ids(messages, media)
        new = await asyncio.to_thread(self.lm.generate, input_ids, media, req.max_tokens)
        finish = "stop" if new and new[-1] in self.lm.eos_ids else "length"
        choice = {"index": 0, "finish_reason": finish,
                  "message": {"role": "assistant", "content": self.lm.tokenizer.decode(new, skip_special_tokens=True)}}
        if req.return_token_ids:
            choice["token_ids"] = new
        return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": req.model or self.lm.name, "choices": [choice],
                "usage": {"prompt_tokens": len(input_ids), "completion_tokens": len(new),
                          "total_tokens": len(input_ids) + len(new)}}


def create_chat_app(cfg: ChatConfig, lm: LanguageModel) -> FastAPI:
    chat = Chat(cfg, lm)
    app = FastAPI(title="Qwen3-VL LM consumer", version="0.1.0",
                  description="Answers chat requests from the image and video embeddings the encoder service stored.")
    app.state.chat = chat
    started = int(time.time())
    install_error_handlers(app)

    @app.post("/v1/chat/completions")
    async def completions(request: Request):
        try:
            req = ChatRequest.model_validate_json(await request.body())
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            return error_response(BadRequest(f"invalid request body at '{where}': {first['msg']}"))
        try:
            return await chat.complete(req)
        except ServiceError as e:
            return error_response(e)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/ready")
    async def ready():
        return {"ready": True, "model": lm.name, "encoder": cfg.encoder_url, "store": str(cfg.store)}

    @app.get("/v1/models")
    async def models():
        """OpenAI's model list (clients ask it first): the one model this consumer serves."""
        return {"object": "list", "data": [{"id": lm.name, "object": "model", "created": started,
                                            "owned_by": "qwen3vl-encoder"}]}

    return app


def serve(cfg: ChatConfig, host: str, port: int, log_level: str = "info") -> int:
    import uvicorn

    try:
        lm = LanguageModel(cfg)
    except ModelLoadError as e:
        print(f"cannot load the language model: {e}", flush=True)
        return 2
    uvicorn.run(create_chat_app(cfg, lm), host=host, port=port, log_level=log_level)
    return 0
