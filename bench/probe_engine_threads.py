"""Per-thread CPU seconds of a tiny server's engine process (supervised, one API process), idle for 10 s and then
under 20 s of load (4 clients, distinct 64x64 PNGs), with the directory store and then with Mooncake Store
(a mooncake_master on loopback, a 512 MiB segment). Threads are named by the service (procs/child.py); a
Mooncake client thread inherits the name of the thread that set it up (qve-engine).

    python bench/probe_engine_threads.py OUT_DIR
"""
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402  (after the path set-up above)

from tests import imagedata as data  # noqa: E402
from tests.live import ServiceProcess, json_body  # noqa: E402


def threads(pid: int) -> dict[str, tuple[str, float]]:
    """tid -> (thread name, CPU seconds so far)."""
    out = {}
    for t in Path(f"/proc/{pid}/task").iterdir():
        try:
            st = (t / "stat").read_text().rsplit(")", 1)[1].split()
            comm = (t / "comm").read_text().strip()
            out[t.name] = (comm, (int(st[11]) + int(st[12])) / os.sysconf("SC_CLK_TCK"))
        except OSError:
            pass
    return out

def delta(a, b) -> dict[str, float]:
    """CPU seconds per thread name between two `threads` readings, busiest first."""
    d = {}
    for tid, (comm, cpu) in b.items():
        d.setdefault(comm, 0.0)
        d[comm] += cpu - a.get(tid, (comm, 0.0))[1]
    return dict(sorted(d.items(), key=lambda kv: -kv[1]))

def load(url: str, seconds: float, seed: int) -> int:
    """4 clients posting distinct images for `seconds`; the number answered 200."""
    stop = time.monotonic() + seconds; n = 0
    def client(c):
        nonlocal n
        i = 0
        with httpx.Client(timeout=60) as cl:
            while time.monotonic() < stop:
                i += 1
                blob = data.encode(data.textured_rgb(64, 64, seed=seed * 100000 + c * 10000 + i), "PNG")
                r = cl.post(url + "/encode", json=json_body(blob)); n += r.status_code == 200
    ts = [threading.Thread(target=client, args=(c,)) for c in range(4)]
    [t.start() for t in ts]; [t.join() for t in ts]
    return n

def run(store: str, tmp: str, tag: str) -> None:
    s = ServiceProcess(["serve", "--model", "tiny", "--device", "cpu", "--store", store, "--api-processes", "1",
                        "--min-pixels", "4096", "--max-pixels", "4096"], Path(tmp) / f"{tag}.log")
    try:
        eng = httpx.get(s.url + "/ready").json()["engine_pid"]
        a = threads(eng); time.sleep(10); b = threads(eng)
        idle = delta(a, b)
        n = load(s.url, 20, 1 if tag == "dir" else 2)
        c = threads(eng)
        busy = delta(b, c)
        print(tag, "idle 10 s:", {k: round(v, 2) for k, v in idle.items() if v > 0.005})
        print(tag, f"load 20 s ({n} images):", {k: round(v, 2) for k, v in busy.items() if v > 0.005})
    finally:
        s.stop()

tmp = sys.argv[1]; os.makedirs(tmp, exist_ok=True)
run(f"{tmp}/dirstore", tmp, "dir")
master = subprocess.Popen([str(Path(sys.executable).parent / "mooncake_master"), "--rpc_address=127.0.0.1", "--rpc_port=50071",
                           "--metrics_host=127.0.0.1", "--metrics_port=9071", "--default_kv_lease_ttl=5000"],
                          stdout=open(f"{tmp}/master.log", "w"), stderr=subprocess.STDOUT)
time.sleep(2)
try:
    os.environ["QVE_MOONCAKE_SEGMENT_BYTES"] = str(512 << 20)
    run("mooncake://127.0.0.1:50071", tmp, "mooncake")
finally:
    master.terminate()
