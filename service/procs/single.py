"""A single-process service: the app, the decode processes and the engine host in one process, from
its bound socket to ready, and its stop signals.

uvicorn serves the socket preflight bound from the first second. Until the model is loaded the app is
`Booting`, which answers /ready 503 with the phase; then the real app (api/app.py) starts with a Runtime
of decode processes (procs/decoders.py's PoolDecoder) and the engine host in this process
(engine/host.py, through its LocalTransport), and answers everything, its /ready 503 "warming" until warm:

    bound -> loading (load_model, a thread) -> compiling (cuda: the Engine's torch.compile and CUDA
    graphs) -> warming (the warm-up step, the decode workers) -> ready (/ready 200)

Signals: the first SIGINT or SIGTERM logs one line and drains (uvicorn's graceful shutdown, then the
app's); no process prints a traceback. The supervisor's children use `Server(ignore_sigint=True)`:
a terminal's Ctrl-C reaches the whole process group, and the supervisor stops them in order.

Imports stay light here (no torch at module level): uvicorn must start at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable

import uvicorn
from starlette.responses import JSONResponse

from service import tracing
from service.api.server import Server, error_response, server_options
from service.config import Settings
from service.errors import StartupError, Unavailable

log = logging.getLogger(__name__)


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
    # NOTE: the service's heavy modules (torch, transformers, the app: procs/local.py) are imported here,
    # in the loading thread: imported on the event loop they would stall /ready for seconds.
    from service.engine.loader import load_model
    from service.procs import local  # noqa: F401

    return load_model(settings)


class Booting:
    """The ASGI app of a single-process service. At start it loads the model in a thread, then starts
    the real app (its lifespan) and hands every request to it. Before that: /ready 503 with the phase,
    /health 200 (alive, starting), anything else 503 `unavailable` with Retry-After."""

    def __init__(self, settings: Settings, stop: Callable[[], None], load: Callable | None = None, settle: bool = True):
        self.settings = settings
        self.stop = stop  # ends the server: a start-up failure exits the process
        self.load = load  # load_model if None; a stand-in in tests
        self.settle = settle  # freeze the process's start-up objects (procs/local.py); not in a test's process
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
            # What the Engine does before it is ready on a GPU (engine/runner.py: cuda + bfloat16 only).
            if model.device.type == "cuda" and str(model.dtype) == "torch.bfloat16" and (
                    self.settings.compile or self.settings.cuda_graphs):
                self.phase = "compiling"
            from service.procs.local import local_app  # (imported by the loading thread already)

            app = local_app(self.settings, model, settle=self.settle)
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

    def stopping(self) -> None:
        """The server begins its graceful stop: the real app's URL fetches end now (api/runtime.py)."""
        rt = getattr(self.app.state, "rt", None) if self.app is not None else None
        if rt is not None:
            rt.stop_fetches()

    async def _starting(self, scope, send) -> None:
        if scope["path"] == "/ready":
            answer = JSONResponse({"ready": False, "phase": self.phase,
                                   "elapsed_s": round(time.monotonic() - self._t0, 1)}, status_code=503)
        elif scope["path"] == "/health":
            answer = JSONResponse({"status": "starting", "phase": self.phase})
        else:
            answer = error_response(Unavailable(f"the service is starting ({self.phase} the model); retry once "
                                                "/ready answers 200", retry_after_s=2))
        await answer(scope, None, send)


def serve_single(settings: Settings, sock: socket.socket, load: Callable | None = None) -> int:
    """Serve on `sock` in this process until a stop signal; the exit status."""
    tracing.setup("qwen3vl-encoder", settings.otlp_endpoint)
    server: Server | None = None
    booting = Booting(settings, stop=lambda: setattr(server, "should_exit", True), load=load)
    server = Server(uvicorn.Config(booting, log_level=settings.log_level, **server_options(settings)),
                    on_stopping=booting.stopping)
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
