"""A small router in front of vLLM: encode a chat request's images on this service, then forward the
request to vLLM, whose EC consumer reads the embeddings from the store by `uuid` (docs/vllm.md).

    python -m service route --encoder-url http://127.0.0.1:8080 --vllm-url http://127.0.0.1:8000 --port 8100

Two ways to forward an image (`--image-parts`):
  * `raw` (default, any vLLM with media uuids): the image part as sent, plus `"uuid": key`. vLLM's
    processor reads the pixels for grid_thw (its rotary positions) and the token count; the encoder
    cache supplies the embeddings, so its vision tower does not run.
  * `embeds` (vLLM >= 0.33, reported, not run here): a metadata-only `image_embeds` part, only
    `image_grid_thw` (a base64 `torch.save` of the [t, h, w] tensor, as vLLM decodes embeds) plus
    `"uuid": key`, so no pixels travel to the LM tier.
A video (`video_url` part, issue 22) is encoded the same way and forwarded as sent plus `"uuid": key`,
in either mode: vLLM's processor decodes it for its grid and frame timestamps (docs/vllm.md says which
vLLM settings make its frame sampling the encoder's), the encoder cache supplies the embeddings.
Everything else in the request is forwarded untouched, and vLLM's answer is returned as it is, except what
would let vLLM fetch or encode media itself (and so pass by the encoder's URL allow-list, or miss its
entry): a content part this router does not route (`input_image`, `audio_url`, a part without `type`,
...), and per-request `mm_processor_kwargs` / `media_io_kwargs` beside media, are refused with a 400.

Several encoder hosts (`--encoder-url` a comma-separated list; with a store that spans hosts, Mooncake
Store): each image goes to the host its hash picks (`encoder_for`: its uuid, else its URL, data URLs
included), so identical images in flight meet on one host, where they are encoded once.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import hashlib
import io
import json
import logging
import re
from dataclasses import dataclass
from typing import Literal

import httpx
import torch
from fastapi import FastAPI, Request
from fastapi.responses import Response

from service.lm.client import apost
from service.api.server import error_response, install_error_handlers
from service.errors import BadGateway, BadRequest

log = logging.getLogger(__name__)

ImageParts = Literal["raw", "embeds"]


@dataclass(frozen=True)
class RouterConfig:
    encoder_url: str  # one encoder, or several comma-separated (hosts of one Mooncake pool)
    vllm_url: str
    image_parts: ImageParts = "raw"
    timeout_s: float = 600.0

    @property
    def encoder_urls(self) -> list[str]:
        return [u.strip() for u in self.encoder_url.split(",") if u.strip()]


def encoder_for(part: dict, n: int) -> int:
    """Which of `n` encoder hosts gets this image or video part: a hash of its uuid, else of its URL (a data
    URL holds the media's bytes), the same in every router process (blake2b, not Python's salted hash)."""
    if n == 1:
        return 0
    name = part.get("uuid") or (part.get("image_url") or part.get("video_url") or {}).get("url") or ""
    return int.from_bytes(hashlib.blake2b(str(name).encode(), digest_size=8).digest(), "little") % n


def tensor_base64(t: torch.Tensor) -> str:
    """A tensor as vLLM's image_embeds values carry it: base64 of `torch.save` bytes."""
    buf = io.BytesIO()
    torch.save(t, buf)
    return base64.b64encode(buf.getvalue()).decode()


ENCODED = ("image_url", "video_url")  # what goes to /encode first, then to vLLM with the key as uuid
# Parts forwarded as they are: text, and image embeddings a client computed (vLLM fetches nothing for them).
PASSED = frozenset({"text", "input_text", "output_text", "refusal", "thinking", "image_embeds"})
# Request fields that vLLM 0.33 hashes with every media item (vllm/multimodal/processing/inputs.py,
# get_mm_hashes): with them a uuid is no longer the mm_hash, and the EC connector misses the entry.
HASHED_FIELDS = ("mm_processor_kwargs", "media_io_kwargs")


def media_parts(chat: dict) -> list[dict]:
    """The request's `image_url` and `video_url` content parts, in order (the dicts themselves, to be
    rewritten). BadRequest for what the router cannot route: any other part vLLM would read as media
    (it also infers a part's type from its keys), or per-request options that change vLLM's mm_hash."""
    parts = []
    for i, m in enumerate(chat.get("messages", [])):
        content = m.get("content") if isinstance(m, dict) else None
        for j, p in enumerate(content if isinstance(content, list) else []):
            kind = p.get("type") if isinstance(p, dict) else None
            if kind in ENCODED:
                parts.append(p)
            elif kind not in PASSED:
                shown = f"type {kind!r}" if kind is not None else "no type"
                raise BadRequest(f"messages[{i}].content[{j}] has {shown}: this router sends text, image_url and "
                                 "video_url parts (each through the encoder) and image_embeds; vLLM would read "
                                 "any other part itself, passing by the encoder. Send images as image_url and "
                                 "videos as video_url, with their type")
    for field in HASHED_FIELDS:
        if parts and chat.get(field):
            raise BadRequest(f"{field} with images or videos: vLLM hashes them into each item's mm_hash, so it "
                             "would not find the encoder's entry and would encode the media itself. Leave them "
                             "out; set frame sampling on the vLLM server (docs/vllm.md, 'Video')")
    return parts


def vllm_request(chat: dict, items: list[dict], mode: ImageParts) -> dict:
    """The request to send vLLM: `chat` with each image and video part tied to its encoder item (same
    order). A video part stays as sent in either mode: vLLM's processor needs its frames (grid, timestamps)."""
    out = copy.deepcopy(chat)
    parts = media_parts(out)
    assert len(parts) == len(items), f"{len(items)} encoder items for {len(parts)} media parts: this is a bug"
    for part, item in zip(parts, items):
        if mode == "raw" or part["type"] == "video_url":
            part["uuid"] = item["key"]
        else:
            part.clear()
            part.update(type="image_embeds", uuid=item["key"],
                        image_embeds={"image_grid_thw": tensor_base64(torch.tensor(item["grid_thw"], dtype=torch.int64))})
    return out


def create_router_app(cfg: RouterConfig) -> FastAPI:
    app = FastAPI(title="Qwen3-VL encoder -> vLLM router", version="0.1.0")
    install_error_handlers(app)
    app.state.encoders = [httpx.AsyncClient(base_url=url, timeout=cfg.timeout_s) for url in cfg.encoder_urls]
    app.state.vllm = httpx.AsyncClient(base_url=cfg.vllm_url, timeout=cfg.timeout_s)

    async def encode(parts: list[dict]) -> list[dict] | Response:
        """Each image on the encoder host its hash picks, the hosts' calls at once; the items in input
        order, or the first host's error answer (its image index mapped back to the request's)."""
        encoders = app.state.encoders
        groups: dict[int, list[int]] = {}  # host -> the positions of its images in the request
        for i, part in enumerate(parts):
            groups.setdefault(encoder_for(part, len(encoders)), []).append(i)

        async def post(host: int, positions: list[int]):
            r, _ = await apost(encoders[host], "/encode", json={"images": [parts[i] for i in positions]})
            return positions, r  # (a stale keep-alive connection is tried once more: lm/client.py)

        answers = await asyncio.gather(*(post(h, pos) for h, pos in groups.items()), return_exceptions=True)
        items: list[dict] = [{}] * len(parts)
        for answer in answers:
            if isinstance(answer, httpx.HTTPError):
                return error_response(BadGateway(f"the encoder could not be reached: {type(answer).__name__}: "
                                                 f"{answer}", code="encoder_unavailable"))
            if isinstance(answer, BaseException):
                raise answer
            positions, r = answer
            if r.status_code != 200:  # a bad image (4xx) or overload (429/503): the client's answer as it is
                return _relayed(r, positions)
            for pos, item in zip(positions, r.json()["items"]):
                items[pos] = item
        return items

    @app.post("/v1/chat/completions")
    async def completions(request: Request):
        try:
            chat = await request.json()
        except ValueError as e:
            return error_response(BadRequest(f"the body is not JSON: {e}"))
        if not isinstance(chat, dict):
            return error_response(BadRequest("the body must be a JSON object"))
        try:
            parts = media_parts(chat)
        except BadRequest as e:
            return error_response(e)
        items: list[dict] = []
        if parts:
            answer = await encode([{k: v for k, v in p.items() if k in ("type", *ENCODED, "uuid")} for p in parts])
            if isinstance(answer, Response):
                return answer
            items = answer
            for i, (part, item) in enumerate(zip(parts, items)):
                sent = "video" if part["type"] == "video_url" else "image"
                if item.get("modality", "image") != sent:
                    return error_response(BadGateway(
                        f"the encoder answered media part {i} ({sent}) as an {item.get('modality', 'image')}: "
                        "does it take videos (issue 22)?", code="embeddings_mismatch"))
        try:
            r = await app.state.vllm.post("/v1/chat/completions", json=vllm_request(chat, items, cfg.image_parts))
        except httpx.HTTPError as e:
            return error_response(BadGateway(f"vLLM could not be reached: {type(e).__name__}: {e}", code="lm_unavailable"))
        return Response(r.content, status_code=r.status_code, media_type=r.headers.get("content-type"))

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    return app


def _relayed(r: httpx.Response, positions: list[int]) -> Response:
    """An encoder's error answer as the router's: a per-image error's index (and the `images[i]` its
    message starts with) named by the image's position in the whole request, not in this host's part."""
    body = r.content
    try:
        doc = r.json()
        err = doc["error"]
        if isinstance(err.get("index"), int) and 0 <= err["index"] < len(positions):
            pos = positions[err["index"]]
            err["message"] = re.sub(r"^images\[\d+\]", f"images[{pos}]", err["message"])
            err["index"] = pos
            body = json.dumps(doc).encode()
    except (ValueError, KeyError, TypeError, AttributeError):
        pass  # not the service's error shape: passed on as it came
    return Response(body, status_code=r.status_code, media_type="application/json",
                    headers={k: v for k, v in r.headers.items() if k.lower() == "retry-after"})


def serve(cfg: RouterConfig, host: str, port: int, log_level: str = "info") -> int:
    import uvicorn

    uvicorn.run(create_router_app(cfg), host=host, port=port, log_level=log_level)
    return 0
