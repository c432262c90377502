"""HTTP front end: routes, request parsing (bodies, data URLs, URL fetches), auth, error mapping,
/health /ready /metrics.

The /encode handler parses the request into `frontend.Input`s, calls `frontend.encode` (keys, store
checks, coalescing, decode, submit: frontend.py) and maps its answers to the response. Handlers never
see tensors: they deal in bytes, keys and StoredItems. Every ServiceError becomes its HTTP status in
one place (`errors.HTTP_STATUS`), as `{"error": {"code", "message", "index"?}}`.
"""

from __future__ import annotations

import asyncio
import binascii
import hmac
import ipaddress
import os
import socket
import time
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Literal
from urllib.parse import urlsplit

import httpx
import pybase64
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from pydantic import BaseModel, Field, ValidationError

from service.api import encode as frontend
from service.config import Settings
from service.api.docs import mount_docs
from service.errors import (
    BadRequest,
    ImageFetchError,
    ImageTooLarge,
    Overloaded,
    RequestTimeout,
    RequestTooLarge,
    ServiceError,
    Unauthorized,
    at_index,
    error_body,
    http_status,
)
from service.api.encode import Answer, Input, RemoteEngine, RemoteRuntime, Runtime

if TYPE_CHECKING:  # an API process (--api-processes) never imports torch: the model lives in the engine process
    from service.engine.loader import LoadedModel


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
        raise at_index(ImageTooLarge(f"images[{index}] is over the limit of {max_bytes} bytes"), index)
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
        raise at_index(ImageFetchError(f"images[{index}]: cannot resolve {host!r}: {e}"), index) from None
    for *_, sockaddr in infos:
        addr = ipaddress.ip_address(sockaddr[0].split("%")[0])
        if not addr.is_global:
            raise at_index(ImageFetchError(f"images[{index}]: {host!r} resolves to {addr}, a loopback, private or "
                                           "link-local address; such fetches are refused (--allow-private-url-addresses)"),
                           index)


async def _fetch_url(rt: Runtime, url: str, index: int) -> bytes:
    host, port = _url_host(url, index)
    if host not in rt.settings.allowed_url_hosts:
        raise at_index(ImageFetchError(f"images[{index}]: fetching from {host!r} is not allowed; send a data URL, or add "
                                       f"the host to --allowed-url-hosts"), index)
    await _check_resolves_public(rt, host, port, index)
    limit = rt.settings.max_image_bytes
    try:
        async with rt.http.stream("GET", url) as resp:
            if resp.status_code != 200:
                raise at_index(ImageFetchError(f"images[{index}]: GET {url} answered {resp.status_code}"), index)
            chunks, size = [], 0
            async for chunk in resp.aiter_bytes():
                size += len(chunk)
                if size > limit:
                    raise at_index(ImageTooLarge(f"images[{index}]: {url} is over the limit of {limit} bytes"), index)
                chunks.append(chunk)
            return b"".join(chunks)
    except (httpx.HTTPError, httpx.InvalidURL) as e:
        raise at_index(ImageFetchError(f"images[{index}]: could not fetch {url}: {type(e).__name__}: {e}"), index) from None


async def _parse_inputs(rt: Runtime, request: Request) -> list[Input]:
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
                raise at_index(ImageTooLarge(f"images[{i}] is over the limit of {s.max_image_bytes} bytes"), i)
            inputs.append(Input(data, uuids[i] if uuids else None))
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
            inputs.append(Input(data, part.uuid, source=url))
            continue
        else:
            raise BadRequest(f"images[{i}].image_url.url must start with data:, http:// or https://")
        inputs.append(Input(data, part.uuid))
    return inputs


def _item(answer: Answer) -> EncodedItem:
    stored = answer.stored
    return EncodedItem(key=stored.key, num_tokens=stored.num_tokens, grid_thw=list(stored.grid_thw),
                       shape=list(stored.shape), dtype=stored.dtype, cached=answer.cached, path=stored.path)


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
            from service.engine.loader import load_model

            loaded = model or await asyncio.to_thread(load_model, settings)
            # In a thread: on cuda the Engine compiles and captures graphs (seconds), and meanwhile the
            # loop keeps answering (service/procs/boot.py answers /ready with the phase).
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
    async def encode(request: Request, response: Response):
        """Encode images; answer one item per image, in input order, once each is in the store. The
        `Server-Timing` header says where the request's time went (parse, keys, admit, decode, encode)."""
        rt: Runtime = request.app.state.rt
        phases = frontend.Phases()
        t0 = phases.start
        status = 500
        try:
            authorize(request)
            if remote is not None:
                await rt.require_ready()  # before the body is read (or any URL fetched)
            inputs = await _parse_inputs(rt, request)
            phases.mark("parse")
            answers = await frontend.encode(rt, inputs, request.is_disconnected, phases)
            status = 200 if answers is not None else 499
            if answers is None:  # client gone: nobody to answer
                return PlainTextResponse("client disconnected", status_code=499)
            response.headers["Server-Timing"] = phases.header()
            return EncodeResponse(items=[_item(a) for a in answers])
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
        from service.procs.enginep import model_info

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


