"""Mooncake Store for tests: a real `mooncake_master` on a simulated host (tests/support/netns.py) or on loopback.

Mooncake's client library itself (and Debian's libraries it links) is conftest's `mooncake_master_binary`
fixture: it installs what it can, or skips saying why. `Master` runs the master until stopped; `stop`
and `start` again simulate its loss and return at the same address.
"""

from __future__ import annotations

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
