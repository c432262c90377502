"""Mooncake Store for tests: a real `mooncake_master` on a simulated host (tests/support/netns.py) or on loopback.

Mooncake's client library itself (and Debian's libraries it links) is conftest's `mooncake_master_binary`
fixture: it installs what it can, or skips saying why. `Master` runs the master until stopped; `stop`
and `start` again simulate its loss and return at the same address.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
from pathlib import Path

import httpx

from tests.support.netns import Host
from tests.support.processes import wait_for

LOOPBACK = Host("loopback", "127.0.0.1", None)
MASTER_PORTS = (50051, 9003)  # inside a namespace of its own, nothing else holds them


def _free_ports(n: int) -> list[int]:
    """`n` distinct loopback ports nothing listens on now. NOTE: picked and released (the master has no
    port-0 mode); a clash fails its start, loudly."""
    with socket.socket() as a, socket.socket() as b:
        socks = [a, b][:n]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


class Master:
    """`mooncake_master` on its host; `url` is what --store takes. stop() and start() simulate the loss of
    the master and its return at the same address (with none of its metadata: it keeps none on disk)."""

    def __init__(self, binary: Path, host: Host, log: Path, lease_ttl_ms: int = 5000):
        self.binary, self.host, self.log, self.lease_ttl_ms = binary, host, log, lease_ttl_ms
        self.port, self.metrics_port = MASTER_PORTS if host.netns else _free_ports(2)
        self.url = f"mooncake://{host.address}:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [*self.host.prefix, str(self.binary), f"--rpc_address={self.host.address}", f"--rpc_port={self.port}",
             f"--metrics_host={self.host.address}", f"--metrics_port={self.metrics_port}",
             f"--default_kv_lease_ttl={self.lease_ttl_ms}"],
            stdout=self.log.open("a"), stderr=subprocess.STDOUT)

        def listening() -> bool:
            assert self.proc.poll() is None, f"mooncake_master exited:\n{self.log.read_text()[-3000:]}"
            try:
                socket.create_connection((self.host.address, self.port), timeout=1).close()
                return True
            except OSError:
                return False

        try:
            wait_for(listening, 30, "mooncake_master listening")
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def segments(self) -> list[str]:
        """The segments mounted in the pool, as the master names them (each its host's advertised host:port)."""
        r = httpx.get(f"http://{self.host.address}:{self.metrics_port}/get_all_segments", timeout=10)
        assert r.status_code == 200, r.text
        return [line.strip() for line in r.text.splitlines() if line.strip()]


_SEGMENT_HOST = """
import json, sys
import torch
from service.store.mooncake import MooncakeStore
from service.store.options import MOONCAKE_BUFFER_BYTES, MooncakeOptions, parse_mooncake
spec = json.loads(sys.argv[1])
options = MooncakeOptions(master=parse_mooncake(spec["url"]), local_host="127.0.0.1", segment_bytes=spec["segment"],
                          buffer_bytes=MOONCAKE_BUFFER_BYTES, protocol="tcp", namespace=spec["namespace"])
store = MooncakeStore(spec["url"], options, model_id=spec["model"], out_hidden_size=spec["out_hidden"],
                      deepstack_levels=spec["levels"], dtype=spec["dtype"], min_residency_s=30.0, salt="host")
for key, rows, sha, *grid in spec["entries"]:
    torch.manual_seed(rows)
    ec = torch.randn(rows, spec["width"]).to(getattr(torch, spec["dtype"]))
    store.put(key, ec, tuple(grid[0]) if grid else (1, 2, 2 * rows), content_sha256=sha)
print("ready", flush=True)
sys.stdin.read()  # until the test closes it (or stops / kills this process)
store.close()
"""


class SegmentHost:
    """Another host of the pool: a process with a segment of its own into which it puts `entries` ([key,
    rows, content sha256] and optionally its grid, else (1, 2, 2 * rows); rows of `width` seeded by their
    count) as MooncakeStore puts them, then holds them until stopped. `stop()` (SIGSTOP: its sockets stay open, nothing answers), `resume()`, `kill()`."""

    def __init__(self, url: str, log: Path, *, namespace: str, model: str, out_hidden: int, levels: int,
                 dtype: str, entries: list, segment: int = 64 << 20):
        import json
        import sys

        spec = {"url": url, "namespace": namespace, "model": model, "out_hidden": out_hidden, "levels": levels,
                "width": out_hidden * (1 + levels), "dtype": dtype, "entries": entries, "segment": segment}
        root = str(Path(__file__).resolve().parents[2])
        self.proc = subprocess.Popen([sys.executable, "-c", _SEGMENT_HOST, json.dumps(spec)], cwd=root,
                                     env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))},
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log.open("w"), text=True)
        line = self.proc.stdout.readline()
        if line.strip() != "ready":
            self.kill()
            raise AssertionError(f"the segment host did not start:\n{log.read_text()[-3000:]}")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait(10)
