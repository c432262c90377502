"""What the tests of the service as real processes share (test_server, procs/test_supervisor, test_chaos,
test_main, test_loadtest): a deadline wait, /ready of a supervised service, the server on the tiny
checkpoint, and the images, clients and checks the one-process and the supervised server tests both run.
The process tree from /proc is tests/support/proctree.py's."""

from __future__ import annotations

import os
import selectors
import socket
import threading
import time
from pathlib import Path

import httpx

from tests.support import imagedata as data
from tests.support.live import ServiceProcess, json_body

IMAGES = [  # real photographs first, then modes / formats / shapes
    "astronaut.png", "chelsea.png", "coffee.png", "rocket.jpg", "camera.png", "page.png", "retina.jpg@360",
    "hubble_deep_field.jpg@400", "rgba.png", "palette_transparent.png", "gray.png", "cmyk.jpg", "exif6.jpg",
    "noise.webp.lossy", "noise.gif.animated", "wide_4000x40.png",
]


def wait_for(cond, timeout=30.0, what="condition"):
    """Poll `cond` until it is true; TimeoutError naming `what` once `timeout` seconds have passed."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.05)


def ready_info(server, timeout: float = 60.0) -> dict:
    """/ready of whichever API process answers, once it is ready (another one may still be connecting
    to the engine when the first says 200)."""
    deadline = time.monotonic() + timeout
    while True:
        r = httpx.get(server.url + "/ready", timeout=5, headers={"Connection": "close"})
        if r.status_code == 200 or time.monotonic() > deadline:
            return r.json()
        time.sleep(0.05)


def wait_api_processes_ready(server, count: int, timeout: float = 60.0,
                             exclude: frozenset[int] = frozenset()) -> set[int]:
    """Until `count` distinct API processes (none of `exclude`) have answered /ready 200; their pids.
    Asked 8 at a time: asked one after another, every new connection of an idle server can go to the
    same process, whichever the kernel's wakeup order favours (in a full-suite run 746 answers in 60 s
    all came from one of two started processes); concurrent requests keep that one busy, so the other
    accepts some."""
    from concurrent.futures import ThreadPoolExecutor

    pids: set[int] = set()

    def ask(_) -> None:
        try:
            r = httpx.get(server.url + "/ready", timeout=5, headers={"Connection": "close"})
        except httpx.TransportError:  # a connection a dying process had accepted
            return
        if r.status_code == 200 and r.json()["api_pid"] not in exclude:
            pids.add(r.json()["api_pid"])

    deadline = time.monotonic() + timeout
    with ThreadPoolExecutor(8) as pool:
        while len(pids) < count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(pids)} of {count} API processes answered /ready 200 in {timeout:.0f} s")
            list(pool.map(ask, range(8)))
    return pids


class CheckpointServer(ServiceProcess):
    """`serve` on a checkpoint directory, on the CPU in float32 (so it matches transformers within 1e-5),
    two decode workers, loopback only; `extra` flags after those."""

    def __init__(self, ckpt, store, *extra):
        logs = len(list(store.parent.glob("server-*.log")))  # one log per server a test starts on this store
        super().__init__(["serve", "--model", str(ckpt), "--device", "cpu", "--dtype", "float32", "--store", str(store),
                          "--host", "127.0.0.1", "--decode-workers", "2", *extra],
                         store.parent / f"server-{logs}.log")

    def listening_addresses(self) -> set[str]:
        """Local addresses with a LISTEN socket on our port (from /proc/net/tcp{,6})."""
        found = set()
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            if not os.path.exists(table):
                continue
            for line in Path(table).read_text().splitlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                addr, port = local.split(":")
                if int(port, 16) == self.port and state == "0A":
                    found.add(addr)
        return found


def two_image_client(server, c: int):
    """Client c of many: two test images; odd clients use multipart, even ones JSON."""
    blobs = data.valid_images()
    names = [IMAGES[c % len(IMAGES)], IMAGES[(c * 7 + 3) % len(IMAGES)]]
    if c % 2:
        files = [("image", (n, blobs[n], "application/octet-stream")) for n in names]
        return names, httpx.post(server.url + "/encode", files=files, timeout=120)
    return names, httpx.post(server.url + "/encode", json=json_body(*(blobs[n] for n in names)), timeout=120)


def stalled_heads_are_cut_off(server, timeout_s: float, n: int = 200) -> None:
    """`n` connections that each send part of a request head and stall (slowloris): each is answered 408
    and closed within the bound of --header-timeout-s, and the server answers normal requests meanwhile
    and afterwards. Each answer's time is taken as it arrives (a thread reads them all at once): read one
    after another once the request meanwhile was answered, the first ones' times included that request's
    encode, which on a loaded machine can take them past the bound."""
    opened: dict[socket.socket, float] = {}
    for i in range(n):
        c = socket.create_connection(("127.0.0.1", server.port), timeout=timeout_s + 30)
        c.sendall(b"POST /encode HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nX-Pad-%d: " % i)
        opened[c] = time.monotonic()
    answers: dict[socket.socket, bytes] = {c: b"" for c in opened}
    took: dict[socket.socket, float] = {}

    def read_all() -> None:
        with selectors.DefaultSelector() as sel:
            for c in opened:
                c.setblocking(False)
                sel.register(c, selectors.EVENT_READ)
            deadline = time.monotonic() + timeout_s + 60
            while len(took) < n and time.monotonic() < deadline:
                for key, _ in sel.select(timeout=1.0):
                    c = key.fileobj
                    try:
                        chunk = c.recv(65536)
                    except BlockingIOError:
                        continue
                    except ConnectionError:
                        chunk = b""
                    answers[c] += chunk
                    if not chunk:  # closed by the server
                        took[c] = time.monotonic() - opened[c]
                        sel.unregister(c)

    reader = threading.Thread(target=read_all, daemon=True)
    reader.start()
    blob = data.encode(data.textured_rgb(72, 72, seed=n), "PNG")
    try:
        assert httpx.post(server.url + "/encode", json=json_body(blob), timeout=60).status_code == 200  # meanwhile
        reader.join(timeout_s + 90)
    finally:
        for c in opened:
            c.close()
    assert len(took) == n, f"{n - len(took)} of {n} stalled connections were not answered and closed"
    for answer in answers.values():
        assert answer.startswith(b"HTTP/1.1 408 ") and b"request_timeout" in answer, answer[:300]
    first, last = min(took.values()), max(took.values())
    assert timeout_s * 0.9 <= first and last < timeout_s + 10, (first, last)
    r = httpx.post(server.url + "/encode", json=json_body(blob), timeout=60)  # afterwards
    assert r.status_code == 200 and r.json()["items"][0]["cached"] is True
