"""Time from `git clone` to the first /ready 200 with `make run` on a fresh clone (the README's figure).

    python bench/time_to_ready.py /tmp/x            # clones this repository's checked-out branch to /tmp/x

Runs `make run` with a free loopback port and a private store next to the clone, stamps each line of
make's output with the seconds since the clone started (`<dest>.make.log`), polls /ready, prints the
time of the first 200 and the service's own start-up figures, then stops the server with SIGINT (as
Ctrl-C does). Needs only the standard library and git, make and the Python that `make` uses.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(dest: str) -> int:
    if os.path.exists(dest):
        sys.exit(f"{dest} exists: give a path that does not")
    branch = subprocess.run(["git", "-C", str(ROOT), "branch", "--show-current"], capture_output=True, text=True,
                            check=True).stdout.strip()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("QVE_", "MAKE", "VIRTUAL_ENV", "PYTHONPATH"))}
    t0 = time.monotonic()
    subprocess.run(["git", "clone", "-q", "-b", branch, str(ROOT), dest], check=True)
    print(f"{time.monotonic() - t0:7.1f} s  cloned {branch}", flush=True)
    make = subprocess.Popen(["make", "run", f"ARGS=--port {port} --store {dest}-store"], cwd=dest, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    log = open(f"{dest}.make.log", "w")

    def stamp_lines():
        for line in make.stdout:
            log.write(f"{time.monotonic() - t0:7.1f} {line}")
            log.flush()

    threading.Thread(target=stamp_lines, daemon=True).start()
    try:
        while make.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=5) as r:
                    info = json.load(r)
                print(f"{time.monotonic() - t0:7.1f} s  /ready 200; the service's start-up: {info['startup_s']}")
                return 0
            except (urllib.error.URLError, OSError):  # refused, 503 (an HTTPError), or a timeout
                time.sleep(0.2)
        print(f"make run exited with {make.returncode}; see {dest}.make.log")
        return 1
    finally:
        if make.poll() is None:
            os.killpg(make.pid, signal.SIGINT)
            make.wait(120)
        shutil.rmtree(f"{dest}-store", ignore_errors=True)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    sys.exit(main(sys.argv[1]))
