"""A real Mooncake master for tests (and the client library it needs), on loopback ports of its choosing.

`mooncake_or_skip()` makes Mooncake's client importable where this is root with apt (Debian's
libibverbs1 ibverbs-providers, which the wheel links even for TCP), or skips saying why. `Master` runs
`mooncake_master` until stopped; `stop` / `start` again simulate its loss and return.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

_TRIED: dict[str, str] = {}


def _importable() -> str:
    """'' when Mooncake's client imports here, else why not."""
    done = subprocess.run([sys.executable, "-c", "import mooncake.store"], capture_output=True, text=True, timeout=60)
    return "" if done.returncode == 0 else (done.stderr.strip().splitlines() or ["?"])[-1]


def mooncake_or_skip() -> None:
    """Skip the calling test unless Mooncake's client works here (installing Debian's libraries for it
    once per session where this is root with apt-get)."""
    if "why" not in _TRIED:
        why = _importable()
        if why and "libibverbs" in why and os.geteuid() == 0 and shutil.which("apt-get"):
            env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
            cmd = ["apt-get", "install", "-y", "-q", "--no-install-recommends", "libibverbs1", "ibverbs-providers"]
            if subprocess.run(cmd, env=env, capture_output=True, timeout=600).returncode != 0:
                subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, timeout=600)
                subprocess.run(cmd, env=env, capture_output=True, timeout=600)
            why = _importable()
        _TRIED["why"] = why
    if _TRIED["why"]:
        pytest.skip(f"Mooncake's client does not import here ({_TRIED['why']}): pip install "
                    "'qwen3vl-encoder-service[mooncake]' and Debian's libibverbs1 ibverbs-providers")


def _master_binary() -> str:
    here = Path(sys.executable).parent / "mooncake_master"
    return str(here) if here.exists() else (shutil.which("mooncake_master") or "mooncake_master")


class Master:
    """`mooncake_master` on 127.0.0.1: `url` is what --store takes. Its RPC port is found free and then
    taken by the master at once (the master has no port-0 mode); a clash fails its start, loudly."""

    def __init__(self, log: Path, lease_ttl_ms: int = 30_000):
        self.log, self.lease_ttl_ms = log, lease_ttl_ms
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", 0))
            b.bind(("127.0.0.1", 0))
            self.port, self.metrics_port = a.getsockname()[1], b.getsockname()[1]
        self.url = f"mooncake://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [_master_binary(), "--rpc_address=127.0.0.1", f"--rpc_port={self.port}", "--metrics_host=127.0.0.1",
             f"--metrics_port={self.metrics_port}", f"--default_kv_lease_ttl={self.lease_ttl_ms}"],
            stdout=self.log.open("a"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while True:
            assert self.proc.poll() is None, f"mooncake_master exited:\n{self.log.read_text()[-2000:]}"
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                assert time.monotonic() < deadline, f"mooncake_master did not listen:\n{self.log.read_text()[-2000:]}"
                time.sleep(0.1)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def listens_only_on_loopback(self) -> bool:
        out = subprocess.run(["ss", "-tlnp"], capture_output=True, text=True).stdout if shutil.which("ss") else ""
        mine = [line for line in out.splitlines() if f"pid={self.proc.pid}," in line]
        return all(re.search(r"\s127\.0\.0\.1:\d+\s", line) for line in mine)
