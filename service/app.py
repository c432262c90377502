"""HTTP front end: parse and validate requests, check the store, hand work to the batcher, answer.

Handlers never see tensors: they deal in bytes, keys, futures and StoredItems. Decoding and
preprocessing run in a process pool, off the event loop. Every ServiceError becomes its HTTP status
in one place (`errors.HTTP_STATUS`), as `{"error": {"code", "message", "index"?}}`.
"""

from __future__ import annotations

import asyncio
import binascii
import concurrent.futures
import hashlib
import hmac
import ipaddress
import logging
import multiprocessing
import os
import socket
import threading
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Literal
from urllib.parse import urlsplit

import httpx
import numpy as np
import pybase64
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from pydantic import BaseModel, Field, ValidationError

from .batcher import Reservation, Ticket
from .boot import server_options  # noqa: F401  (re-exported: the supervisor and the tests take it from here)
from .config import ImageLimits, Settings
from .docs import mount_docs
from .engine import EncodeJob, Engine
from .enginep import build_batcher, build_store, key_salt, model_info
from .errors import (
    BackendError,
    BadRequest,
    EmptyImage,
    ImageError,
    ImageFetchError,
    ImageTooLarge,
    KeyConflict,
    Overloaded,
    RequestTimeout,
    RequestTooLarge,
    ServiceError,
    Unauthorized,
    Unavailable,
    error_body,
    http_status,
)
from .images import PreparedImage, header_tokens, prepare_image
from .loader import LoadedModel, load_model
from .metrics import Metrics
from .store import CONTENT_KEY_PREFIX, StoredItem, validate_key
from .supervisor import exit_with

log = logging.getLogger(__name__)


# ---- request / response schemas (OpenAI content-part shape) ---------------------------------------
class ImageURL(BaseModel):
    url: str = Field(description="data:image/...;base64,... or an http(s) URL on the allow-list")


class ImagePart(BaseModel):
    type: Literal["image_url"] = "image_url"
    image_url: ImageURL
    uuid: str | None = Field(None, description="optional store key; default: content hash")


class EncodeRequest(BaseModel):
    images: list[ImagePart] = Field(min_length=1)


class EncodedItem(BaseModel):
    key: str
    num_tokens: int
    grid_thw: list[int]
    shape: list[int]
    dtype: str
    cached: bool
    path: str = Field(description="relative to the store root: <key>/encoder_cache.safetensors")


class EncodeResponse(BaseModel):
    items: list[EncodedItem]


class ErrorDetail(BaseModel):
    code: str = Field(description="machine-readable, e.g. not_an_image, key_conflict, overloaded")
    message: str = Field(description="what was wrong, for a person")
    index: int | None = Field(None, description="the image's position in the request, for per-image errors")


class ErrorResponse(BaseModel):
    """The shape of every error answer (errors.error_body)."""

    error: ErrorDetail


_ERROR_RESPONSES = {status: {"model": ErrorResponse, "description": what} for status, what in (
    (400, "malformed request"), (401, "missing or wrong API key"), (408, "the request body stalled"),
    (409, "a uuid already names other image bytes"), (413, "an image or the request is too large"),
    (415, "an image format that is not supported"), (422, "an image that cannot be used, or an invalid key"),
    (429, "the queue is full: retry after Retry-After seconds"), (500, "an encoding step failed"),
    (503, "starting, shutting down, or the store is full: retry after Retry-After seconds"))}
_HEALTH = {"description": "the service's state, in words", "content": {"application/json": {"schema": {
    "type": "object", "properties": {"status": {"type": "string"}}, "required": ["status"]}}}}
# The JSON request body's schema, with its nested models as OpenAPI components (not dangling $defs).
_REQUEST_SCHEMA = EncodeRequest.model_json_schema(ref_template="#/components/schemas/{model}")
_REQUEST_DEFS = _REQUEST_SCHEMA.pop("$defs", {})


@dataclass
class _Input:
    data: bytes
    uuid: str | None
    source: str | None = None  # the URL it was fetched from (errors must not echo fetched content)


# ---- the running service --------------------------------------------------------------------------
class Runtime:
    """Everything one app instance owns. Built in the lifespan; torn down gracefully on shutdown."""

    def __init__(self, settings: Settings, model: LoadedModel):
        self.created_at = time.perf_counter()
        self.settings, self.model = settings, model
        self.metrics = Metrics()
        self.store = build_store(settings, model)
        self.batcher = build_batcher(settings)
        self.engine = Engine(model, self.store, self.batcher, settings, self.metrics)
        # Seconds per start-up phase: load, compile, graph capture (in the Runner), warm-up (in start()).
        self.startup: dict[str, float] = {"load_s": model.load_s, **self.engine.runner.startup}
        self.decode_workers = settings.decode_workers or min(8, os.cpu_count() or 1)
        self.decoders = self._decode_pool()
        self.http = httpx.AsyncClient(timeout=settings.url_timeout_s, follow_redirects=False)
        self.ready = threading.Event()
        self.started = False
        self.warmup_failed = False
        self.key_salt = key_salt(model).encode()

    def _decode_pool(self) -> concurrent.futures.ProcessPoolExecutor:
        # NOTE: processes, not threads: PIL decode + bicubic resize hold the GIL for most of their time.
        # forkserver/spawn, not fork: this process already runs threads (torch, the step loop).
        # Each worker exits when this process does: a SIGKILL of the service leaves no worker behind (and
        # then no forkserver: the workers were what kept it alive).
        method = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
        return concurrent.futures.ProcessPoolExecutor(self.decode_workers, mp_context=multiprocessing.get_context(method),
                                                      initializer=exit_with, initargs=(os.getpid(),))

    async def decode(self, data: bytes) -> PreparedImage:
        """prepare_image in a decode worker. A dead worker (the OOM killer's SIGKILL) breaks the whole
        pool: it is replaced at once and this image answered 503, so one death costs one request."""
        pool = self.decoders
        try:
            return await asyncio.get_running_loop().run_in_executor(
                pool, prepare_image, data, self.model.params, self.settings.image_limits)
        except concurrent.futures.BrokenExecutor:  # BrokenProcessPool
            if self.decoders is pool:
                log.error("a decode worker died (killed, out of memory?); starting a new pool")
                self.decoders = self._decode_pool()
                await asyncio.to_thread(pool.shutdown, wait=True, cancel_futures=True)
            raise Unavailable("an image decode worker died while decoding (out of memory?); it has been replaced: "
                              "retry", retry_after_s=1) from None

    def start(self) -> None:
        def warm_then_run():
            try:
                t0 = time.perf_counter()
                if self.settings.warmup:
                    image = _warmup_image(self.model)
                    self.engine.encode_sync([image])
                    # Start every decode worker now (imports, forkserver) rather than on the first requests.
                    blob = _warmup_png()
                    list(self.decoders.map(prepare_image, [blob] * self.decode_workers,
                                           [self.model.params] * self.decode_workers,
                                           [self.settings.image_limits] * self.decode_workers))
                self.startup["warmup_s"] = round(time.perf_counter() - t0, 2)
                self.startup["total_s"] = round(time.perf_counter() - self.created_at + self.model.load_s, 2)
                self.engine.start()
                self.started = True
                self.ready.set()
                log.info("ready: %s on %s (%s); start-up %s", self.model.model_id, self.model.device,
                         self.model.dtype, ", ".join(f"{k} {v}" for k, v in self.startup.items()))
            except Exception:
                self.warmup_failed = True
                log.exception("warm-up failed: /ready and /health will say so")

        threading.Thread(target=warm_then_run, name="warmup", daemon=True).start()

    async def shutdown(self) -> None:
        # uvicorn has already waited for open requests; close the queue, let the loop drain and the writer flush.
        self.batcher.close()
        await asyncio.to_thread(self.engine.join, 60)
        # NOTE: wait=True. Decode workers forked by the forkserver hold its liveness pipe; workers left
        # running (wait=False) keep the forkserver, and so themselves, alive after this process exits.
        await asyncio.to_thread(self.decoders.shutdown, wait=True, cancel_futures=True)
        await self.http.aclose()
        self.store.close()  # the writer is done: release the root for a later service


@dataclass
class RemoteEngine:
    """Where an API process finds its engines (supervisor mode: one per device) and its own pixel arena."""

    socket_paths: list[str]
    arena_name: str
    arena_bytes: int


class RemoteRuntime:
    """An API process's runtime (supervisor mode): no model, no tensors. Decodes in threads, writes
    pixels into its shared-memory arena, and asks the engine process (ipc.py) for everything else."""

    def __init__(self, settings: Settings, remote: RemoteEngine):
        from .arena import Arena
        from .ipc import EngineRouter

        self.settings = settings
        self.metrics = Metrics()
        self.arena = Arena(remote.arena_name, remote.arena_bytes)
        self.client = EngineRouter(remote.socket_paths, self._cell_free)
        # NOTE: threads, not processes: this process's only job is HTTP and decoding, and there are
        # several such processes; PIL releases the GIL while it decodes and resizes.
        self.decoders = concurrent.futures.ThreadPoolExecutor(settings.decode_workers or 4, thread_name_prefix="decode")
        self.http = httpx.AsyncClient(timeout=settings.url_timeout_s, follow_redirects=False)
        self.info: dict | None = None  # the engine's status, once it has answered
        self.params = None
        self.key_salt = b""
        self.engine_lost = False
        self.mismatch: str | None = None  # the engines disagree on keys / preprocessing (see EngineRouter.status)
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._connect())

    async def _connect(self) -> None:
        from .config import PreprocessParams
        from .ipc import EngineMismatch

        await self.client.connect()
        while self.client.connected:
            try:
                info = await self.client.status()
            except EngineMismatch as e:  # never ready: /health and /ready say why, and the log
                self.mismatch = str(e)
                log.error("%s", e)
                return
            if self.params is None:
                self.params = PreprocessParams(*[tuple(x) if isinstance(x, list) else x for x in info["params"]])
                self.key_salt = info["key_salt"].encode()
            self.info = info
            if info["info"]["ready"]:
                break
            await asyncio.sleep(0.2)
        self.engine_lost = not self.client.connected

    def _cell_free(self, segment: str, offset: int, nbytes: int) -> None:
        if segment == self.arena.name:
            self.free_cell(offset, nbytes)

    def free_cell(self, offset: int, nbytes: int) -> None:
        self.arena.free(offset, nbytes)
        # Kept current here, not at scrape time: any API process answers /metrics for all of them.
        self.metrics.arena_bytes.set(self.arena.used)

    @property
    def ready(self) -> bool:
        return bool(self.info and self.info["info"]["ready"] and self.client.connected)

    async def shutdown(self) -> None:
        if self._task is not None:
            self._task.cancel()
        await self.client.close()
        await asyncio.to_thread(self.decoders.shutdown, wait=True, cancel_futures=True)
        await self.http.aclose()
        log.info("pixel arena %s: %d bytes in use at exit", self.arena.name, self.arena.used)
        self.arena.close()


def _prepare_into_arena(rt: RemoteRuntime, data: bytes) -> tuple[PreparedImage, int]:
    """Decode + preprocess (a decode thread), then copy the pixels into a new arena cell."""
    from .arena import ArenaFull

    prep = prepare_image(data, rt.params, rt.settings.image_limits)
    try:
        off = rt.arena.alloc(prep.pixels.nbytes)
    except ArenaFull as e:
        raise Overloaded(f"too many images being decoded or queued in this process ({e}); retry shortly",
                         retry_after_s=1) from None
    rt.arena.view(off, prep.pixels.nbytes)[:] = prep.pixels.reshape(-1)
    rt.metrics.arena_bytes.set(rt.arena.used)
    return prep, off


async def _encode_remote(rt: RemoteRuntime, request: Request) -> list[EncodedItem] | None:
    """`_encode` for an API process: the same answers, with the engine process deciding hits,
    coalescing and admission (a claim per image, before it is decoded)."""
    if not rt.ready:
        raise Unavailable("the encoder is still starting (or its engine is not running); retry shortly",
                          retry_after_s=1)
    inputs = await _parse_inputs(rt, request)
    keys, shas = await _keys_for(rt, inputs)
    answers: dict[str, EncodedItem] = {}
    waits: dict[str, tuple[int, asyncio.Future, bool]] = {}  # key -> (request id, future, coalesced)
    grants: dict[str, tuple[int, int]] = {}  # key -> (grant id, image index) to decode

    def conflict(i: int, where: str) -> KeyConflict:
        return _at(KeyConflict(f"images[{i}]: uuid {keys[i]!r} is already bound to other image bytes ({where}); "
                               "a uuid must name one image: choose another uuid, or leave it out"), i)

    def give_back() -> None:
        for rid, fut, _ in waits.values():
            fut.cancel()
            rt.client.cancel(rid)
        for gid, _ in grants.values():
            rt.client.cancel(gid)

    loop = asyncio.get_running_loop()

    async def decode_and_submit(key: str, gid: int, i: int) -> None:
        try:
            prep, off = await loop.run_in_executor(rt.decoders, _prepare_into_arena, rt, inputs[i].data)
        except Exception as p:
            raise _decode_failure(inputs, i, p)
        h, w = prep.pixels.shape[:2]
        try:
            rid, fut = await rt.client.submit(gid, key, shas[i], rt.arena.name, off, prep.pixels.nbytes, h, w,
                                              prep.grid_thw, prep.num_tokens)
        except KeyConflict as e:
            raise conflict(i, e.message) from None
        except Unavailable:
            if not rt.client.route(key).connected:  # never reached its engine: nothing else will free the cell
                rt.free_cell(off, prep.pixels.nbytes)
            raise
        finally:
            del grants[key]  # a submit uses its grant up, answered or not
        waits[key] = (rid, fut, False)

    def first_error(outcomes: list) -> BaseException | None:
        return next((o for o in outcomes if isinstance(o, BaseException)), None)

    try:
        # One claim per distinct key, all in flight at once (a round trip each, not one after another).
        firsts: dict[str, int] = {}
        for i, key in enumerate(keys):
            firsts.setdefault(key, i)
        # Each claim names the image's tokens by its header: the engine admits by images and tokens before decode.
        tokens = await asyncio.to_thread(lambda: [header_tokens(inputs[i].data, rt.params, rt.settings.image_limits)
                                                  for i in firsts.values()])
        claims = await asyncio.gather(*(rt.client.claim(k, shas[i], n) for (k, i), n in zip(firsts.items(), tokens)),
                                      return_exceptions=True)
        for j, ((key, i), c) in enumerate(zip(firsts.items(), claims)):
            if isinstance(c, KeyConflict):
                claims[j] = conflict(i, c.message)
            elif isinstance(c, BaseException):
                continue
            else:
                kind, val = c
                if kind == "hit":
                    answers[key] = _item(val, cached=True)
                    rt.metrics.images.labels(outcome="cached").inc()
                elif kind == "joined":
                    waits[key] = (*val, True)
                else:
                    grants[key] = (val, i)
        if (err := first_error(claims)) is not None:
            raise err
        # Each image is submitted as soon as it is decoded.
        done = await asyncio.gather(*(decode_and_submit(k, gid, i) for k, (gid, i) in list(grants.items())),
                                    return_exceptions=True)
        if (err := first_error(done)) is not None:
            raise err
    except BaseException:
        give_back()  # the request is answered with its error as a whole: nothing of it stays queued
        raise
    futures = [fut for _, fut, _ in waits.values()]
    if not await _wait_or_disconnect(request, futures):
        give_back()
        return None
    for key, (_, fut, coalesced) in waits.items():
        answers[key] = _item(fut.result(), cached=False)
        rt.metrics.images.labels(outcome="coalesced" if coalesced else "encoded").inc()
    return [answers[key] for key in keys]


def _warmup_png() -> bytes:
    """A synthetic image of Qwen3-VL's minimum size (256x256 = 65536 pixels)."""
    import io

    from PIL import Image

    rng = np.random.default_rng(0)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (256, 256, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def _warmup_image(model: LoadedModel) -> PreparedImage:
    return prepare_image(_warmup_png(), model.params, ImageLimits())


def _at(err, index: int):
    """Tag a per-image error (ImageError, KeyConflict) with the image's position in the request."""
    err.index = index
    return err


# ---- parsing --------------------------------------------------------------------------------------
async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise ImageTooLarge(f"request body is {int(declared)} bytes, over the limit of {limit}; send fewer or smaller images")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ImageTooLarge(f"request body is over the limit of {limit} bytes; send fewer or smaller images")
        chunks.append(chunk)
    return b"".join(chunks)


def _decode_data_url(url: str, index: int, max_bytes: int) -> bytes:
    head, sep, payload = url.partition(",")
    if not sep or not head.startswith("data:") or not head.endswith(";base64"):
        raise BadRequest(f"images[{index}].image_url.url must be a data URL 'data:image/<fmt>;base64,<data>' "
                         f"or an allowed http(s) URL")
    if len(payload) > (max_bytes * 4) // 3 + 4:
        raise _at(ImageTooLarge(f"images[{index}] is over the limit of {max_bytes} bytes"), index)
    try:
        # pybase64: ~30x the standard library's speed, so far less time holding the GIL (8 vs 249 us a JPEG)
        return pybase64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise BadRequest(f"images[{index}].image_url.url has invalid base64 data: {e}") from None


def _url_host(url: str, index: int) -> tuple[str, int]:
    """(host, port) of an http(s) URL, or BadRequest for one that does not parse."""
    try:
        parts = urlsplit(url)
        host, port = (parts.hostname or "").lower(), parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError as e:  # "Invalid IPv6 URL", a port out of range, ...
        raise BadRequest(f"images[{index}].image_url.url is not a valid URL: {e}") from None
    if not host or any(c.isspace() or ord(c) < 32 for c in url):
        raise BadRequest(f"images[{index}].image_url.url is not a valid URL (no host, or whitespace or control "
                         "characters in it)")
    return host, port


async def _check_resolves_public(rt: Runtime, host: str, port: int, index: int) -> None:
    """Refuse a host that resolves to loopback, private, link-local or otherwise non-public addresses
    (the service's own /metrics, cloud metadata endpoints), unless --allow-private-url-addresses.
    NOTE: checked at resolution; the fetch resolves again, so a DNS-rebinding host could still switch
    addresses in between. Only allow-listed hosts get here."""
    if rt.settings.allow_private_url_addresses:
        return
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as e:
        raise _at(ImageFetchError(f"images[{index}]: cannot resolve {host!r}: {e}"), index) from None
    for *_, sockaddr in infos:
        addr = ipaddress.ip_address(sockaddr[0].split("%")[0])
        if not addr.is_global:
            raise _at(ImageFetchError(f"images[{index}]: {host!r} resolves to {addr}, a loopback, private or "
                                      "link-local address; such fetches are refused (--allow-private-url-addresses)"),
                      index)


async def _fetch_url(rt: Runtime, url: str, index: int) -> bytes:
    host, port = _url_host(url, index)
    if host not in rt.settings.allowed_url_hosts:
        raise _at(ImageFetchError(f"images[{index}]: fetching from {host!r} is not allowed; send a data URL, or add "
                                      f"the host to --allowed-url-hosts"), index)
    await _check_resolves_public(rt, host, port, index)
    limit = rt.settings.max_image_bytes
    try:
        async with rt.http.stream("GET", url) as resp:
            if resp.status_code != 200:
                raise _at(ImageFetchError(f"images[{index}]: GET {url} answered {resp.status_code}"), index)
            chunks, size = [], 0
            async for chunk in resp.aiter_bytes():
                size += len(chunk)
                if size > limit:
                    raise _at(ImageTooLarge(f"images[{index}]: {url} is over the limit of {limit} bytes"), index)
                chunks.append(chunk)
            return b"".join(chunks)
    except (httpx.HTTPError, httpx.InvalidURL) as e:
        raise _at(ImageFetchError(f"images[{index}]: could not fetch {url}: {type(e).__name__}: {e}"), index) from None


async def _parse_inputs(rt: Runtime, request: Request) -> list[_Input]:
    s = rt.settings
    limit = min(s.max_request_bytes, s.max_images_per_request * s.max_image_bytes * 4 // 3 + 65536)
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype == "multipart/form-data":
        try:
            form = await request.form(max_files=s.max_images_per_request, max_fields=2 * s.max_images_per_request)
        except ServiceError:
            raise  # RequestTooLarge from the body limit, as it is
        except Exception as e:  # starlette raises MultiPartException / HTTPException on malformed bodies
            raise BadRequest(f"malformed multipart body: {e}") from None
        files = form.getlist("image")
        uuids = form.getlist("uuid")
        if not files:
            raise BadRequest("multipart request has no 'image' file parts")
        if uuids and len(uuids) != len(files):
            raise BadRequest(f"got {len(uuids)} 'uuid' fields for {len(files)} images; send one per image or none")
        inputs = []
        for i, f in enumerate(files):
            if isinstance(f, str):
                raise BadRequest(f"'image' part {i} is a text field; send it as a file part")
            data = await f.read(s.max_image_bytes + 1)
            if len(data) > s.max_image_bytes:
                raise _at(ImageTooLarge(f"images[{i}] is over the limit of {s.max_image_bytes} bytes"), i)
            inputs.append(_Input(data, uuids[i] if uuids else None))
        return inputs
    if ctype not in ("application/json", ""):
        raise BadRequest(f"content-type {ctype!r} is not supported; send application/json or multipart/form-data")
    body = await _read_body(request, limit)
    try:
        req = EncodeRequest.model_validate_json(body)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise BadRequest(f"invalid request body at '{where}': {first['msg']} ({e.error_count()} error(s))") from None
    if len(req.images) > s.max_images_per_request:
        raise BadRequest(f"{len(req.images)} images in one request; the limit is {s.max_images_per_request}")
    inputs = []
    for i, part in enumerate(req.images):
        url = part.image_url.url
        if url.startswith("data:"):
            data = _decode_data_url(url, i, s.max_image_bytes)
        elif url.startswith(("http://", "https://")):
            data = await _fetch_url(rt, url, i)
            inputs.append(_Input(data, part.uuid, source=url))
            continue
        else:
            raise BadRequest(f"images[{i}].image_url.url must start with data:, http:// or https://")
        inputs.append(_Input(data, part.uuid))
    return inputs


def _digests(rt: Runtime, data: bytes) -> tuple[str, str]:
    """(SHA-256 of the image bytes, the content key): the key also covers the model and preprocessing,
    so the same bytes under another model are another key; its prefix keeps it out of uuid space."""
    content = hashlib.sha256(data).hexdigest()
    h = hashlib.sha256(rt.key_salt)
    h.update(b"\0")
    h.update(data)
    return content, CONTENT_KEY_PREFIX + h.hexdigest()


def _item(stored: StoredItem, cached: bool) -> EncodedItem:
    return EncodedItem(key=stored.key, num_tokens=stored.num_tokens, grid_thw=list(stored.grid_thw),
                       shape=list(stored.shape), dtype=stored.dtype, cached=cached, path=stored.path)


async def _wait_or_disconnect(request: Request, futures: list[asyncio.Future]) -> bool:
    """Wait for all futures; False if the client went away first."""
    gathered = asyncio.gather(*futures)

    async def watch():
        while not await request.is_disconnected():
            await asyncio.sleep(0.05)

    watcher = asyncio.create_task(watch())
    try:
        done, _ = await asyncio.wait({gathered, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if gathered in done:
        gathered.result()  # re-raise a step failure
        return True
    gathered.cancel()
    return False


# ---- the app --------------------------------------------------------------------------------------
class _BodyLimit:
    """ASGI middleware: an /encode body over `limit` bytes is answered 413 before it is read (declared
    Content-Length) or as soon as the bytes streamed in pass the limit (chunked), JSON and multipart
    alike: nothing over the limit is buffered or spooled to disk. A body whose next part takes longer
    than `timeout_s` to arrive is answered 408."""

    def __init__(self, app, limit: int, timeout_s: float):
        self.app, self.limit, self.timeout_s = app, limit, timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] != "/encode":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.limit:
            body = error_body(RequestTooLarge.code, f"request body is {int(declared)} bytes, over the limit of "
                              f"{self.limit} (--max-request-bytes); send fewer or smaller images")
            return await JSONResponse(body, status_code=413, headers={"Connection": "close"})(scope, receive, send)
        seen, body_done = 0, False

        async def counted():
            nonlocal seen, body_done
            if body_done:  # later receives wait for a disconnect, as long as a request takes: no timeout
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), self.timeout_s)
            except asyncio.TimeoutError:
                raise RequestTimeout(f"no part of the request body arrived for {self.timeout_s:g} s "
                                     "(--body-timeout-s); send the body without pauses") from None
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                body_done = not message.get("more_body", False)
                if seen > self.limit:
                    raise RequestTooLarge(f"request body is over the limit of {self.limit} bytes "
                                          "(--max-request-bytes); send fewer or smaller images")
            return message

        await self.app(scope, counted, send)


def create_app(settings: Settings, model: LoadedModel | None = None, remote: RemoteEngine | None = None) -> FastAPI:
    """The app of a single-process service (the model in this process), or, with `remote`, of one
    API process of a supervised service (the model in the engine process)."""
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if remote is not None:
            rt = RemoteRuntime(settings, remote)
            app.state.rt = rt
            await rt.start()
        else:
            loaded = model or await asyncio.to_thread(load_model, settings)
            # In a thread: on cuda the Engine compiles and captures graphs (seconds), and meanwhile the
            # loop keeps answering (service/boot.py answers /ready with the phase).
            rt = await asyncio.to_thread(Runtime, settings, loaded)
            app.state.rt = rt
            rt.start()
        try:
            yield
        finally:
            await rt.shutdown()

    app = FastAPI(title="Qwen3-VL encoder service", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None,
                  description="Runs only the Qwen3-VL vision tower and publishes embeddings to a shared store.")
    mount_docs(app)  # /docs from the package, not a CDN
    app.add_middleware(_BodyLimit, limit=settings.max_request_bytes, timeout_s=settings.body_timeout_s)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, err: StarletteHTTPException):
        # Routing errors (404, 405, ...) in the service's one error shape, not FastAPI's {"detail": ...}.
        codes = {404: "not_found", 405: "method_not_allowed"}
        message = {404: f"no such endpoint: {request.method} {request.url.path}; see /docs",
                   405: f"{request.method} is not allowed on {request.url.path}"}.get(err.status_code, str(err.detail))
        return JSONResponse(error_body(codes.get(err.status_code, "http_error"), message),
                            status_code=err.status_code, headers=getattr(err, "headers", None))

    @app.exception_handler(ServiceError)
    async def _service_error(request: Request, err: ServiceError):
        # `index`: per-image errors (ImageError, KeyConflict) carry the image's position
        body = error_body(err.code, err.message, getattr(err, "index", None))
        retry = getattr(err, "retry_after_s", None)  # overload, a full store: transient, say when to retry
        headers = {"Retry-After": str(retry)} if retry is not None else None
        if isinstance(err, Unauthorized):
            headers = {"WWW-Authenticate": "Bearer"}
        return JSONResponse(body, status_code=http_status(err), headers=headers)

    keys = [k.encode() for k in settings.api_key]

    generate_openapi = app.openapi

    def openapi() -> dict:
        doc = generate_openapi()  # cached by FastAPI: the additions below are made once
        doc["components"]["schemas"].update({"EncodeRequest": _REQUEST_SCHEMA, **_REQUEST_DEFS})
        return doc

    app.openapi = openapi

    def authorize(request: Request) -> None:
        """With --api-key: `Authorization: Bearer <one of the keys>`, compared in constant time."""
        if not keys:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        given_b = given.strip().encode()
        # NOTE: every key is compared (no early exit), each with compare_digest: the time taken says
        # nothing about which key or how much of it matched.
        ok = scheme.lower() == "bearer" and sum(hmac.compare_digest(given_b, k) for k in keys) > 0
        if not ok:
            raise Unauthorized("this service needs an API key: send `Authorization: Bearer <key>`")

    @app.post("/encode", response_model=EncodeResponse, responses=_ERROR_RESPONSES, openapi_extra={"requestBody": {"content": {
        "application/json": {"schema": {"$ref": "#/components/schemas/EncodeRequest"}},
        "multipart/form-data": {"schema": {"type": "object", "properties": {
            "image": {"type": "array", "items": {"type": "string", "format": "binary"}},
            "uuid": {"type": "array", "items": {"type": "string"}}}}}}, "required": True}})
    async def encode(request: Request):
        """Encode images; answer one item per image, in input order, once each is in the store."""
        rt: Runtime = request.app.state.rt
        t0 = time.perf_counter()
        status = 500
        try:
            authorize(request)
            items = await (_encode_remote(rt, request) if remote is not None else _encode(rt, request))
            status = 200 if items is not None else 499
            if items is None:  # client gone: nobody to answer
                return PlainTextResponse("client disconnected", status_code=499)
            return EncodeResponse(items=items)
        except ServiceError as e:
            status = http_status(e)
            if isinstance(e, Overloaded):
                rt.metrics.rejected.inc()
            raise
        finally:
            rt.metrics.requests.labels(status=str(status)).inc()
            rt.metrics.encode_latency.observe(time.perf_counter() - t0)

    @app.get("/health", responses={200: _HEALTH, 503: {**_HEALTH, "description": "the step loop or the engine is "
                                                        "not running, warm-up failed, or the store cannot be written"}})
    async def health(request: Request):
        """200 while the step loop is alive (or still warming up) and the store takes writes; 503 otherwise."""
        rt = request.app.state.rt
        if remote is not None:
            if rt.mismatch:
                return JSONResponse({"status": rt.mismatch}, status_code=503)
            if rt.engine_lost or (rt.info is not None and not rt.client.connected):
                return JSONResponse({"status": "the engine process is not running"}, status_code=503)
            if rt.info is not None:
                try:
                    store_error = (await rt.client.status())["store_error"]
                except ServiceError:
                    return JSONResponse({"status": "the engine process is not running"}, status_code=503)
                if store_error:
                    return JSONResponse({"status": f"the store cannot be written: {store_error}"}, status_code=503)
            return {"status": "ok"}
        if rt.store.unwritable:
            return JSONResponse({"status": f"the store cannot be written: {rt.store.unwritable}"}, status_code=503)
        if rt.warmup_failed:
            return JSONResponse({"status": "warm-up failed; see the log"}, status_code=503)
        if rt.started and not rt.engine.alive():
            return JSONResponse({"status": "step loop is not running"}, status_code=503)
        return {"status": "ok"}

    @app.get("/ready", responses={503: {"description": "not ready yet (loading, warming up) or the engine is gone",
                                        "content": {"application/json": {"schema": {
                                            "type": "object", "properties": {"ready": {"type": "boolean"}},
                                            "required": ["ready"]}}}}})
    async def ready(request: Request):
        """200 once the model is loaded and warmed up."""
        rt = request.app.state.rt
        if remote is not None:  # the engine process answers
            if not rt.ready:  # the engine process loads (and compiles) before it answers, then warms up
                phase = "failed" if rt.mismatch else "warming" if rt.info else "loading"
                return JSONResponse({"ready": False, "phase": phase}, status_code=503)
            try:
                info = await rt.client.status()
            except ServiceError:
                return JSONResponse({"ready": False}, status_code=503)
            # With several engines (--devices) the top-level fields are engine 0's; "engines" lists each.
            return {**info["info"], "engine_pid": info["pid"], "api_pid": os.getpid(), "engines": info["engines"]}
        if not rt.ready.is_set():
            return JSONResponse({"ready": False, "phase": "failed" if rt.warmup_failed else "warming"}, status_code=503)
        return model_info(rt.model, rt.engine, rt.startup, ready=True)

    @app.get("/metrics", response_class=PlainTextResponse, responses={
        200: {"description": "Prometheus text exposition", "content": {CONTENT_TYPE_LATEST.split(";")[0]: {}}},
        401: _ERROR_RESPONSES[401]})
    async def metrics(request: Request):
        if settings.api_key_metrics:
            authorize(request)
        rt = request.app.state.rt
        if remote is None:
            rt.metrics.update_gauges(rt.batcher, rt.store)
            return PlainTextResponse(rt.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)
        # Every API process's request counters (summed; see metrics.py), then the engine's (steps, queue, store).
        text = rt.metrics.exposition(api_side=True).decode()
        try:
            text += await rt.client.metrics()
        except ServiceError:
            pass  # the engine is gone: /health says so; the request counters are still worth reading
        return PlainTextResponse(text, media_type=CONTENT_TYPE_LATEST)

    return app


async def _keys_for(rt, inputs: list[_Input]) -> tuple[list[str], list[str]]:
    """Each image's store key (its uuid, or its content key) and the SHA-256 of its bytes; 409 when
    one uuid is given to different images in one request."""
    for i, inp in enumerate(inputs):
        if not inp.data:
            raise _at(EmptyImage(f"images[{i}] is empty (0 bytes); send the encoded image file"), i)
        if inp.uuid is not None:
            validate_key(inp.uuid, content_keys=False)  # a client cannot take a content key
    # (sha256 of bytes, content key) of every image in one thread hop: a hop each (sequential awaits) cost
    # an 8-image request 8 event-loop round trips through the executor.
    digests = await asyncio.to_thread(lambda: [_digests(rt, inp.data) for inp in inputs])
    keys = [inp.uuid if inp.uuid is not None else key for inp, (_, key) in zip(inputs, digests)]
    shas = [sha for sha, _ in digests]
    bound: dict[str, str] = {}  # key -> the image bytes' sha256 it names in this request
    for i, (key, sha) in enumerate(zip(keys, shas)):
        if bound.setdefault(key, sha) != sha:
            raise _at(KeyConflict(f"images[{i}]: uuid {key!r} is also given to other image bytes earlier in this "
                                  "request; one uuid names one image"), i)
    return keys, shas


def _decode_failure(inputs: list[_Input], i: int, p: BaseException) -> ServiceError:
    """The error to answer for image i whose decode raised `p` (raise it as it is: its cause is set)."""
    if isinstance(p, ImageError):
        if inputs[i].source is not None:  # never echo fetched content (an SSRF read primitive)
            p.message = (f"the content fetched from {inputs[i].source} is not a usable image "
                         f"({p.code}); check the URL")
        p.message = f"images[{i}]: {p.message}"
        return _at(p, i)
    if isinstance(p, ServiceError):
        return p
    err = BackendError(f"decoding images[{i}] failed: {type(p).__name__}: {p}")
    err.__cause__ = p
    return err


async def _encode(rt: Runtime, request: Request) -> list[EncodedItem] | None:
    """Answer one item per input image, in order; None if the client went away first."""
    inputs = await _parse_inputs(rt, request)
    keys, shas = await _keys_for(rt, inputs)

    answers: dict[str, EncodedItem] = {}  # key -> answer; a key twice in one request is handled once
    tickets: dict[str, Ticket] = {}  # key -> this request's claim on an encode (queued or running)
    todo: dict[str, int] = {}  # key -> index of the image to decode for it

    def conflict(i: int, where: str) -> KeyConflict:
        return _at(KeyConflict(f"images[{i}]: uuid {keys[i]!r} is already bound to other image bytes ({where}); "
                               "a uuid must name one image: choose another uuid, or leave it out"), i)

    def cache_hit(i: int) -> bool:
        hit = rt.store.lookup(keys[i])
        if hit is None or hit.content_sha256 is None:  # an entry without a recorded hash: encode again
            return False
        if hit.content_sha256 != shas[i]:
            raise conflict(i, "in the store")
        answers[keys[i]] = _item(hit, cached=True)
        rt.metrics.cache_hits.inc()
        rt.metrics.images.labels(outcome="cached").inc()
        return True

    def claim(i: int, ticket: Ticket) -> None:
        tickets[keys[i]] = ticket
        if ticket.coalesced and ticket.payload.content_sha256 != shas[i]:
            raise conflict(i, "being encoded for another request")

    def give_back() -> None:
        for t in tickets.values():
            t.cancel()

    places: dict[str, Reservation] = {}  # key -> its queue place while the image is decoded
    try:
        for i, key in enumerate(keys):
            if key in answers or key in tickets or key in todo or cache_hit(i):
                continue
            joined = rt.batcher.join(key)  # an identical image already queued or running: no decode
            if joined is not None:
                claim(i, joined)
            else:
                todo[key] = i

        # Admission before decode: each image to decode takes its queue place (its tokens read from its
        # header) now, so a full queue answers 429 before any pixels exist; an admitted image is queued
        # once decoded, whatever the queue holds by then.
        tokens = await asyncio.to_thread(lambda: [header_tokens(inputs[i].data, rt.model.params, rt.settings.image_limits)
                                                  for i in todo.values()])
        for key, n in zip(todo, tokens):
            places[key] = rt.batcher.reserve(n)

        prepared = await asyncio.gather(*(rt.decode(inputs[i].data) for i in todo.values()), return_exceptions=True)
        for i, p in zip(todo.values(), prepared):
            if isinstance(p, BaseException):
                raise _decode_failure(inputs, i, p)

        for (key, i), prep in zip(todo.items(), prepared):
            if not cache_hit(i):  # it may have landed while we decoded
                claim(i, rt.batcher.submit(key, EncodeJob(key, prep, shas[i]), tokens=prep.num_tokens,
                                           reservation=places[key]))
    except ServiceError:
        give_back()  # the request is answered with its error as a whole: nothing of it stays queued
        raise
    finally:
        for place in places.values():
            place.release()  # those not used by a submit (a no-op for the others)
    rt.metrics.coalesced.inc(sum(t.coalesced for t in tickets.values()))
    futures = [asyncio.wrap_future(t.future) for t in tickets.values()]
    if not await _wait_or_disconnect(request, futures):
        give_back()
        return None
    for (key, t), fut in zip(tickets.items(), futures):
        answers[key] = _item(fut.result(), cached=False)
        rt.metrics.images.labels(outcome="coalesced" if t.coalesced else "encoded").inc()
    return [answers[key] for key in keys]
