"""A serving process from its bound socket to ready, and its stop signals.

One process (`serve`, the default): uvicorn serves the socket preflight bound from the first second.
Until the model is loaded the app is `Booting`, which answers /ready 503 with the phase; then the real
app (app.create_app) starts and answers everything, its own /ready 503 "warming" until warm:

    bound -> loading (load_model, a thread) -> compiling (cuda: the Runtime's torch.compile and CUDA
    graphs) -> warming (the warm-up step, the decode workers) -> ready (/ready 200)

Signals: the first SIGINT or SIGTERM logs one line and drains (uvicorn's graceful shutdown, then the
app's); no process prints a traceback. The supervisor's children use `Server(ignore_sigint=True)`:
a terminal's Ctrl-C reaches the whole process group, and the supervisor stops them in order.

Imports stay light here (no torch, no service.api.app at module level): uvicorn must start at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable

import uvicorn

from service.config import Settings
from service.errors import StartupError, error_body
from service.api.protocol import header_timeout_protocol

log = logging.getLogger(__name__)


def server_options(settings: Settings) -> dict:
    """uvicorn's options for serving this app (one process or each API process).
    NOTE: uvicorn's graceful shutdown on SIGTERM stops accepting, waits for open requests (whose images
    are queued or running), then runs the app's shutdown, which drains the step loop. The HTTP protocol is
    uvicorn's with a request-head timeout (protocol.py); the body timeout is _BodyLimit's."""
    return {"timeout_graceful_shutdown": 60, "timeout_keep_alive": settings.keep_alive_s,
            "limit_concurrency": settings.max_connections, "http": header_timeout_protocol(settings.header_timeout_s)}


class Server(uvicorn.Server):
    """uvicorn's server, saying in one line which signal stops it. With `ignore_sigint` a SIGINT is
    ignored (a supervisor's child: the supervisor turns Ctrl-C into SIGTERMs, API processes first)."""

    def __init__(self, config: uvicorn.Config, ignore_sigint: bool = False):
        super().__init__(config)
        self.ignore_sigint = ignore_sigint

    def handle_exit(self, sig: int, frame) -> None:
        if sig == signal.SIGINT and self.ignore_sigint:
            return
        if not self.should_exit:
            log.info("%s: stopping; open requests finish first%s", signal.Signals(sig).name,
                     " (Ctrl-C again to stop at once)" if sig == signal.SIGINT else "")
        super().handle_exit(sig, frame)


def _in_daemon_thread(fn: Callable, *args):
    """Await fn(*args) run in a daemon thread. NOTE: not asyncio.to_thread: a stop signal during the
    model load must not wait for it (the loop's executor threads are joined at exit, a daemon is not)."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def settle(error, result):
        if not done.cancelled():
            done.set_exception(error) if error is not None else done.set_result(result)

    def run():
        try:
            outcome = (None, fn(*args))
        except BaseException as e:  # handed to the awaiting task, which reports it
            outcome = (e, None)
        try:
            loop.call_soon_threadsafe(settle, *outcome)
        except RuntimeError:  # the loop is closed: the server stopped meanwhile, nobody waits
            pass

    threading.Thread(target=run, name="load-model", daemon=True).start()
    return done


def _load_model(settings: Settings):
    # NOTE: the service's heavy modules (torch, transformers, the app) are imported here, in the
    # loading thread: imported on the event loop they would stall /ready for seconds.
    from service.api import app  # noqa: F401
    from service.engine.loader import load_model

    return load_model(settings)


class Booting:
    """The ASGI app of a single-process service. At start it loads the model in a thread, then starts
    the real app (its lifespan) and hands every request to it. Before that: /ready 503 with the phase,
    /health 200 (alive, starting), anything else 503 `unavailable` with Retry-After."""

    def __init__(self, settings: Settings, stop: Callable[[], None], load: Callable | None = None):
        self.settings = settings
        self.stop = stop  # ends the server: a start-up failure exits the process
        self.load = load  # load_model if None; a stand-in in tests
        self.phase = "loading"
        self.app = None  # the real app, once its lifespan has started
        self.exit_code = 0
        self.stopped_early = False  # stopped before the real app was up
        self._t0 = time.monotonic()
        self._task: asyncio.Task | None = None
        self._lifespans = contextlib.AsyncExitStack()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            return await self._lifespan(receive, send)
        if self.app is not None:
            return await self.app(scope, receive, send)
        if scope["type"] == "http":
            await self._starting(scope, send)

    async def _lifespan(self, receive, send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self._task = asyncio.create_task(self._boot())
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self.app is None:
                    self.stopped_early = True
                    self._task.cancel()
                await self._lifespans.aclose()  # the real app's shutdown: drains, releases the store
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _boot(self) -> None:
        try:
            model = await _in_daemon_thread(self.load or _load_model, self.settings)
            # What the Engine does before it is ready on a GPU (runner.py: cuda + bfloat16 only).
            if model.device.type == "cuda" and str(model.dtype) == "torch.bfloat16" and (
                    self.settings.compile or self.settings.cuda_graphs):
                self.phase = "compiling"
            from service.api.app import create_app

            app = create_app(self.settings, model)
            await self._lifespans.enter_async_context(app.router.lifespan_context(app))
            self.app = app
        except asyncio.CancelledError:
            raise
        except StartupError as e:  # a checkpoint the loader refuses: one line, as the CLI's own checks
            print(f"cannot start: {e}", file=sys.stderr)
            self.exit_code = 2
            self.stop()
        except Exception:  # a bug: the traceback is what helps
            log.exception("start-up failed")
            self.exit_code = 1
            self.stop()

    async def _starting(self, scope, send) -> None:
        status, headers = 503, [(b"content-type", b"application/json")]
        if scope["path"] == "/ready":
            body = {"ready": False, "phase": self.phase, "elapsed_s": round(time.monotonic() - self._t0, 1)}
        elif scope["path"] == "/health":
            status, body = 200, {"status": "starting", "phase": self.phase}
        else:
            body = error_body("unavailable", f"the service is starting ({self.phase} the model); retry once /ready "
                              "answers 200")
            headers.append((b"retry-after", b"2"))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": json.dumps(body).encode()})


def serve_single(settings: Settings, sock: socket.socket, load: Callable | None = None) -> int:
    """Serve on `sock` in this process until a stop signal; the exit status."""
    server: Server | None = None
    booting = Booting(settings, stop=lambda: setattr(server, "should_exit", True), load=load)
    server = Server(uvicorn.Config(booting, log_level=settings.log_level, **server_options(settings)))
    log.info("listening on http://%s:%d; /ready answers 503 until the model is loaded and warm",
             settings.host, sock.getsockname()[1])
    code = 0
    try:
        server.run(sockets=[sock])  # after a signal's graceful stop, uvicorn raises that signal again
    except KeyboardInterrupt:  # SIGINT: already logged in one line
        code = 130
    if booting.exit_code:
        return booting.exit_code
    if booting.stopped_early:
        # NOTE: the model may still be loading in its thread, which cannot be interrupted; ending the
        # interpreter under it can crash in torch's C++ code. Nothing else exists yet: exit outright.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code or 128 + signal.SIGTERM)
    return code
