"""uvicorn serving this app (a single-process service, or each API process): its options, a server that
says in one line which signal stops it, and what every server of this project (the encoder, the LM
consumer, the router) shares: the HTTP answer to a ServiceError (`error_response`) and to any other error
(`install_error_handlers`), the request-body limit (`BodyLimit`), the bearer-key check (`bearer_auth`),
and serving on a socket the CLI bound first (`serve_app`)."""

from __future__ import annotations

import asyncio
import hmac
import logging
import signal
import socket
from collections.abc import Callable, Iterable

import uvicorn
from starlette.requests import Request
from starlette.exceptions import HTTPException
from starlette.responses import Response

from service import errors
from service.api.protocol import H11_MAX_INCOMPLETE_BYTES, header_timeout_protocol
from service.config import Settings
from service.errors import RequestError, ServiceError

log = logging.getLogger(__name__)


def server_options(settings: Settings) -> dict:
    """uvicorn's options for serving this app (one process or each API process).
    NOTE: uvicorn's graceful shutdown on SIGTERM stops accepting, waits for open requests (whose images
    are queued or running), then runs the app's shutdown, which drains the step loop. The HTTP protocol is
    uvicorn's with a request-head timeout (protocol.py); the body timeout is BodyLimit's."""
    return {"timeout_graceful_shutdown": 60, "timeout_keep_alive": settings.keep_alive_s,
            "limit_concurrency": settings.max_connections, "http": header_timeout_protocol(settings.header_timeout_s),
            "h11_max_incomplete_event_size": H11_MAX_INCOMPLETE_BYTES}  # (protocol.py's cap answers first)


# Paths that probes and start-up waits poll (`try`, the load test, orchestrators' readiness and liveness
# probes): their access-log line is written only when its status changes (ProbeLogFilter).
PROBE_PATHS = ("/health", "/ready")


class ProbeLogFilter(logging.Filter):
    """Drops uvicorn's access-log line of a probe whose status is the one last logged for its path: a wait
    polling /ready twice a second wrote ~30 lines while a server started, and a liveness probe writes one
    every few seconds for ever. The first answer, and every change (starting to ready, ready to failing), stay."""

    def __init__(self) -> None:
        super().__init__()
        self._last: dict[str, int] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        # uvicorn's access record: (client, method, path with its query, HTTP version, status)
        if not (isinstance(args, tuple) and len(args) == 5 and args[1] in ("GET", "HEAD")):
            return True
        path, status = str(args[2]).split("?", 1)[0], args[4]
        if path not in PROBE_PATHS:
            return True
        last, self._last[path] = self._last.get(path), status
        return last != status


def quiet_probes() -> None:
    """ProbeLogFilter on uvicorn's access log, once per process (uvicorn.Config has configured its logging)."""
    access = logging.getLogger("uvicorn.access")
    if not any(isinstance(f, ProbeLogFilter) for f in access.filters):
        access.addFilter(ProbeLogFilter())


class Server(uvicorn.Server):
    """uvicorn's server, saying in one line which signal stops it, with probes' access lines quieted
    (ProbeLogFilter). With `ignore_sigint` a SIGINT is
    ignored (a supervisor's child: the supervisor turns Ctrl-C into SIGTERMs, API processes first).
    `on_stopping` runs as the graceful shutdown begins, before it waits for open requests: what must not
    hold the drain ends there (the encoder's URL fetches). `on_stopped` runs once the graceful shutdown is
    done. NOTE: not after `run()`: uvicorn raises the signal that stopped it again when `serve` ends, and
    the process dies of it there."""

    def __init__(self, config: uvicorn.Config, ignore_sigint: bool = False, on_stopped: Callable[[], None] | None = None,
                 on_stopping: Callable[[], None] | None = None):
        super().__init__(config)
        quiet_probes()
        self.ignore_sigint, self.on_stopped, self.on_stopping = ignore_sigint, on_stopped, on_stopping

    async def shutdown(self, sockets=None) -> None:
        if self.on_stopping is not None:
            self.on_stopping()
        await super().shutdown(sockets=sockets)
        if self.on_stopped is not None:
            self.on_stopped()

    def handle_exit(self, sig: int, frame) -> None:
        if sig == signal.SIGINT and self.ignore_sigint:
            return
        if not self.should_exit:
            log.info("%s: stopping; open requests finish first%s", signal.Signals(sig).name,
                     " (Ctrl-C again to stop at once)" if sig == signal.SIGINT else "")
        super().handle_exit(sig, frame)


def bound_url(sock: socket.socket) -> str:
    """http://HOST:PORT of a bound socket (the port the kernel gave a --port 0)."""
    host, port = sock.getsockname()[:2]
    return f"http://{f'[{host}]' if ':' in host else host}:{port}"


def serve_app(app, sock: socket.socket, log_level: str) -> int:
    """Serve `app` (the LM consumer's, the router's) on `sock`, bound by the CLI before anything loaded, with
    the one-line signal log of `Server`."""
    Server(uvicorn.Config(app, log_level=log_level)).run(sockets=[sock])
    return 0


def error_response(err: ServiceError, openai: bool = False) -> Response:
    """The HTTP answer to `err` (errors.response builds its status, headers and body; `openai`: the OpenAI
    API's error shape, what vLLM's /v1 routes answer)."""
    status, headers, body = errors.response(err, openai)
    return Response(body, status_code=status, headers=headers)


def install_error_handlers(app) -> None:
    """Every error `app` (a FastAPI app of this project) answers in the one error shape: its ServiceErrors,
    routing's own (404, 405, ...) instead of FastAPI's {"detail": ...}, and anything else (a bug) as 500
    `internal_error` instead of starlette's plain-text 500."""
    @app.exception_handler(HTTPException)
    async def _http_error(request, err: HTTPException):
        if err.status_code == 404:
            answer = error_response(errors.RequestError(f"no such endpoint: {errors.clip(request.method, 16)} "
                                                    f"{errors.clip(request.url.path)}; see /docs", code="not_found"))
        elif err.status_code == 405:
            answer = error_response(errors.RequestError(f"{errors.clip(request.method, 16)} is not allowed on "
                                                            f"{errors.clip(request.url.path)}", code="method_not_allowed"))
        else:
            answer = error_response(errors.Relayed(err.status_code, "http_error", str(err.detail)))
        answer.headers.update(err.headers or {})  # e.g. a 405's Allow
        return answer

    @app.exception_handler(ServiceError)
    async def _service_error(request, err: ServiceError):
        return error_response(err, openai=request.url.path.startswith("/v1/"))

    # NOTE: starlette runs an `Exception` handler in its outermost middleware and raises the error again after
    # the answer is sent, so uvicorn still logs its traceback: the log has the bug, the client the JSON shape.
    @app.exception_handler(Exception)
    async def _unexpected(request, err: Exception):
        return error_response(errors.BackendError("the server failed unexpectedly (a bug): its log has the error; "
                                                  "retry, and report it if it persists", code="internal_error"),
                              openai=request.url.path.startswith("/v1/"))


class BodyLimit:
    """ASGI middleware: a body sent to one of `paths` over `limit` bytes is answered 413 before it is read
    (declared Content-Length) or as soon as the bytes streamed in pass the limit (chunked), JSON and
    multipart alike: nothing over the limit is buffered or spooled to disk. A body whose next part takes
    longer than `timeout_s` to arrive is answered 408. `hint` ends the 413's message (what to send instead)."""

    def __init__(self, app, limit: int, timeout_s: float, paths: Iterable[str], hint: str):
        self.app, self.limit, self.timeout_s, self.paths, self.hint = app, limit, timeout_s, frozenset(paths), hint

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] not in self.paths:
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.limit:
            answer = error_response(RequestError(f"request body is {int(declared)} bytes, over the limit of "
                                                    f"{self.limit} (--max-request-bytes); {self.hint}", code="request_too_large"),
                                    openai=scope["path"].startswith("/v1/"))
            return await answer(scope, receive, send)
        seen, body_done = 0, False

        async def counted():
            nonlocal seen, body_done
            if body_done:  # later receives wait for a disconnect, as long as a request takes: no timeout
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), self.timeout_s)
            except asyncio.TimeoutError:
                raise RequestError(f"no part of the request body arrived for {self.timeout_s:g} s "
                                     "(--body-timeout-s); send the body without pauses", code="request_timeout") from None
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                body_done = not message.get("more_body", False)
                if seen > self.limit:
                    raise RequestError(f"request body is over the limit of {self.limit} bytes "
                                          f"(--max-request-bytes); {self.hint}", code="request_too_large")
            return message

        await self.app(scope, counted, send)


def bearer_auth(keys: Iterable[str]) -> Callable[[Request], bool]:
    """Whether a request may pass: with no keys, every request; else one with `Authorization: Bearer <one
    of the keys>` (--api-key), compared in constant time."""
    keys_b = [k.encode() for k in keys]

    def authorized(request: Request) -> bool:
        if not keys_b:
            return True
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        given_b = given.strip().encode()
        # NOTE: every key is compared (no early exit), each with compare_digest: the time taken says
        # nothing about which key or how much of it matched.
        return scheme.lower() == "bearer" and sum(hmac.compare_digest(given_b, k) for k in keys_b) > 0

    return authorized
