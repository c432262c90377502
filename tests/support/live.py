"""Run the real app under uvicorn on a loopback port, in this process (so tests can reach its runtime),
or the real service as its own process (`ServiceProcess`); hold an in-process step loop (`Gate`)."""

from __future__ import annotations

import asyncio
import base64
import copy
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import uvicorn

from service.api.server import server_options
from service.procs.local import local_app


ROOT = Path(__file__).resolve().parents[2]
# The Makefile's variables (ARGS, URL, VENV, ...). Given on make's command line they are exported to its
# recipes' environment: `make test ARGS="-k docker"` handed the tests' own `make try` those pytest flags.
MAKE_VARIABLES = frozenset(re.findall(r"^([A-Z_]+) *[?:]?=", (ROOT / "Makefile").read_text(), re.M))


def without_outer_make() -> dict[str, str]:
    """os.environ minus what an outer `make` put there (MAKEFLAGS, MAKELEVEL, MFLAGS and the Makefile's
    variables): a make or a command that a test starts sees only what the test gives it."""
    return {k: v for k, v in os.environ.items()
            if not k.startswith("MAKE") and k != "MFLAGS" and k not in MAKE_VARIABLES}


class Gate:
    """Holds the step loop inside `run` until released: makes queueing states deterministic."""

    def __init__(self, engine):
        self.engine, self.entered, self.release = engine, threading.Event(), threading.Event()
        self._run = engine.runner.run
        engine.runner.run = self._gated

    def _gated(self, staged):
        self.entered.set()
        assert self.release.wait(30), "test gate never released"
        return self._run(staged)


@contextlib.contextmanager
def file_server(bodies: dict[str, bytes], redirects: dict[str, str] | None = None):
    """A loopback HTTP server answering GET path -> body (404 otherwise; `redirects`: path -> 302
    Location), for the image-URL tests. Yields its port."""
    import http.server
    import socketserver

    redirects = redirects or {}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path in redirects:
                self.send_response(302)
                self.send_header("Location", redirects[self.path])
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            body = bodies.get(self.path)
            if body is None:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    with socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler) as srv:
        srv.daemon_threads = True
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        try:
            yield srv.server_address[1]
        finally:
            srv.shutdown()


class SlowServer:
    """A loopback HTTP server whose bodies come as slowly as a test says, for the URL-fetch tests: GET /<n>
    answers `size` bytes (its Content-Length), `chunk` bytes every `pause_s` seconds. It counts the requests
    it got, the bytes it sent and the fetches whose client closed the connection before the body's end
    (a write that failed: noticed within two pauses of the close). `url(n)` is a path's URL."""

    def __init__(self, size: int, chunk: int, pause_s: float):
        import http.server
        import socketserver

        self.size, self.chunk, self.pause_s = size, chunk, pause_s
        self.requests = self.sent = self.cut = self.active = 0
        self._lock = threading.Lock()
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's name)
                server._count(requests=1, active=1)
                try:
                    self.send_response(200)
                    self.send_header("Content-Length", str(server.size))
                    self.end_headers()
                    left = server.size
                    while left > 0:
                        piece = b"\0" * min(server.chunk, left)
                        self.wfile.write(piece)
                        self.wfile.flush()
                        server._count(sent=len(piece))
                        left -= len(piece)
                        if left and server.pause_s:
                            time.sleep(server.pause_s)
                except OSError:  # (BrokenPipeError, ConnectionResetError): the client left
                    server._count(cut=1)
                finally:
                    server._count(active=-1)

            def log_message(self, *args):
                pass

        self._httpd = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self.port = self._httpd.server_address[1]

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                setattr(self, name, getattr(self, name) + delta)

    def url(self, n: int = 0) -> str:
        return f"http://127.0.0.1:{self.port}/{n}"

    def __enter__(self) -> "SlowServer":
        threading.Thread(target=self._httpd.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


def local_host(rt):
    """The engine host of a single-process service's Runtime (engine/host.py): its store, batcher, engine."""
    return rt.engines.clients[0].transport.host


@contextlib.contextmanager
def refused_port():
    """Yields a loopback port that refuses connections while the block runs: bound and never listening,
    so no other process can take it meanwhile (a port found free and released could be taken)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]


@contextlib.contextmanager
def live_server(settings, model, ready_timeout: float = 60.0):
    """Yields (base_url, app); the app's runtime is `app.state.rt`."""
    app = local_app(settings, model)
    # NOTE: bound here on port 0 and handed to uvicorn: the port is ours from the start.
    sock = socket.create_server(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on", **server_options(settings)))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + ready_timeout
    while True:
        try:
            if httpx.get(url + "/ready", timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            server.should_exit = True
            raise TimeoutError("server did not become ready")
        time.sleep(0.05)
    try:
        yield url, app
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


@contextlib.contextmanager
def app_server(app, log_level: str = "warning"):
    """Yields the base URL of `app` (any ASGI app: the LM consumer's, the router's) served by uvicorn on a
    loopback port in a thread of this process: a real connection, which a test can cut mid-request."""
    sock = socket.create_server(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


# The line each server command logs once its socket is bound, with the port the kernel gave it:
# `serve` in one process, `consume` and `route` ("listening on http://HOST:PORT..."), a supervisor
# ("supervisor PID: http://HOST:PORT, ...").
BOUND = re.compile(r"(?:listening on|supervisor \d+:) http://([^\s:/]+):(\d+)")


def reported_url(log: Path) -> str | None:
    """The URL a server process logged when it bound its socket, or None before it has."""
    m = BOUND.search(log.read_text(errors="replace")) if log.exists() else None
    return m and f"http://{m.group(1)}:{m.group(2)}"


class ServiceProcess:
    """`python -m service ARGS --port 0` as its own process: the kernel picks a free port as the server
    binds it, and the port is read from the line the server logs (`reported_url`); then waits until
    `ready_path` answers 200 (`wait=False`: call wait_ready() later, e.g. to start two servers at once).
    Always stop() it (in a finally): a test must leave no process behind. `prefix`: a command that runs
    the server, e.g. `ip netns exec NS` (it must exec it: the server keeps the Popen's pid, for signals)."""

    ROOT = ROOT

    def __init__(self, args: list[str], log: Path, ready_timeout: float = 120.0, ready_path: str = "/ready",
                 wait: bool = True, prefix: list[str] = (), env: dict[str, str] | None = None):
        self.log, self.url, self.port, self.ready_path, self.command = log, None, None, ready_path, args[0]
        # NOTE: "--port 0" last: argparse takes the last value, so no caller's port can win over it.
        self.proc = subprocess.Popen([*prefix, sys.executable, "-m", "service", *args, "--port", "0"], cwd=self.ROOT,
                                     stdout=log.open("w"), stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
        if wait:
            self.wait_ready(ready_timeout)

    def wait_ready(self, timeout: float = 120.0, bound_only: bool = False) -> None:
        """Until the server has reported its port and (unless `bound_only`) answers 200 at ready_path."""
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.command} exited early:\n{self.log.read_text()}")
            if self.url is None and (url := reported_url(self.log)) is not None:
                self.url, self.port = url, int(url.rsplit(":", 1)[1])
            try:
                if self.url is not None and (bound_only or httpx.get(self.url + self.ready_path,
                                                                     timeout=1).status_code == 200):
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"{self.command} not ready:\n{self.log.read_text()}")
            time.sleep(0.1)

    def stop(self, timeout=60) -> bool:
        """SIGTERM; True if the server shut down gracefully. uvicorn re-raises the signal after its
        graceful shutdown, so the exit status is -SIGTERM (or 0): the log tells how it went."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
            return False
        log = self.log.read_text()
        return code in (0, -signal.SIGTERM) and "Application shutdown complete" in log and "Traceback" not in log


def data_url(blob: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(blob).decode()


def proxy_request(model: str, *parts: dict) -> dict:
    """A user's chat request as vLLM's EPD proxy forwards it to an encoder instance (disagg_epd_proxy.py's
    fanout_encoder_primer): a copy of the user's, with max_tokens 1, stream false, no stream_options."""
    user = {"model": model, "stream": True, "stream_options": {"include_usage": True}, "max_tokens": 256,
            "temperature": 0.2, "messages": [
                {"role": "system", "content": "You describe pictures."},
                {"role": "user", "content": [{"type": "text", "text": "What is in these?"}, *parts]}]}
    sent = copy.deepcopy(user)
    sent["max_tokens"] = 1
    sent["stream"] = False
    sent.pop("stream_options", None)
    return sent


def image_part(blob: bytes, **extra) -> dict:
    return {"type": "image_url", "image_url": {"url": data_url(blob)}, **extra}


def json_body(*blobs: bytes, uuids=None) -> dict:
    parts = []
    for i, b in enumerate(blobs):
        part = {"type": "image_url", "image_url": {"url": data_url(b)}}
        if uuids and uuids[i] is not None:
            part["uuid"] = uuids[i]
        parts.append(part)
    return {"images": parts}


SERVER_TIMING_PHASES = ["parse", "keys", "admit", "decode", "encode", "total"]


def server_timing(response: httpx.Response, wall_s: float) -> dict[str, float]:
    """The /encode answer's Server-Timing header as {phase: ms}, checked: every phase in order, none
    negative, the parts summing to the total, and the total within the client's wall time `wall_s`."""
    spans = {}
    for part in response.headers["server-timing"].split(","):
        name, dur = part.strip().split(";dur=")
        spans[name] = float(dur)
    assert list(spans) == SERVER_TIMING_PHASES, spans
    assert all(v >= 0 for v in spans.values()), spans
    parts = sum(v for k, v in spans.items() if k != "total")
    assert abs(parts - spans["total"]) <= 0.001 * len(spans) + 1e-9, spans  # rounding to 1 us each
    assert spans["total"] <= wall_s * 1e3, (spans, wall_s)
    return spans


def metric(text: str, name: str, labels: str = "") -> float:
    """Value of one sample in Prometheus text (0 if absent)."""
    want = f"{name}{{{labels}}}" if labels else name
    for line in text.splitlines():
        if line.startswith(want + " "):
            return float(line.split()[-1])
    return 0.0


def series(text: str) -> set[str]:
    """The names (with labels) of every sample in Prometheus text: which series exist, whatever their values."""
    return {line.split()[0] for line in text.splitlines() if line and not line.startswith("#")}


GC_SERIES = {'qve_gc_pause_seconds_count{generation="1"}', 'qve_gc_pause_seconds_count{generation="2"}'}


class RawHTTPServer:
    """A raw HTTP/1.1 server: `script(conn_no, req_no)` says whether to answer a request (200 JSON,
    keep-alive) or to close the connection without answering (what a server's idle close looks like
    to a client that has just sent on that connection)."""

    def __init__(self, script):
        self.script, self.connections, self.requests = script, 0, 0

    async def handle(self, reader, writer):
        self.connections += 1
        conn, req = self.connections, 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                await reader.readexactly(length)
                self.requests += 1
                req += 1
                if not self.script(conn, req):
                    return
                body = json.dumps({"items": [{"key": "k", "cached": False}]}).encode()
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
                             + str(len(body)).encode() + b"\r\n\r\n" + body)
                await writer.drain()
        except asyncio.IncompleteReadError:
            return
        finally:
            writer.close()
