"""The server a soak starts: `python -m service serve ARGS` on 127.0.0.1, its output in a log, stopped
as an operator stops it (SIGTERM: it drains and exits)."""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

# The directory holding this `service` package: the server is started on the same code as the soak.
SOURCE = Path(__file__).resolve().parents[2]


# The line `serve` logs once its socket is bound (in one process, or its supervisor's), with the port.
BOUND = re.compile(r"(?:listening on|supervisor \d+:) http://127\.0\.0\.1:(\d+)")


def serve_settings(serve_args: list[str]):
    """The Settings the server will run with (to learn its store, model and pixel limits): `serve`'s own
    flags, read as `serve` reads them."""
    from service.config import Settings
    from service.flags import add_setting_flags

    parser = argparse.ArgumentParser(prog="qwen3vl-encoder serve", argument_default=argparse.SUPPRESS)
    add_setting_flags(parser)
    args = vars(parser.parse_args(serve_args))
    args.pop("log_level", None)
    return Settings(**args)


class Server:
    """`python -m service serve ARGS` on 127.0.0.1 and port 0 (always: later flags win), its output in `log`.
    The kernel picks the port as the server binds it; the port is read from the line the server logs at
    level info (a --log-level above info in ARGS hides it: the start then times out)."""

    def __init__(self, serve_args: list[str], log: Path, ready_timeout_s: float, fault_inject: str | None = None):
        self.port = self.url = None
        self.log = log
        cmd = [sys.executable, "-m", "service", "serve", *serve_args, "--host", "127.0.0.1", "--port", "0"]
        # This process's `service`, not whichever an install elsewhere puts first (PYTHONPATH, not cwd:
        # relative paths in ARGS stay the caller's).
        path = os.pathsep.join(p for p in (str(SOURCE), os.environ.get("PYTHONPATH")) if p)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path}
        if fault_inject:  # the server's alone: the load tool's reference engine must stay exact
            env["QVE_FAULT_INJECT"] = fault_inject
        self.proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + ready_timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with status {self.proc.returncode} before it was ready; "
                                   f"see {log}")
            if self.url is None and (bound := BOUND.search(log.read_text(errors="replace"))):
                self.port = int(bound.group(1))
                self.url = f"http://127.0.0.1:{self.port}"
            try:
                if self.url is not None and httpx.get(self.url + "/ready", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the server was not ready within {ready_timeout_s:g} s; see {log}")
            time.sleep(0.2)

    def stop(self, timeout_s: float = 60) -> int | None:
        """SIGTERM (the service drains and exits), SIGKILL if it hangs; its exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
            return None
