"""HTTP front end: routes, auth, error mapping, /health /ready /metrics.

The /encode handler parses the request into `encode.Input`s (api/parse.py), calls `encode.encode`
(keys, claims, decode, submit: api/encode.py) and maps its answers to the response. Handlers never see
tensors: they deal in bytes, keys and StoredItems, and the same app serves a single-process service and
each API process of a supervised one (api/runtime.py's Runtime is what differs, built by procs/).
Every ServiceError answers its code's HTTP status (service/errors.py's families say which), as
`{"error": {"code", "message", "index"?}}`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import ValidationError
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from service.api import encode as encoding
from service.api import openai
from service.api.docs import mount_docs
from service.api.encode import Answer
from service.api.parse import parse_inputs, read_json_body
from service.api.runtime import Runtime
from service.api.sglang import wire as sglang_wire
from service.api.sglang.serve import SglangEncoder
from service.api.schemas import (EXAMPLE_REQUEST, EncodedItem, EncodeRequest, EncodeResponse, ErrorResponse,
                                 describe_invalid)
from service.config import Settings
from service import tracing
from service.api.server import BodyLimit, bearer_auth, install_error_handlers
from service import errors
from service.errors import Overloaded, RequestError, ServiceError, http_status
from service.priority import Urgency


# The error answers of /encode, written from the families' code tables (service/errors.py): each status with
# the codes it answers and what they mean.
ENCODER_ERRORS = (errors.RequestError, errors.KeyConflict, errors.ImageError, errors.VideoError, errors.Overloaded,
                  errors.Unavailable, errors.DeadlineExceeded, errors.BackendError)
_ERROR_RESPONSES = {status: {"model": ErrorResponse, "description": "; ".join(f"`{c}`: {m}" for c, m in codes)}
                    for status, codes in errors.statuses(ENCODER_ERRORS).items()}
_HEALTH = {"description": "the service's state, in words", "content": {"application/json": {"schema": {
    "type": "object", "properties": {"status": {"type": "string"}}, "required": ["status"]}}}}
# The JSON request body's schema, with its nested models as OpenAPI components (not dangling $defs).
_REQUEST_SCHEMA = EncodeRequest.model_json_schema(ref_template="#/components/schemas/{model}")
_REQUEST_DEFS = _REQUEST_SCHEMA.pop("$defs", {})



def _item(answer: Answer) -> EncodedItem:
    stored = answer.stored
    video = stored.video
    return EncodedItem(key=stored.key, num_tokens=stored.num_tokens, grid_thw=list(stored.grid_thw),
                       shape=list(stored.shape), dtype=stored.dtype, cached=answer.cached, path=stored.path,
                       store_key=stored.store_key, modality=stored.modality,
                       frames_indices=None if video is None else list(video.frames_indices),
                       fps=None if video is None else video.fps,
                       timestamps=None if video is None else list(video.timestamps))


# ---- the app --------------------------------------------------------------------------------------
def create_app(settings: Settings, make_runtime: Callable[[], Awaitable[Runtime]]) -> FastAPI:
    """The app of one serving process; its lifespan builds the Runtime (`make_runtime`: procs/ says what
    it holds), starts it, and shuts it down."""
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        rt = await make_runtime()
        app.state.rt = rt
        app.state.sglang = SglangEncoder(rt, rt.peers) if settings.sglang_version else None
        await rt.start()
        try:
            yield
        finally:
            await rt.shutdown()
            if app.state.sglang is not None:
                await asyncio.to_thread(app.state.sglang.close)  # (zmq's term waits out messages still lingering)
            tracing.shutdown()  # this process's last spans (uvicorn's re-raised SIGTERM skips atexit)

    app = FastAPI(title="Qwen3-VL encoder service", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None,
                  description="Runs only the Qwen3-VL vision tower and publishes embeddings to a shared store.")
    mount_docs(app)  # /docs from the package, not a CDN
    app.add_middleware(BodyLimit, limit=settings.max_request_bytes, timeout_s=settings.body_timeout_s,
                       paths=("/encode", "/v1/chat/completions", "/sglang/encode"), hint="send fewer or smaller images")

    install_error_handlers(app)

    authorized = bearer_auth(settings.api_key)

    generate_openapi = app.openapi

    def openapi() -> dict:
        doc = generate_openapi()  # cached by FastAPI: the additions below are made once
        doc["components"]["schemas"].update({"EncodeRequest": _REQUEST_SCHEMA, **_REQUEST_DEFS})
        return doc

    app.openapi = openapi

    def authorize(request: Request) -> None:
        if not authorized(request):
            raise RequestError("this service needs an API key: send `Authorization: Bearer <key>`", code="unauthorized")

    # (response_model_exclude_none: an item names its entry by `path` or by `store_key`, not both as null)
    @app.post("/encode", response_model=EncodeResponse, response_model_exclude_none=True, responses=_ERROR_RESPONSES,
              openapi_extra={"requestBody": {"content": {
        "application/json": {"schema": {"$ref": "#/components/schemas/EncodeRequest"}, "example": EXAMPLE_REQUEST},
        "multipart/form-data": {"schema": {"type": "object", "properties": {
            "image": {"type": "array", "items": {"type": "string", "format": "binary"}},
            "uuid": {"type": "array", "items": {"type": "string"}},
            "priority": {"type": "integer"}, "deadline_ms": {"type": "integer"}}}}}, "required": True}})
    async def encode(request: Request, response: Response):
        """Encode images; answer one item per image, in input order, once each is in the store. The
        `Server-Timing` header says where the request's time went (parse, keys, admit, decode, encode)."""
        async def parse(rt: Runtime):
            return None, *await parse_inputs(rt, request)

        return await _encoded(request, response, parse, lambda rt, _, answers: EncodeResponse(
            items=[_item(a) for a in answers]))

    @app.post("/v1/chat/completions", responses=_ERROR_RESPONSES)
    async def chat_completions(request: Request, response: Response):
        """vLLM's encoder-instance call (its EPD proxy's): every image and video of the chat request encoded and
        stored, then a chat.completion with no text (service/api/openai.py). Errors in the OpenAI API's shape."""
        return await _encoded(request, response, lambda rt: openai.parse_chat(rt, request),
                              lambda rt, chat, answers: openai.completion(rt, chat, answers,
                                                                          request.headers.get("x-request-id")))

    @app.get("/v1/models")
    async def models(request: Request):
        """The model this encoder stands in for: the LM's (--vllm-model-id), else its own."""
        authorize(request)
        return openai.models(request.app.state.rt)

    async def _encoded(request: Request, response: Response, parse, answer):
        """One encoding request, whatever its protocol: `parse(rt)` -> (what `answer` needs, the inputs, its
        priority and deadline), then `answer(rt, that, answers)`. Authorised and ready before the body is read,
        counted in /metrics, traced. Its deadline counts from here, its arrival."""
        arrival = time.monotonic()
        rt: Runtime = request.app.state.rt
        status = 500
        # (with tracing on: this request's span, current while it runs, so that its submits carry it to the
        # engines; its phases become child spans at the end)
        with tracing.server_span("encode request", request.headers) as span:
            phases = encoding.Phases()
            t0 = phases.start
            try:
                authorize(request)
                await rt.require_ready()  # before the body is read (or any URL fetched)
                parsed, inputs, asked = await parse(rt)
                if inputs is None:  # client gone while a URL was fetched
                    status = 499
                    return PlainTextResponse("client disconnected", status_code=499)
                phases.mark("parse")
                urgency = Urgency.at_arrival(arrival, asked.priority, asked.deadline_ms, settings.default_deadline_ms)
                answers = await encoding.encode(rt, inputs, request.is_disconnected, phases, urgency)
                if answers is None:  # client gone: nobody to answer
                    status = 499
                    return PlainTextResponse("client disconnected", status_code=499)
                body = answer(rt, parsed, answers)
                response.headers["Server-Timing"] = phases.header()
                status = 200  # (only now: an answer that fails while it is built is a 500, and counted as one)
                return body
            except ServiceError as e:
                status = http_status(e)
                if isinstance(e, Overloaded):
                    rt.metrics.rejected.inc()
                raise
            finally:
                rt.metrics.requests.labels(status=str(status)).inc()
                rt.metrics.encode_latency.observe(time.perf_counter() - t0)
                if span is not None:
                    span.set_attribute("http.response.status_code", status)
                    tracing.record_phases(phases.spans, phases.start)

    if settings.sglang_version:
        _sglang_routes(app, settings)

    @app.get("/health", responses={200: _HEALTH, 503: {**_HEALTH, "description": "the step loop or the engine is "
                                                        "not running, warm-up failed, or the store cannot be written"}})
    async def health(request: Request):
        """200 while the engines are alive (or still warming up) and the store takes writes; 503 otherwise."""
        status, body = await request.app.state.rt.health()
        return JSONResponse(body, status_code=status)

    @app.get("/ready", responses={503: {"description": "not ready yet (loading, warming up) or the engine is gone",
                                        "content": {"application/json": {"schema": {
                                            "type": "object", "properties": {"ready": {"type": "boolean"}},
                                            "required": ["ready"]}}}}})
    async def ready(request: Request):
        """200 once the model is loaded and warmed up. With --api-key, the details (store, processes,
        device, model) only to a request with the key: a load balancer's probe needs just `ready`."""
        status, body = await request.app.state.rt.readiness()
        if not authorized(request):  # (the phase, e.g. "loading", names no path, process or device)
            body = {k: body[k] for k in ("ready", "phase") if k in body}
        return JSONResponse(body, status_code=status)

    @app.get("/metrics", response_class=PlainTextResponse, responses={
        200: {"description": "Prometheus text exposition", "content": {CONTENT_TYPE_LATEST.split(";")[0]: {}}},
        401: _ERROR_RESPONSES[401]})
    async def metrics(request: Request):
        if settings.api_key_metrics:
            authorize(request)
        return PlainTextResponse(await request.app.state.rt.metrics_text(), media_type=CONTENT_TYPE_LATEST)

    return app


def _sglang_routes(app: FastAPI, settings: Settings) -> None:
    """SGLang's encoder server (api/sglang/serve.py), for `--encoder-urls http://HOST:PORT/sglang`. SGLang sends
    no API key: its calls are let in by their address instead (--sglang-allowed-hosts)."""
    async def handle(request: Request, model, call):
        """`call(body, its size, the caller's address)` on the body validated as `model`; a body that is not
        answers in SGLang's error shape."""
        try:
            body = await read_json_body(request, settings)
            try:
                parsed = model.model_validate_json(body)
            except ValidationError as e:
                raise RequestError(describe_invalid(e)) from None
        except ServiceError as e:
            return JSONResponse({"status": "error", "message": e.message, "req_id": None}, status_code=e.status)
        status, answer = await call(parsed, len(body), request.client.host if request.client else None)
        return JSONResponse(answer, status_code=status)

    @app.post("/sglang/encode", include_in_schema=False)
    async def sglang_encode(request: Request):
        sglang = request.app.state.sglang
        return await handle(request, sglang_wire.EncodeBody,
                            lambda part, nbytes, caller: sglang.encode(part, nbytes, caller, request.is_disconnected))

    @app.post("/sglang/scheduler_receive_url", include_in_schema=False)
    async def sglang_register(request: Request):
        async def register(registration, _, caller):
            return request.app.state.sglang.register(registration, caller)

        return await handle(request, sglang_wire.RegisterBody, register)

    @app.get("/sglang/health", include_in_schema=False)
    async def sglang_health(request: Request):
        status, body = await request.app.state.sglang.health()
        return JSONResponse(body, status_code=status)
