"""The consumer's request path and its app: a chat request admitted (or a 429), its text counted against
the prompt limit, its images and videos encoded by the encoder and read from the store, then the one LM's
greedy answer, within the request's deadline and stopped when its client leaves."""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from contextlib import contextmanager
from dataclasses import replace
from typing import Literal

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse
from pydantic import ValidationError

from service import tracing
from service.api.schemas import ImagePart, VideoPart, describe_invalid
from service.api.server import BodyLimit, bearer_auth, bound_url, install_error_handlers, serve_app
from service.engine.loader import checkpoint_model_id, same_tower
from service.errors import DeadlineExceeded, GatewayError, ModelLoadError, Overloaded, Relayed, RequestError
from service.lm.chat.config import ChatConfig
from service.lm.chat.model import LanguageModel
from service.lm.chat.schemas import ChatRequest
from service.lm.client import apost
from service.store.format import StoredEmbeddings, StoreFormatError
from service.store.reader import is_mooncake, open_reader

log = logging.getLogger(__name__)

POLL_S = 0.1  # how often a request in progress looks whether its client is still there


class Cancel:
    """Why one request's work should stop: its deadline passed, or its client left. Set by the request's
    watcher (event loop) and read by its generation thread after every token."""

    def __init__(self, deadline: float):
        self.deadline = deadline  # time.monotonic()
        self.reason: Literal["deadline", "client gone"] | None = None
        self.phase = "admitted"  # where the request is, for the deadline's message
        self.fired = False  # the generation stopped on it (its tokens are not the whole answer)
        self._event = threading.Event()

    def set(self, reason: Literal["deadline", "client gone"]) -> None:
        if self.reason is None:
            self.reason = reason
        self._event.set()

    def stopped(self) -> bool:
        if not self._event.is_set() and time.monotonic() >= self.deadline:
            self.set("deadline")
        return self._event.is_set()

    def in_generation(self) -> bool:
        """`stopped`, as the generation thread asks it: records that the generation ended on it."""
        if self.stopped():
            self.fired = True
        return self.fired


class ClientGone(Exception):
    """The client disconnected: nobody to answer (not a ServiceError: no answer is sent)."""


class Admission:
    """The LM's queue: at most `max_waiting` requests admitted behind the one generating, counted from the
    moment the body is in until the answer (encoding, tokenising, waiting for the LM); one more is a 429
    at once. One event loop, so a plain counter."""

    def __init__(self, max_waiting: int):
        self.max_waiting, self.inside = max_waiting, 0

    @contextmanager
    def __call__(self):
        if self.inside > self.max_waiting:
            raise Overloaded(f"{self.inside} chat requests are in progress here: one generating and "
                             f"{self.max_waiting} waiting (--max-waiting); retry after Retry-After seconds")
        self.inside += 1
        try:
            yield
        finally:
            self.inside -= 1


class Chat:
    def __init__(self, cfg: ChatConfig, lm: LanguageModel, encoder_transport: httpx.AsyncBaseTransport | None = None):
        self.cfg, self.lm = cfg, lm
        headers = {"authorization": f"Bearer {cfg.encoder_api_key}"} if cfg.encoder_api_key else None
        self.http = httpx.AsyncClient(base_url=cfg.encoder_url, timeout=cfg.encoder_timeout_s, headers=headers,
                                      transport=encoder_transport)
        self.reader = open_reader(cfg.store, local_host=cfg.mooncake_local_host, timeout_s=cfg.mooncake_timeout_s) \
            if is_mooncake(cfg.store) else open_reader(cfg.store)
        self.admission = Admission(cfg.max_waiting)
        self.turn = asyncio.Lock()  # one generation at a time, in arrival order (asyncio's lock is FIFO)

    async def encode(self, parts: list[ImagePart | VideoPart]) -> list[dict]:
        """POST the image and video parts to the encoder; its items, in order. Its 4xx/503 pass through as ours."""
        body = {"images": [p.model_dump(exclude_none=True) for p in parts]}
        try:
            r, _ = await apost(self.http, "/encode", json=body)  # retried once if the connection was stale
        except httpx.HTTPError as e:
            raise GatewayError(f"the encoder at {self.cfg.encoder_url} could not be reached: {type(e).__name__}: {e}",
                             code="encoder_unavailable") from None
        if r.status_code != 200:
            try:
                err = r.json()["error"]
                code, message = err["code"], f"encoder: {err['message']}"
            except (ValueError, KeyError, TypeError):
                code, message = "encoder_error", f"encoder answered {r.status_code}"
            if r.status_code == 401:  # our key, not the client's: the client can do nothing about it
                raise GatewayError(f"the encoder at {self.cfg.encoder_url} refused this consumer's key ({message}); "
                                 "start the consumer with the encoder's key (--encoder-api-key or "
                                 "QVE_ENCODER_API_KEY)", code="encoder_unauthorized")
            status = r.status_code if r.status_code < 500 or r.status_code == 503 else 502
            retry = r.headers.get("Retry-After")
            raise Relayed(status, code, message, int(retry) if retry and retry.isdigit() else None)
        return r.json()["items"]

    async def embeddings(self, parts: list[ImagePart | VideoPart]) -> list[tuple[dict, StoredEmbeddings]]:
        items = await self.encode(parts) if parts else []
        out = []
        for part, item in zip(parts, items):
            # NOTE: off the event loop: a read is a transfer from the entry's host (Mooncake), and one from a
            # host that does not answer waits for its deadline; on the loop it froze /health and every chat.
            emb = await asyncio.to_thread(self._read, item)
            if emb is None:  # evicted, its host lost or not answering, since the encoder's answer: ask once more
                log.warning("store entry %s missing after /encode answered it; re-requesting once", item["key"])
                (item,) = await self.encode([part])
                emb = await asyncio.to_thread(self._read, item)
            if emb is None:
                raise GatewayError(f"the encoder answered key {item['key']!r} twice, but {self.cfg.store} does not "
                                        "hold it: is --store the encoder's store root, and is the store large enough?", code="embeddings_missing")
            self._check_tower(item["key"], emb)
            sent = "image" if isinstance(part, ImagePart) else "video"
            if item.get("modality", "image") != sent:
                raise GatewayError(f"the encoder answered {item['key']!r} as an {item.get('modality', 'image')} for a "
                                 f"{sent} part: does it take videos?", code="embeddings_mismatch")
            try:
                self.lm.check(item["key"], emb, item)
            except StoreFormatError as e:
                raise GatewayError(f"store entry {item['key']!r}: {e}", code="embeddings_mismatch") from None
            out.append((item, emb))
        return out

    def _check_tower(self, key: str, emb: StoredEmbeddings) -> None:
        """An entry of another encoder model is refused: its shapes may fit this LM (the same architecture with
        other weights, a random preset) and its embeddings still mean nothing to it."""
        want, got = self.cfg.encoder_model, emb.metadata.get("model")
        if want is not None and not same_tower(got, want):
            raise GatewayError(f"store entry {key!r} holds the embeddings of the encoder model {got!r}, but this "
                               f"language model reads those of {want!r} (--encoder-model; by default its own "
                               "checkpoint's vision tower): serve the encoder with --model on this checkpoint, or "
                               "pass --encoder-model if its tower is meant to be another", code="embeddings_mismatch")

    def _read(self, item: dict) -> StoredEmbeddings | None:
        try:
            return self.reader.read(item["key"], item.get("store_key"))
        except KeyError:
            return None
        except StoreFormatError as e:
            raise GatewayError(str(e), code="embeddings_mismatch") from None

    async def answer(self, req: ChatRequest, client_gone: Callable[[], Awaitable[bool]]) -> dict:
        """`complete(req)` within the request's deadline, stopped when the client leaves (ClientGone) or the
        deadline passes (`deadline_exceeded`): a generation stops at its next token, and whatever the request
        was waiting for (the encoder, the LM) is cancelled."""
        cancel = Cancel(time.monotonic() + self.cfg.request_timeout_s)
        work = asyncio.ensure_future(self.complete(req, cancel))

        async def watch() -> None:
            while not cancel.stopped():
                if await client_gone():
                    cancel.set("client gone")
                    return
                await asyncio.sleep(POLL_S)

        watcher = asyncio.ensure_future(watch())
        try:
            await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not work.done():
                work.cancel()
                await asyncio.wait([work])  # a generation stops at its next token; the LM is handed on after
        if cancel.reason == "client gone":
            raise ClientGone()
        if work.cancelled():
            raise self._late(cancel)
        return work.result()

    def _late(self, cancel: Cancel) -> DeadlineExceeded:
        return DeadlineExceeded(f"no answer within {self.cfg.request_timeout_s:g} s (--request-timeout-s); the request "
                                f"was stopped while {cancel.phase}: ask for fewer max_tokens, or retry when the LM is "
                                "less busy")

    async def complete(self, req: ChatRequest, cancel: Cancel) -> dict:
        if req.temperature not in (None, 0, 0.0):
            raise RequestError(f"temperature {req.temperature}: only greedy decoding is supported; "
                             "send temperature 0 or leave it out")
        if req.max_tokens > self.cfg.max_tokens_limit:
            raise RequestError(f"max_tokens {req.max_tokens} is over this server's limit of "
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
        # The prompt is counted before the encoder is asked (a long prompt costs it nothing), then with the
        # media's rows; in a thread: tokenising takes a while, and the loop serves the other requests.
        cancel.phase = "tokenising"
        template_ids = await asyncio.to_thread(self._tokenise, messages, len(parts), req.max_tokens)
        cancel.phase = "encoding its images and videos"
        media = [e for _, e in await self.embeddings(parts)]
        input_ids = self.lm.prompt.expand(template_ids, media)
        self._check_prompt(len(input_ids), 0, req.max_tokens, media_rows=self.lm.prompt.media_rows(media))
        new = await self.generate(input_ids, media, req.max_tokens, cancel)
        finish = "stop" if new and new[-1] in self.lm.eos_ids else "length"
        choice = {"index": 0, "finish_reason": finish,
                  "message": {"role": "assistant", "content": self.lm.tokenizer.decode(new, skip_special_tokens=True)}}
        answer = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                  "model": req.model or self.lm.name, "choices": [choice],
                  "usage": {"prompt_tokens": len(input_ids), "completion_tokens": len(new),
                            "total_tokens": len(input_ids) + len(new)}}
        if req.return_token_ids:
            choice["token_ids"] = new
            answer["prompt_token_ids"] = input_ids  # vLLM's field: what the model read, placeholders expanded
        return answer

    def _tokenise(self, messages: list[dict], placeholders: int, max_tokens: int) -> list[int]:
        """The prompt's template_ids, checked against --max-prompt-tokens; first the messages' text alone,
        counted slice by slice (count_text), so that a text far over the limit is refused after about a
        limit's worth of tokenising, whatever its size (a megabyte of text took seconds to tokenise whole)."""
        limit = self.cfg.max_prompt_tokens
        texts = [t for m in messages for t in ([m["content"]] if isinstance(m["content"], str) else
                                               [p["text"] for p in m["content"] if p["type"] == "text"])]
        # Inside the template a text's first and last tokens can merge with the markup beside them: two
        # tokens of slack per text, so that this early count never refuses what the exact one would take.
        slack, seen = 2 * len(texts), 0
        for text in texts:
            seen += self.lm.prompt.count_text(text, limit + slack - seen)
            if seen > limit + slack:
                raise RequestError(f"the messages' text is over this server's limit of {limit} prompt tokens "
                                 f"(--max-prompt-tokens; {seen} counted before the count stopped); send less text")
        ids = self.lm.prompt.template_ids(messages)
        self._check_prompt(len(ids), placeholders, max_tokens)
        return ids

    def _check_prompt(self, tokens: int, placeholders: int, max_tokens: int, media_rows: int | None = None) -> None:
        """A prompt over --max-prompt-tokens, or one whose answer would pass the model's context, is a 400
        before the LM is taken. Before the encoder answers (`media_rows` None) each image or video counts
        one token; it will count at least that."""
        limit, context = self.cfg.max_prompt_tokens, self.lm.context
        if tokens > limit:
            what = (f"{tokens - placeholders} tokens of text and chat markup" if media_rows is None else
                    f"{tokens} tokens, {media_rows} of them images and videos")
            raise RequestError(f"the prompt is {what}, over this server's limit of {limit} prompt tokens "
                             "(--max-prompt-tokens); send less text, or fewer or smaller images and videos")
        if context is not None and tokens + max_tokens > context:
            raise RequestError(f"the prompt's {tokens} tokens and max_tokens {max_tokens} pass the model's context "
                             f"of {context} tokens; ask for fewer")

    def _generation(self, input_ids: list[int], media: list[StoredEmbeddings], max_tokens: int, stop) -> list[int]:
        """The LM's generation (its thread), a `generation` span with tracing on (to_thread carries the context)."""
        with tracing.span("generation", prompt_tokens=len(input_ids), max_tokens=max_tokens) as span:
            new = self.lm.generate(input_ids, media, max_tokens, stop)
            if span is not None:
                span.set_attribute("completion_tokens", len(new))
            return new

    async def generate(self, input_ids: list[int], media: list[StoredEmbeddings], max_tokens: int,
                       cancel: Cancel) -> list[int]:
        """The LM's greedy tokens, one request at a time (first come, first served), stopped by `cancel`."""
        cancel.phase = "waiting for the LM"
        async with self.turn:
            cancel.phase = "generating"
            work = asyncio.ensure_future(asyncio.to_thread(self._generation, input_ids, media, max_tokens,
                                                           cancel.in_generation))
            try:
                new = await asyncio.shield(work)
            except asyncio.CancelledError:
                # Cancelled from outside (the deadline or a disconnect seen by the watcher, which set
                # `cancel`; or a shutdown): the thread stops at its next token. The LM is handed on only
                # once it has: no two generations on one model.
                cancel.set("deadline")  # (a no-op when the watcher set its reason first)
                await asyncio.wait([work])
                raise
        if cancel.fired:  # the thread stopped on the deadline it checks itself: a part answer is no answer
            if cancel.reason == "client gone":
                raise ClientGone()
            raise self._late(cancel)
        return new


def create_chat_app(cfg: ChatConfig, lm: LanguageModel, encoder_transport: httpx.AsyncBaseTransport | None = None,
                    ) -> FastAPI:
    """The consumer's app; `encoder_transport` (tests): how its encoder calls travel, httpx's own by default."""
    chat = Chat(cfg, lm, encoder_transport)
    app = FastAPI(title="Qwen3-VL LM consumer", version="0.1.0",
                  description="Answers chat requests from the image and video embeddings the encoder service stored.")
    app.state.chat = chat
    started = int(time.time())
    # The body's size and pace, as the encoder bounds its /encode (a 100 MB body was read whole).
    app.add_middleware(BodyLimit, limit=cfg.max_request_bytes, timeout_s=cfg.body_timeout_s,
                       paths=("/v1/chat/completions",), hint="send less text, or fewer or smaller images and videos")
    install_error_handlers(app)
    authorized = bearer_auth(cfg.api_key)

    def authorize(request: Request) -> None:
        if not authorized(request):
            raise RequestError("this consumer needs an API key: send `Authorization: Bearer <key>`", code="unauthorized")

    @app.post("/v1/chat/completions")
    async def completions(request: Request):
        authorize(request)
        body = await request.body()  # (BodyLimit: 413 over --max-request-bytes, 408 on a stall)
        try:
            req = ChatRequest.model_validate_json(body)
        except ValidationError as e:
            raise RequestError(describe_invalid(e)) from None
        with chat.admission():
            try:
                return await chat.answer(req, request.is_disconnected)
            except ClientGone:
                log.info("chat request stopped: its client disconnected")
                return PlainTextResponse("client disconnected", status_code=499)  # nobody reads it

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/ready")
    async def ready(request: Request):
        """200 once the LM is loaded. With --api-key, the details (model, encoder, store, queue) only to a
        request with the key: a load balancer's probe needs just `ready`."""
        if not authorized(request):
            return {"ready": True}
        return {"ready": True, "model": lm.name, "encoder": cfg.encoder_url, "store": str(cfg.store),
                "requests": chat.admission.inside}

    @app.get("/v1/models")
    async def models(request: Request):
        """OpenAI's model list (clients ask it first): the one model this consumer serves."""
        authorize(request)
        return {"object": "list", "data": [{"id": lm.name, "object": "model", "created": started,
                                            "owned_by": "qwen3vl-encoder"}]}

    return app


def serve(cfg: ChatConfig, sock: socket.socket, log_level: str = "info") -> int:
    """`consume`: load the LM, then serve on `sock` (bound by the CLI first: a port in use fails at once).
    `cfg.encoder_model` "auto" becomes the checkpoint's own tower, "any" None (no check)."""
    log.info("listening on %s; loading the language model from %s (requests wait until it is loaded)",
             bound_url(sock), cfg.model)
    try:
        encoder_model = {"auto": lambda: checkpoint_model_id(cfg.model), "any": lambda: None}.get(
            cfg.encoder_model, lambda: cfg.encoder_model)()
        cfg = replace(cfg, encoder_model=encoder_model)
        lm = LanguageModel(cfg)
    except ModelLoadError as e:
        print(f"cannot load the language model: {e}", flush=True)
        return 2
    log.info("reading the store entries of the encoder model %s", encoder_model or "(any: --encoder-model any)")
    for warning in encoder_warnings(cfg):
        log.warning("%s", warning)
    return serve_app(create_chat_app(cfg, lm), sock, log_level)


def encoder_warnings(cfg: ChatConfig, timeout_s: float = 3.0) -> list[str]:
    """What the encoder's /ready says that makes its answers useless to this LM: random weights, another model.
    Asked once at start (an encoder not up yet is checked entry by entry all the same)."""
    headers = {"authorization": f"Bearer {cfg.encoder_api_key}"} if cfg.encoder_api_key else None
    try:
        r = httpx.get(cfg.encoder_url.rstrip("/") + "/ready", headers=headers, timeout=timeout_s)
        info = r.json() if r.status_code == 200 else {}
    except (httpx.HTTPError, ValueError) as e:
        log.info("the encoder at %s did not answer /ready (%s): its model is checked entry by entry", cfg.encoder_url,
                 type(e).__name__)
        return []
    model, out = info.get("model"), []
    if info.get("random_weights"):
        out.append(f"the encoder at {cfg.encoder_url} serves {model} with RANDOM weights: its embeddings mean "
                   f"nothing to this language model; serve it with --model {cfg.model}")
    if model and cfg.encoder_model is not None and not same_tower(model, cfg.encoder_model):
        out.append(f"the encoder at {cfg.encoder_url} serves {model}, not the vision tower this language model reads "
                   f"({cfg.encoder_model}): its entries will be refused (502 embeddings_mismatch)")
    return out
