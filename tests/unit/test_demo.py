"""`qwen3vl-encoder demo` (service/demo.py) stopped while it starts: it leaves no server and no folder behind.
(tests/system/test_demo.py runs the whole demo as `make demo` does.)"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

from tests.support.processes import wait_for
from tests.support.proctree import alive, descendants

ROOT = Path(__file__).resolve().parents[2]


def test_sigterm_while_the_demo_starts_stops_its_encoder_and_removes_its_folder():
    """A SIGTERM (a service manager, `timeout`, a CI job cancelled) while the encoder was starting killed the
    demo without its clean-up: the encoder ran on, and the temporary folder stayed."""
    proc = subprocess.Popen([sys.executable, "-m", "service", "demo"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    servers: list[int] = []
    try:
        work, lines = None, []
        for line in proc.stdout:
            lines.append(line)
            if (m := re.search(r"RANDOM weights to (\S+)/tiny-qwen3vl ", line)) is not None:
                work = Path(m[1])
            if "starting the encoder" in line:
                break
        assert work is not None and work.is_dir(), "".join(lines)
        wait_for(lambda: descendants(proc.pid), timeout=30, what="the encoder process")
        servers = list(descendants(proc.pid))
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=90)
        assert proc.returncode == 128 + signal.SIGTERM, "".join(lines) + out
        wait_for(lambda: not any(alive(pid) for pid in servers), timeout=30, what="the encoder to stop")
        assert not work.exists(), f"{work} left behind"
        assert "Traceback" not in out, out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        for pid in servers:  # (what a failed run leaked: the servers this test's demo started)
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
