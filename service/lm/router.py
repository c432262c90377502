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
A video (`video_url` part) is encoded the same way and forwarded as sent plus `"uuid": key`,
in either mode: vLLM's processor decodes it for its grid and frame timestamps (docs/vllm.md says which
vLLM settings make its frame sampling the encoder's), the encoder cache supplies the embeddings.
Only what this router knows is forwarded (`n=1000`, `max_tokens=1e9` and `tools` reached vLLM as
they came): the request fields in FIELDS, each checked (`n` 1, `max_tokens` / `max_completion_tokens` at
most --max-tokens-limit, and that limit sent when a request gives neither), messages of `role`, `content`
and `name`, and the content parts in PART_KEYS with their keys; anything else is a 400 that names it.
What would let vLLM fetch or encode media itself (and so pass by the encoder's URL allow-list, or miss
its entry) is refused too: a content part this router does not route (`input_image`, `audio_url`, a part
without `type`, ...), and per-request `mm_processor_kwargs` / `media_io_kwargs` beside media. Every
image and video URL goes to the encoder first, which fetches it through its allow-list: one it refuses is
answered with the encoder's 4xx and never reaches vLLM. vLLM's answer is returned as it is.

With --api-key the chat route needs `Authorization: Bearer <key>`; --encoder-api-key and --vllm-api-key
are sent to the encoder and to vLLM. A body over --max-request-bytes is a 413 before it is read.

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
import socket
from dataclasses import dataclass, field
from collections.abc import Callable
from typing import Literal

import httpx
import torch
from fastapi import FastAPI, Request
from fastapi.responses import Response

from service import tracing
from service.lm.client import apost
from service.api.server import BodyLimit, bearer_auth, bound_url, error_response, install_error_handlers, serve_app
from service.errors import clip, GatewayError, RequestError

log = logging.getLogger(__name__)

ImageParts = Literal["raw", "embeds"]


@dataclass(frozen=True)
class RouterConfig:
    encoder_url: str  # one encoder, or several comma-separated (hosts of one Mooncake pool)
    vllm_url: str
    image_parts: ImageParts = "raw"
    timeout_s: float = 600.0
    max_tokens_limit: int = 4096  # the most max_tokens / max_completion_tokens forwarded (and the default sent)
    max_request_bytes: int = 64 * 1024**2  # the encoder's own default: a body of images it would take passes
    body_timeout_s: float = 30.0
    api_key: tuple[str, ...] = field(default=(), repr=False)  # bearer keys this router takes; none: open
    encoder_api_key: str | None = field(default=None, repr=False)  # sent to the encoders (their --api-key)
    vllm_api_key: str | None = field(default=None, repr=False)  # sent to vLLM (its --api-key)

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
# The content parts forwarded, with the keys each may have besides `type` (vLLM's chat_utils param types):
# image and video URLs (through the encoder), text, and image embeddings a client computed (vLLM
# fetches nothing for them).
PART_KEYS = {"image_url": {"image_url", "uuid"}, "video_url": {"video_url", "uuid"}, "text": {"text"},
             "input_text": {"text"}, "output_text": {"text"}, "refusal": {"refusal"},
             "thinking": {"thinking", "closed"}, "image_embeds": {"image_embeds", "uuid"}}
PASSED = frozenset(PART_KEYS) - set(ENCODED)  # parts forwarded as they are
URL_KEYS = {"image_url": {"url", "detail"}, "video_url": {"url"}}
MESSAGE_KEYS = {"role", "content", "name"}
ROLES = ("system", "user", "assistant")
# Request fields that vLLM 0.33 hashes with every media item (vllm/multimodal/processing/inputs.py,
# get_mm_hashes): with them a uuid is no longer the mm_hash, and the EC connector misses the entry.
HASHED_FIELDS = ("mm_processor_kwargs", "media_io_kwargs")


def _integer(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _tokens(lowest: int):
    def check(v, cfg: RouterConfig) -> str | None:
        if _integer(v) and lowest <= v <= cfg.max_tokens_limit:
            return None
        return f"an integer from {lowest} to {cfg.max_tokens_limit} (this router's --max-tokens-limit)"
    return check


def _strings(v, cfg) -> str | None:
    ok = isinstance(v, str) or (isinstance(v, list) and len(v) <= 16 and all(isinstance(x, str) for x in v))
    return None if ok else "a string or a list of at most 16 strings"


def _of(test: Callable[[object], bool], what: str):
    return lambda v, cfg: None if test(v) else what


_BOOL = _of(lambda v: v is None or isinstance(v, bool), "true, false or null")  # vLLM's `bool | None` fields
_NUMBER = _of(_number, "a number")
_INTEGER = _of(_integer, "an integer")
_OBJECT = _of(lambda v: isinstance(v, dict), "an object")
# The request fields forwarded to vLLM, each with its check (None: fine; else what it must be). What is
# bounded here is what makes a request's work grow: n, the token counts, top_logprobs, stop's length;
# vLLM validates the sampling values' ranges itself (they cost nothing). `messages` is checked part by
# part (check_request).
FIELDS: dict[str, Callable[[object, RouterConfig], str | None]] = {
    "model": _of(lambda v: isinstance(v, str), "a string"),
    "messages": lambda v, cfg: None,
    "max_tokens": _tokens(1), "max_completion_tokens": _tokens(1), "min_tokens": _tokens(0),
    "n": _of(lambda v: _integer(v) and v == 1, "1 (one answer per request here)"),
    "temperature": _NUMBER, "top_p": _NUMBER, "min_p": _NUMBER, "presence_penalty": _NUMBER,
    "frequency_penalty": _NUMBER, "repetition_penalty": _NUMBER, "top_k": _INTEGER, "seed": _INTEGER,
    "stop": _strings,
    "stream": _BOOL,
    "stream_options": _of(lambda v: isinstance(v, dict) and all(
        k in ("include_usage", "continuous_usage_stats") and isinstance(x, bool) for k, x in v.items()),
        "an object of include_usage and continuous_usage_stats, true or false"),
    "logprobs": _BOOL, "top_logprobs": _of(lambda v: _integer(v) and 0 <= v <= 20, "an integer from 0 to 20"),
    "user": _of(lambda v: isinstance(v, str), "a string"),
    "return_token_ids": _BOOL,
    # (beside media these are refused: media_parts)
    "mm_processor_kwargs": _OBJECT, "media_io_kwargs": _OBJECT,
}


def check_request(chat: object, cfg: RouterConfig) -> dict:
    """The request to route, as the client sent it plus `max_tokens` (--max-tokens-limit) where it gives no
    bound; `bad_request` naming the first field, message or part this router does not forward as it is."""
    if not isinstance(chat, dict):
        raise RequestError("the body must be a JSON object")
    for name, value in chat.items():
        check = FIELDS.get(name)
        if check is None:
            raise RequestError(f"{clip(name)!r} is not a field this router forwards; it forwards "
                             f"{', '.join(FIELDS)}: leave it out")
        problem = check(value, cfg)
        if problem is not None:
            raise RequestError(f"{name!r} must be {problem}")
    messages = chat.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list of message objects ({\"role\", \"content\"})")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise RequestError(f"messages[{i}] must be an object with 'role' and 'content'")
        if extra := sorted(set(m) - MESSAGE_KEYS):
            raise RequestError(f"messages[{i}] has {clip(extra[0])!r}: this router forwards a message's role, content "
                             "and name (no tools)")
        if m.get("role") not in ROLES:
            raise RequestError(f"messages[{i}].role must be one of {', '.join(ROLES)}")
        if not isinstance(m.get("name", ""), str):
            raise RequestError(f"messages[{i}].name must be a string")
        content = m.get("content")
        if isinstance(content, str):
            continue
        if not isinstance(content, list):
            raise RequestError(f"messages[{i}].content must be a string or a list of content parts")
        for j, p in enumerate(content):
            _check_part(p, f"messages[{i}].content[{j}]")
    if "max_tokens" not in chat and "max_completion_tokens" not in chat:
        # vLLM's own default is the whole context left after the prompt
        chat = {**chat, "max_tokens": cfg.max_tokens_limit}
    return chat


def _check_part(p: object, where: str) -> None:
    if not isinstance(p, dict):
        raise RequestError(f"{where} must be an object with a 'type'")
    kind = p.get("type")
    if not isinstance(kind, str) or kind not in PART_KEYS:
        return  # media_parts says why (a part vLLM would read itself)
    if extra := sorted(set(p) - PART_KEYS[kind] - {"type"}):
        raise RequestError(f"{where} ({kind}) has {clip(str(extra[0]))!r}; this router forwards its "
                         f"{', '.join(sorted(PART_KEYS[kind]))}")
    if "uuid" in p and not isinstance(p["uuid"], str):
        raise RequestError(f"{where}.uuid must be a string")
    if kind in URL_KEYS:
        url = p.get(kind)
        if not isinstance(url, dict) or not isinstance(url.get("url"), str) or set(url) - URL_KEYS[kind]:
            raise RequestError(f"{where}.{kind} must be an object with a string 'url'"
                             + (" (and 'detail')" if kind == "image_url" else ""))
    elif kind == "image_embeds":
        embeds = p.get("image_embeds")
        if not (embeds is None or isinstance(embeds, str) or
                (isinstance(embeds, dict) and all(isinstance(v, str) for v in embeds.values()))):
            raise RequestError(f"{where}.image_embeds must be a base64 string, an object of them, or null")
    else:
        for key in PART_KEYS[kind] - {"closed"}:
            if not isinstance(p.get(key), str):
                raise RequestError(f"{where}.{key} must be a string")
        if not isinstance(p.get("closed", False), bool):
            raise RequestError(f"{where}.closed must be true or false")


def media_parts(chat: dict) -> list[dict]:
    """The request's `image_url` and `video_url` content parts, in order (the dicts themselves, to be
    rewritten). `bad_request` for what the router cannot route: any other part vLLM would read as media
    (it also infers a part's type from its keys), or per-request options that change vLLM's mm_hash."""
    parts = []
    for i, m in enumerate(chat.get("messages", [])):
        content = m.get("content") if isinstance(m, dict) else None
        for j, p in enumerate(content if isinstance(content, list) else []):
            kind = p.get("type") if isinstance(p, dict) else None
            if not isinstance(kind, (str, type(None))):  # (a list is no set member: it would raise)
                raise RequestError(f"messages[{i}].content[{j}].type must be a string")
            if kind in ENCODED:
                parts.append(p)
            elif kind not in PASSED:
                shown = f"type {kind!r}" if kind is not None else "no type"
                raise RequestError(f"messages[{i}].content[{j}] has {shown}: this router sends text, image_url and "
                                 "video_url parts (each through the encoder) and image_embeds; vLLM would read "
                                 "any other part itself, passing by the encoder. Send images as image_url and "
                                 "videos as video_url, with their type")
    for field in HASHED_FIELDS:
        if parts and chat.get(field):
            raise RequestError(f"{field} with images or videos: vLLM hashes them into each item's mm_hash, so it "
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


def _bearer(key: str | None) -> dict[str, str] | None:
    return {"authorization": f"Bearer {key}"} if key else None


def create_router_app(cfg: RouterConfig, transport: httpx.AsyncBaseTransport | None = None) -> FastAPI:
    """The router's app; `transport` (tests): how its calls to the encoders and vLLM travel, httpx's own by
    default."""
    app = FastAPI(title="Qwen3-VL encoder -> vLLM router", version="0.1.0")
    # The body's size and pace, as the encoder bounds its /encode (a 100 MB body was read whole).
    app.add_middleware(BodyLimit, limit=cfg.max_request_bytes, timeout_s=cfg.body_timeout_s,
                       paths=("/v1/chat/completions",), hint="send fewer or smaller images and videos")
    install_error_handlers(app)
    authorized = bearer_auth(cfg.api_key)
    app.state.encoders = [httpx.AsyncClient(base_url=url, timeout=cfg.timeout_s, transport=transport,
                                            headers=_bearer(cfg.encoder_api_key)) for url in cfg.encoder_urls]
    app.state.vllm = httpx.AsyncClient(base_url=cfg.vllm_url, timeout=cfg.timeout_s, transport=transport,
                                       headers=_bearer(cfg.vllm_api_key))

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
                return error_response(GatewayError(f"the encoder could not be reached: {type(answer).__name__}: "
                                                 f"{answer}", code="encoder_unavailable"))
            if isinstance(answer, BaseException):
                raise answer
            positions, r = answer
            if r.status_code == 401:  # our key, not the client's: the client can do nothing about it
                return error_response(GatewayError("the encoder refused this router's key; start the router with "
                                                  "the encoder's key (--encoder-api-key or QVE_ENCODER_API_KEY)",
                                                  code="encoder_unauthorized"))
            if r.status_code != 200:  # a bad image (4xx) or overload (429/503): the client's answer as it is
                return _relayed(r, positions)
            for pos, item in zip(positions, r.json()["items"]):
                items[pos] = item
        return items

    @app.post("/v1/chat/completions")
    async def completions(request: Request):
        if not authorized(request):
            raise RequestError("this router needs an API key: send `Authorization: Bearer <key>`", code="unauthorized")
        body = await request.body()  # (BodyLimit: 413 over --max-request-bytes, 408 on a stall)
        try:
            chat = json.loads(body)
        except ValueError as e:  # (UnicodeDecodeError included)
            raise RequestError(f"the body is not JSON: {clip(str(e), 120)}") from None
        chat = check_request(chat, cfg)
        parts = media_parts(chat)
        items: list[dict] = []
        if parts:
            answer = await encode([{k: v for k, v in p.items() if k in ("type", *ENCODED, "uuid")} for p in parts])
            if isinstance(answer, Response):
                return answer
            items = answer
            for i, (part, item) in enumerate(zip(parts, items)):
                sent = "video" if part["type"] == "video_url" else "image"
                if item.get("modality", "image") != sent:
                    return error_response(GatewayError(
                        f"the encoder answered media part {i} ({sent}) as an {item.get('modality', 'image')}: "
                        "does it take videos?", code="embeddings_mismatch"))
        try:
            r = await app.state.vllm.post("/v1/chat/completions", json=vllm_request(chat, items, cfg.image_parts),
                                          headers=tracing.outgoing())
        except httpx.HTTPError as e:
            return error_response(GatewayError(f"vLLM could not be reached: {type(e).__name__}: {e}", code="lm_unavailable"))
        if r.status_code == 401:  # our key, not the client's: the client can do nothing about it
            return error_response(GatewayError("vLLM refused this router's key; start the router with vLLM's key "
                                              "(--vllm-api-key or QVE_VLLM_API_KEY)", code="lm_unauthorized"))
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


def serve(cfg: RouterConfig, sock: socket.socket, log_level: str = "info") -> int:
    """`route`: serve on `sock` (bound by the CLI before torch was imported: a port in use fails at once)."""
    log.info("listening on %s: encoding at %s, forwarding to vLLM at %s", bound_url(sock), cfg.encoder_url, cfg.vllm_url)
    return serve_app(create_router_app(cfg), sock, log_level)
