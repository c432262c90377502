"""Run the real app under uvicorn on a loopback port, in this process (so tests can reach its runtime)."""

from __future__ import annotations

import base64
import contextlib
import socket
import threading
import time

import httpx
import uvicorn

from service.app import create_app


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def live_server(settings, model, ready_timeout: float = 60.0):
    """Yields (base_url, app); the app's runtime is `app.state.rt`."""
    app = create_app(settings, model)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
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


def data_url(blob: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(blob).decode()


def json_body(*blobs: bytes, uuids=None) -> dict:
    parts = []
    for i, b in enumerate(blobs):
        part = {"type": "image_url", "image_url": {"url": data_url(b)}}
        if uuids and uuids[i] is not None:
            part["uuid"] = uuids[i]
        parts.append(part)
    return {"images": parts}


def metric(text: str, name: str, labels: str = "") -> float:
    """Value of one sample in Prometheus text (0 if absent)."""
    want = f"{name}{{{labels}}}" if labels else name
    for line in text.splitlines():
        if line.startswith(want + " "):
            return float(line.split()[-1])
    return 0.0
