"""What the tests of the service as real processes share (test_server, procs/test_supervisor, test_chaos,
test_main, test_loadtest): the process tree from /proc, a deadline wait, /ready of a supervised service,
the server on the tiny checkpoint, and the images, clients and checks the one-process and the supervised
server tests both run."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import httpx

from tests import imagedata as data
from tests.live import ServiceProcess, json_body

IMAGES = [  # real photographs first, then modes / formats / shapes
    "astronaut.png", "chelsea.png", "coffee.png", "rocket.jpg", "camera.png", "page.png", "retina.jpg@360",
    "hubble_deep_field.jpg@400", "rgba.png", "palette_transparent.png", "gray.png", "cmyk.jpg", "exif6.jpg",
    "noise.webp.lossy", "noise.gif.animated", "wide_4000x40.png",
]


def descendants(pid: int) -> set[int]:
    """Every live process below `pid` (from /proc)."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, pp in parents.items() if pp in frontier} - found
        found |= frontier
    return found


def alive(pid: int) -> bool:
    """Running and not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


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
    and afterwards."""
    stalled = []
    for i in range(n):
        c = socket.create_connection(("127.0.0.1", server.port), timeout=timeout_s + 30)
        c.sendall(b"POST /encode HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nX-Pad-%d: " % i)
        stalled.append((c, time.monotonic()))
    blob = data.encode(data.textured_rgb(72, 72, seed=n), "PNG")
    assert httpx.post(server.url + "/encode", json=json_body(blob), timeout=60).status_code == 200  # meanwhile
    took = []
    for c, opened in stalled:
        answer = b""
        while chunk := c.recv(65536):
            answer += chunk
        took.append(time.monotonic() - opened)
        assert answer.startswith(b"HTTP/1.1 408 ") and b"request_timeout" in answer, answer[:300]
        c.close()
    assert timeout_s * 0.9 <= min(took) and max(took) < timeout_s + 10, (min(took), max(took))
    r = httpx.post(server.url + "/encode", json=json_body(blob), timeout=60)  # afterwards
    assert r.status_code == 200 and r.json()["items"][0]["cached"] is True
