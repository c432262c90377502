"""The HTTP front end against the step loop, in one run on one machine (a CUDA GPU):

    python bench/bench_frontend.py --out DIR [--preset qwen3-vl-4b] [--modes 0,4,8,8x2] [--images 4096]
        [--stores directory,mooncake] [--variants "NAME:SERVE FLAGS;..."] [--tree CHECKOUT] [--no-baseline]
        [--no-x8] [--conc1 48] [--idle-requests 100] [--chat] [--sglang] [--profile-s N]

bench/RESULTS.md's HTTP lines: `--modes 4 --conc1 32 --no-x8 --no-baseline --images 8192 --idle-requests 300`,
as bench/gpu_frontend.sh runs it after the tower alone (the rate 1 image per request is held to).

1. baseline: the step loop with pre-decoded 448px images (`bench_tower.py --sections loop`, own process)
2. for each --modes entry (0 = one process doing everything, K = a supervisor with K API processes,
   KxG = K API processes and G engines, one per GPU: --devices cuda:0,...,cuda:G-1):
   start `python -m service serve`, then
     idle   one distinct 448px JPEG at a time, 100 requests (--idle-requests): p50 / p90 end to end, and the p50 of each
            phase of the server's Server-Timing header (parse, keys, admit, decode, encode, total)
     x1     distinct 448px JPEGs, 1 image per request, --clients processes x --conc1 connections
     x8     the same with 8 images per request, --clients x --conc8 connections
     chat   (--chat) after x1: the x1 load posted as vLLM's EPD proxy posts it, to /v1/chat/completions, then
            to /encode again: the chat route's img/s against the mean of the /encode passes around it
     sglang (--sglang) likewise as SGLang's language side posts it, to /sglang/encode, each client process taking
            the rows pushed back on a PULL socket of its own
   and stop it. With --stores, each mode runs once per store backend, in the order given: `directory` (a
   fresh directory in /dev/shm) and `mooncake` (a fresh mooncake_master on loopback, the server's segment
   --store-bytes, Mooncake's TCP transport). --variants runs each mode once per set of serve flags, --tree
   serves another checkout (an A/B of two commits: bench/ab_frontend.py alternates them).
Every image is distinct (no cache hits): pixels are a random gradient plus noise, JPEG quality 90
(~50 KB, like a photo). Request bodies are built before the clock starts; the client processes send
them over raw keep-alive HTTP/1.1 connections (a few microseconds each), so the server, not the load
generator, is what is measured. Per server it also reads the engine's step phases from /metrics, the GPU's
busy fraction (nvidia-smi) and each process's and thread's CPU seconds. Prints each phase's figures as it
goes, then a table per mode (idle p50, img/s and % of the step loop, the steady state, the step phases, the
engine's gc) and, with --stores, each Mooncake run's img/s against the directory run before it;
DIR/bench_frontend.json holds everything.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import collections
import io
import json
import multiprocessing as mp
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def jpeg_448(seed: int) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(seed)
    y = np.linspace(0, 1, 448, dtype=np.float32)[:, None, None]
    x = np.linspace(0, 1, 448, dtype=np.float32)[None, :, None]
    a, b, c = (rng.uniform(0, 255, 3).astype(np.float32) for _ in range(3))
    img = a * (1 - x) * (1 - y) + b * x + c * y * (1 - x) + rng.normal(0, 12, (448, 448, 3)).astype(np.float32)
    buf = io.BytesIO()
    Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def body(blobs: list[bytes]) -> bytes:
    parts = ",".join('{"type":"image_url","image_url":{"url":"data:image/jpeg;base64,%s"}}'
                     % base64.b64encode(b).decode() for b in blobs)
    return ('{"images":[%s]}' % parts).encode()


def chat_body(blob: bytes) -> bytes:
    """What vLLM's EPD proxy posts to its encoder for a user's chat request with this image."""
    return ('{"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"data:image/jpeg;base64,%s"}},'
            '{"type":"text","text":"Describe the image."}]}],"max_tokens":1,"stream":false}'
            % base64.b64encode(blob).decode()).encode()


def sglang_body(blob: bytes, req_id: str, pull_port: int) -> bytes:
    """What SGLang's language side posts to an encoder for one image (zmq_to_tokenizer: the rows come back to
    its PULL socket on `pull_port`)."""
    return ('{"encoder_idx":0,"encoder_url":"","mm_items":["data:image/jpeg;base64,%s"],"num_parts":1,"part_idx":0,'
            '"req_id":"%s","modality":"IMAGE","prefill_host":"127.0.0.1","embedding_port":%d}'
            % (base64.b64encode(blob).decode(), req_id, pull_port)).encode()


def free_ports(n: int) -> list[int]:
    import socket

    socks = [socket.socket() for _ in range(n)]
    for sk in socks:
        sk.bind(("127.0.0.1", 0))
    ports = [sk.getsockname()[1] for sk in socks]
    for sk in socks:
        sk.close()
    return ports


def request_bytes(port: int, payload: bytes, path: bytes = b"/encode") -> bytes:
    return (b"POST %s HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % (path, port, len(payload))) + payload


async def _send_all(port: int, requests: list[bytes], conc: int) -> list[tuple[int, float, dict, float]]:
    """(status, latency s, Server-Timing phases, perf_counter when answered) of each request."""
    todo = list(reversed(requests))
    out: list[tuple[int, float, dict, float]] = []

    async def conn():
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        while todo:
            req = todo.pop()
            t0 = time.perf_counter()
            writer.write(req)
            status = int((await reader.readline()).split()[1])
            length, phases = 0, {}
            while (line := await reader.readline()) not in (b"\r\n", b""):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
                elif line.lower().startswith(b"server-timing:"):  # where the server says the time went
                    phases = _phases(line.split(b":", 1)[1].decode())
            await reader.readexactly(length)
            t1 = time.perf_counter()
            out.append((status, t1 - t0, phases, t1))
        writer.close()

    await asyncio.gather(*(conn() for _ in range(conc)))
    return out


def _phases(header: str) -> dict[str, float]:
    out = {}
    for part in header.split(","):
        name, _, dur = part.strip().partition(";dur=")
        if dur:
            out[name] = float(dur)
    return out


def _client(port: int, requests: list[bytes], conc: int, barrier, q, pull_port: int | None = None) -> None:
    """Send `requests`; with `pull_port`, also take the messages SGLang's protocol pushes there (a thread: the
    count and bytes of those that arrived, waited for up to 30 s after the last answer)."""
    got = [0, 0]
    if pull_port is not None:
        import threading

        import zmq

        pull = zmq.Context().socket(zmq.PULL)
        pull.bind(f"tcp://127.0.0.1:{pull_port}")

        def drain():
            while pull.poll(60_000):
                frames = pull.recv_multipart(copy=False)
                got[0] += 1
                got[1] += sum(len(f.buffer) for f in frames)

        threading.Thread(target=drain, daemon=True).start()
    barrier.wait()
    t0 = time.perf_counter()
    res = asyncio.run(_send_all(port, requests, conc))
    t1 = time.perf_counter()
    ok = sum(1 for r in res if r[0] == 200)
    deadline = time.monotonic() + 30
    while pull_port is not None and got[0] < ok and time.monotonic() < deadline:
        time.sleep(0.01)
    q.put((t0, t1, res, tuple(got)))


def load(port: int, bodies: list[bytes], images_per_request: int, clients: int, conc: int,
         path: bytes = b"/encode", pull_ports: list[int] | None = None) -> dict:
    """Send every body once (to `path`), spread over `clients` processes of `conc` connections each (body i to
    client i % clients; with `pull_ports`, client i takes SGLang's pushes on pull_ports[i])."""
    ctx = mp.get_context("fork")
    barrier, q = ctx.Barrier(clients), ctx.Queue()
    reqs = [request_bytes(port, b, path) for b in bodies]
    procs = [ctx.Process(target=_client, args=(port, reqs[i::clients], conc, barrier, q,
                                               pull_ports[i] if pull_ports else None)) for i in range(clients)]
    for p in procs:
        p.start()
    parts = [q.get() for _ in procs]
    for p in procs:
        p.join()
    wall = max(p[1] for p in parts) - min(p[0] for p in parts)
    res = [r for p in parts for r in p[2]]
    ok = sorted(lat for st, lat, _, _ in res if st == 200)
    phases: dict[str, list[float]] = {}
    for st, _, ph, _ in res:
        for k, v in ph.items():
            phases.setdefault(k, []).append(v)
    codes: dict[str, int] = {}
    for st, _, _, _ in res:
        codes[str(st)] = codes.get(str(st), 0) + 1
    # The rate between the 10th and the 90th percentile of the answers' times: the load's steady state, without
    # its start (every connection's first request at once) and its end (fewer than `connections` in flight).
    done = sorted(t for st, _, _, t in res if st == 200)
    lo, hi = len(done) // 10, len(done) * 9 // 10
    steady = round((hi - lo) * images_per_request / (done[hi] - done[lo]), 1) if hi > lo and done[hi] > done[lo] else None
    pushed = [sum(p[3][0] for p in parts), sum(p[3][1] for p in parts)] if pull_ports else None
    return {"requests": len(res), "images_per_request": images_per_request, "pushed_messages_bytes": pushed, "clients": clients, "connections": clients * conc,
            "wall_s": round(wall, 3), "img_s": round(len(ok) * images_per_request / wall, 1),
            "img_s_steady": steady, "status": codes,
            "p50_ms": round(1e3 * ok[len(ok) // 2], 2) if ok else None,
            "p99_ms": round(1e3 * ok[int(len(ok) * 0.99)], 2) if ok else None,
            "server_timing_p50_ms": {k: round(statistics.median(v), 3) for k, v in phases.items()}}


def other_route(args, pool, port: int, name: str, route: str, path: bytes, seed: int, n: int, before: float) -> dict:
    """x1's load as vLLM's proxy (`chat`) or SGLang's language side (`sglang`: its rows pushed to each client's
    PULL socket) posts it, then /encode once more: its img/s against the mean of `before` (the /encode pass
    before it) and that one."""
    runs = {"x1_before": before}
    for k, what in enumerate((route, "encode")):
        blobs = pool.map(jpeg_448, range(seed + 100_000 * k, seed + 100_000 * k + n))
        ports = free_ports(args.clients) if what == "sglang" else None
        if what == "chat":
            bodies = [chat_body(b) for b in blobs]
        elif what == "sglang":
            bodies = [sglang_body(b, f"b{i}_local_part_0", ports[i % args.clients]) for i, b in enumerate(blobs)]
        else:
            bodies = [body([b]) for b in blobs]
        got = load(port, bodies, 1, args.clients, args.conc1, b"/encode" if what == "encode" else path, ports)
        runs[f"x1_{what}"] = got["img_s"]
        if ports:
            runs["pushed_messages_bytes"] = got["pushed_messages_bytes"]
        print(f"{name}: 1 img/request, {what} {got}", flush=True)
    runs[f"{route}_vs_encode"] = round(runs[f"x1_{route}"] / ((before + runs["x1_encode"]) / 2), 3)
    print(f"{name}: {route} / encode (the mean of the passes before and after) {runs}", flush=True)
    return runs


def _tree(root: int) -> list[int]:
    """root and every process below it (from /proc: each one's parent)."""
    sys.path[:0] = [str(ROOT), str(ROOT / "kernels")]  # this checkout\'s service and kernels
    from tests.support.proctree import descendants

    return [root, *descendants(root)]


def cpu_snapshot(roots: list[int]) -> dict[int, dict]:
    """CPU seconds (user + system) of every process under `roots` and of each of its threads, by name."""
    tick = os.sysconf("SC_CLK_TCK")
    snap = {}
    for pid in [p for r in roots for p in _tree(r)]:
        try:
            name = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:90].strip()
            threads = {}
            for t in Path(f"/proc/{pid}/task").iterdir():
                head, tail = t.joinpath("stat").read_text().rsplit(")", 1)
                f = tail.split()
                threads[int(t.name)] = (head.split("(", 1)[1], int(f[11]) / tick, int(f[12]) / tick)  # user, system
        except (OSError, IndexError, ValueError):
            continue
        snap[pid] = {"name": name, "threads": threads}
    return snap


def cpu_used(before: dict, after: dict, top: int = 12) -> dict:
    """Each process's CPU seconds between two snapshots, and its busiest threads ([name, seconds, of which in
    the kernel]: a thread busy in the kernel is copying through sockets or files, not running Python)."""
    out = []
    for pid, a in after.items():
        b = before.get(pid, {"threads": {}})["threads"]
        per = {}
        for tid, (comm, user, system) in a["threads"].items():
            _, user0, system0 = b.get(tid, (comm, 0.0, 0.0))
            per[tid] = (comm, user - user0 + system - system0, system - system0)
        total = sum(c for _, c, _ in per.values())
        busiest = sorted(per.values(), key=lambda x: -x[1])[:6]
        out.append({"pid": pid, "name": a["name"], "cpu_s": round(total, 2), "threads": len(per),
                    "busiest": [[comm, round(c, 2), round(k, 2)] for comm, c, k in busiest if c >= 0.05]})
    return {"processes": sorted(out, key=lambda x: -x["cpu_s"])[:top]}


STEP_PHASES = ("idle", "stage", "launch", "output_wait", "reserve", "copy_wait", "commit", "device", "device_gap")
# Phases whose distribution is read too, at these histogram bounds (service/metrics.py's _PHASE_BUCKETS), in s:
# device_gap's mean alone mixes many short gaps with the one before a load's first step (the device idle since the
# last request); a few slow stagings could leave the device without a step where the mean stage time would not.
SHARE_LE = {"device_gap": ("0.0005", "0.001", "0.005", "0.02"), "stage": ("0.005", "0.02", "0.05")}


def gpu_busy() -> subprocess.Popen | None:
    """nvidia-smi sampling the GPU's busy fraction every 100 ms (its stdout: one percentage per line)."""
    if not shutil.which("nvidia-smi"):
        return None
    return subprocess.Popen(["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits", "-i", "0",
                             "-lms", "100"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)


def gpu_busy_pct(p: subprocess.Popen | None) -> float | None:
    if p is None:
        return None
    p.terminate()
    vals = [float(v) for v in p.communicate()[0].split() if v.replace(".", "").isdigit()]
    return round(sum(vals) / len(vals), 1) if vals else None



def store_parent(flags: str) -> tuple[str | None, str]:
    """A variant's `@store=DIR` (not a serve flag): its directory store goes under DIR (e.g. a tmpfs mounted
    with huge pages) instead of /dev/shm. Returns (the parent directory, the serve flags without it)."""
    words = shlex.split(flags)
    parent = next((w[len("@store="):] for w in words if w.startswith("@store=")), None)
    default = "/dev/shm" if os.path.isdir("/dev/shm") else None
    return parent or default, shlex.join(w for w in words if not w.startswith("@store="))


def engine_counters(port: int) -> dict[str, float]:
    """From /metrics: steps, images in steps, and the seconds of each step phase (qve_step_phase_seconds),
    summed over engines (with several, each engine's series carries an engine="i" label)."""
    import http.client

    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    c.request("GET", "/metrics")
    text = c.getresponse().read().decode()
    val = lambda name, *more: sum(float(l.split()[-1]) for l in text.splitlines()  # noqa: E731,E741
                                  if l.startswith((name + " ", name + "{")) and all(m in l for m in more))
    out = {"steps": val("qve_step_images_count"), "images": val("qve_step_images_sum")}
    for ph in STEP_PHASES:
        out[ph] = val("qve_step_phase_seconds_sum", f'phase="{ph}"')
    for gen in ("1", "2"):  # the engine's garbage collections (Metrics.watch_gc): every thread of it waits
        out[f"gc{gen}_s"] = val("qve_gc_pause_seconds_sum", f'generation="{gen}"')
        out[f"gc{gen}_n"] = val("qve_gc_pause_seconds_count", f'generation="{gen}"')
    for ph, bounds in SHARE_LE.items():  # how many of the phase's times were at most `le` seconds
        for le in bounds:
            out[f"{ph}_le_{le}"] = val("qve_step_phase_seconds_bucket", f'phase="{ph}"', f'le="{le}"')
        out[f"{ph}_count"] = val("qve_step_phase_seconds_count", f'phase="{ph}"')
    return out


def _shares(before: dict[str, float], after: dict[str, float], ph: str) -> dict[str, float] | None:
    """The shares of `ph`'s times between two engine_counters that were at most each SHARE_LE bound, by ms."""
    n = after.get(f"{ph}_count", 0) - before.get(f"{ph}_count", 0)
    if n <= 0:
        return None
    return {f"{1e3 * float(le):g}": round((after[f"{ph}_le_{le}"] - before[f"{ph}_le_{le}"]) / n, 3)
            for le in SHARE_LE[ph]}


def per_step(before: dict[str, float], after: dict[str, float], wall_s: float) -> dict:
    """Images per step, the time between steps and each phase's mean per step (ms) between two engine_counters."""
    steps = after["steps"] - before["steps"]
    if steps <= 0:
        return {"steps": 0}
    return {"steps": int(steps), "images_per_step": round((after["images"] - before["images"]) / steps, 1),
            "ms_between_steps": round(1e3 * wall_s / steps, 2),
            "phase_ms": {ph: round(1e3 * (after[ph] - before[ph]) / steps, 2) for ph in STEP_PHASES},
            **{f"{ph}_share_le_ms": _shares(before, after, ph) for ph in SHARE_LE},
            # the engine's garbage collections of generations 1 and 2 meanwhile: how many, and their pauses in all (ms)
            "gc": {f"gen{g}": [int(after.get(f"gc{g}_n", 0) - before.get(f"gc{g}_n", 0)),
                               round(1e3 * (after.get(f"gc{g}_s", 0) - before.get(f"gc{g}_s", 0)), 1)] for g in ("1", "2")}}


def idle(port: int, blobs: list[bytes]) -> dict:
    import http.client

    c = http.client.HTTPConnection("127.0.0.1", port)
    lat, codes, phases = [], set(), {}
    for i, b in enumerate(blobs):
        payload = body([b])
        t0 = time.perf_counter()
        c.request("POST", "/encode", payload, {"Content-Type": "application/json"})
        r = c.getresponse()
        r.read()
        lat.append(time.perf_counter() - t0)
        codes.add(r.status)
        if i >= 10 and (st := r.getheader("Server-Timing")):  # where the server says the time went
            for part in st.split(","):
                name, dur = part.strip().split(";dur=")
                phases.setdefault(name, []).append(float(dur))
    lat = sorted(lat[10:])
    return {"n": len(lat), "p50_ms": round(1e3 * statistics.median(lat), 2),
            "p90_ms": round(1e3 * lat[int(0.9 * len(lat))], 2), "status": sorted(codes),
            "server_timing_p50_ms": {k: round(statistics.median(v), 3) for k, v in phases.items()}}


def parse_mode(mode: str) -> tuple[int, int]:
    """'4' -> (4 API processes, 1 engine); '8x2' -> (8, 2 engines on cuda:0 and cuda:1)."""
    api, _, engines = mode.partition("x")
    return int(api), int(engines or 1)


def serve(args, mode: str, port: int, store: Path | str, log: Path, flags: str = "") -> subprocess.Popen:
    api, engines = parse_mode(mode)
    cmd = [sys.executable, "-m", "service", "serve", "--model", args.preset, "--device", args.device,
           "--store", str(store), "--port", str(port), "--store-capacity-bytes", str(args.store_bytes),
           "--store-min-residency-s", "0", "--max-queue-images", "4096", "--api-processes", str(api),
           "--compile-cache", str(args.compile_cache), *shlex.split(flags)]
    if args.sglang:
        cmd += ["--sglang-version", "0.5.23"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if str(store).startswith("mooncake://"):
        cmd += ["--mooncake-local-host", "127.0.0.1", "--mooncake-segment-bytes", str(args.store_bytes)]
        env["MC_TCP_BIND_ADDRESS"] = "127.0.0.1"  # (else Mooncake advertises the first non-loopback interface)
    if engines > 1:
        cmd += ["--devices", ",".join(f"{args.device}:{i}" for i in range(engines))]
    proc = subprocess.Popen(cmd, cwd=args.tree, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
    return wait_ready(proc, port, log, f"server (mode {mode})")


def wait_ready(proc: subprocess.Popen, port: int, log: Path, what: str = "server") -> subprocess.Popen:
    """`proc` once its /ready answers 200 (within 300 s), else it is killed and RuntimeError has its log's end."""
    import http.client

    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            c.request("GET", "/ready")
            if c.getresponse().status == 200:
                return proc
        except OSError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"{what} not ready:\n{log.read_text()[-3000:]}")


def stop(proc: subprocess.Popen, timeout_s: float = 120) -> None:
    """SIGTERM (the server's graceful stop), then SIGKILL after `timeout_s`."""
    proc.terminate()
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()


def mooncake_master(args, name: str):
    """A fresh mooncake_master on loopback for one server (tests/support/mooncake_pool.py's), its log in --out."""
    import importlib.util

    sys.path[:0] = [str(ROOT), str(ROOT / "kernels")]  # this checkout\'s service and kernels
    from tests.support.mooncake_pool import LOOPBACK, Master

    # (the binary ships inside the wheel's package; the console script beside it may not be on PATH)
    spec = importlib.util.find_spec("mooncake")
    binary = Path(list(spec.submodule_search_locations)[0]) / "mooncake_master" if spec else None
    if binary is None or not binary.exists():
        binary = Path(shutil.which("mooncake_master") or "mooncake_master")
    return Master(binary, LOOPBACK, args.out / f"mooncake_master_{name}.log")


def profile(args, server_pid: int, phase: str) -> list:
    """Start py-spy on the server and its child processes (engine, API processes, decode workers), 1 s
    into the phase, for --profile-s seconds; returns (process, raw file) pairs for `summarize`."""
    spy = shutil.which("py-spy")
    if not args.profile_s or not spy:
        return []
    pids = [server_pid]
    for task in Path(f"/proc/{server_pid}/task").iterdir():
        pids += [int(p) for p in (task / "children").read_text().split()]
    spies = []
    for pid in pids:
        try:
            name = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:80].strip()
        except OSError:
            continue
        if "forkserver" in name or "resource_tracker" in name:
            continue
        raw = args.out / f"pyspy_{phase}_{pid}.txt"
        gil = "--gil" if args.profile_gil else "--threads"  # (every thread: each sample names its thread)
        cmd = f"sleep 1; exec {spy} record -p {pid} -d {args.profile_s} -r 200 {gil} --nonblocking -f raw -o {raw}"
        spies.append((subprocess.Popen(["sh", "-c", cmd], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT), raw, name))
    return spies


def pyspy_top(raw: Path) -> str:
    """A py-spy raw profile (`py-spy record -f raw`) summed up: samples per thread root, the top leaf frames
    (where the time is spent) and the top inclusive frames of the project's own code."""
    threads, leaves, inclusive = collections.Counter(), collections.Counter(), collections.Counter()
    for line in raw.read_text().splitlines():
        stack, n = line.rsplit(" ", 1)
        parts = stack.split(";")
        threads[parts[0]] += int(n)
        leaves[parts[-1]] += int(n)
        for frame in set(parts):
            if "service/" in frame or "kernels/" in frame:
                inclusive[frame] += int(n)
    total = sum(threads.values()) or 1
    out = [f"{sum(threads.values())} samples"]
    out += [f"{v:6d} {100 * v / total:5.1f}%  thread root {k}" for k, v in threads.most_common(12)]
    out += ["-- leaf frames"] + [f"{v:6d} {100 * v / total:5.1f}%  {k}" for k, v in leaves.most_common(40)]
    out += ["-- inclusive, the project's frames"]
    out += [f"{v:6d} {100 * v / total:5.1f}%  {k}" for k, v in inclusive.most_common(30)]
    return "\n".join(out) + "\n"


def summarize(spies: list) -> None:
    """Wait for each py-spy of `profile` and write its summary beside its raw file (pyspy_*.top)."""
    for p, raw, name in spies:
        p.wait(60)
        if raw.exists():
            raw.with_suffix(".top").write_text(f"{name}\n{pyspy_top(raw)}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--preset", default="qwen3-vl-4b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--modes", default="0,4,8", help="--api-processes values to run (0: one process); "
                    "KxG: K API processes and G engines (--devices cuda:0..G-1)")
    ap.add_argument("--images", type=int, default=4096, help="images per load phase")
    ap.add_argument("--idle-requests", type=int, default=100, help="one image on an idle server: requests measured "
                    "(after 10 not measured)")
    ap.add_argument("--clients", type=int, default=4, help="load-generator processes")
    ap.add_argument("--conc1", type=int, default=48, help="connections per client, 1 image per request")
    ap.add_argument("--conc8", type=int, default=8, help="connections per client, 8 images per request")
    ap.add_argument("--store-bytes", type=int, default=12 * 1024**3, help="the store's capacity (a directory) or "
                    "the server's Mooncake segment")
    ap.add_argument("--stores", default="directory", help="comma-separated backends each mode runs on, in turn: "
                    "directory, mooncake (needs Mooncake's client and mooncake_master: the `mooncake` extra)")
    ap.add_argument("--variants", default=":", help="semicolon-separated NAME:SERVE FLAGS, each mode run once per "
                    "variant (e.g. \":;slots6:--pool-slots 6\"; the default: one, the server's defaults); a flag "
                    "@store=DIR puts that variant's directory store under DIR instead of /dev/shm")
    ap.add_argument("--x8", action=argparse.BooleanOptionalAction, default=True, help="the 8-images-per-request phase")
    ap.add_argument("--chat", action="store_true", help="after x1: the same load as vLLM's EPD proxy posts it to "
                    "/v1/chat/completions, then /encode again; the chat's img/s against the two /encode passes' mean")
    ap.add_argument("--sglang", action="store_true", help="after x1 (and --chat): the same load as SGLang's language "
                    "side posts it to /sglang/encode, its rows pushed to the clients' PULL sockets, then /encode "
                    "again; its img/s against the two /encode passes' mean (serves with --sglang-version)")
    ap.add_argument("--baseline", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--tree", type=Path, default=ROOT, help="the checkout whose `python -m service serve` is measured "
                    "(another commit's tree, for an A/B in one run: bench/ab_frontend.py); the client is this one")
    ap.add_argument("--compile-cache", type=Path, default=None, help="torch.compile cache shared by the servers "
                    "(default: a fresh one, so the first server compiles)")
    ap.add_argument("--profile-s", type=int, default=0, help="py-spy (if on PATH) every server process for this "
                    "many seconds during each load phase (DIR/pyspy_*)")
    ap.add_argument("--profile-gil", action=argparse.BooleanOptionalAction, default=True,
                    help="py-spy --gil: only the thread holding each process's GIL (--no-profile-gil: every "
                    "thread that is not idle, by thread)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    args.compile_cache = args.compile_cache or Path(tempfile.mkdtemp(prefix="qve-frontend-cc-"))
    res: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "command": " ".join(sys.argv),
                 "tree": str(args.tree),
                 "cpus": os.cpu_count(), "python": platform.python_version(), "preset": args.preset, "modes": {}}
    try:
        import torch

        res["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    except Exception:  # noqa: BLE001
        res["gpu"] = "unknown"

    def save():
        (args.out / "bench_frontend.json").write_text(json.dumps(res, indent=2))

    if args.baseline:
        bt = args.out / "baseline"
        subprocess.run([sys.executable, "bench/bench_tower.py", "--out", str(bt), "--preset", args.preset,
                        "--sections", "loop"], cwd=ROOT, check=True, stdout=(args.out / "baseline.log").open("w"),
                       stderr=subprocess.STDOUT)
        tower = json.loads((bt / "bench_tower.json").read_text())
        res["step_loop_img_s"] = tower["loop"][0]["img_s"]
        res["step_loop_first_pass_img_s"] = tower["loop_first_pass_img_s"]
        print("step loop, pre-decoded:", res["step_loop_img_s"], "img/s", flush=True)
        save()

    n = args.images
    with mp.get_context("spawn").Pool(min(16, os.cpu_count() or 2)) as pool:
        last_directory: dict[str, dict] = {}
        variants = [v.partition(":")[::2] for v in args.variants.split(";")]
        runs = [(mode, kind, variant) for mode in args.modes.split(",") for kind in args.stores.split(",")
                for variant in variants]
        for mi, (mode, kind, (vname, vflags)) in enumerate(runs):
            base = 1_000_000 * (mi + 1)
            blobs_idle = pool.map(jpeg_448, range(base, base + 10 + args.idle_requests))
            blobs1 = pool.map(jpeg_448, range(base + 1000, base + 1000 + n))
            blobs8 = pool.map(jpeg_448, range(base + 500_000, base + 500_000 + n))
            bodies1 = [body([b]) for b in blobs1]
            bodies8 = [body(blobs8[i : i + 8]) for i in range(0, n - n % 8, 8)]
            res["jpeg_kb_mean"] = round(sum(map(len, blobs1)) / len(blobs1) / 1024, 1)
            port = 18300 + mi
            parent, vflags = store_parent(vflags)
            store = Path(tempfile.mkdtemp(prefix="qve-frontend-", dir=parent))
            name = (str(mode) if kind == "directory" else f"{mode}@{kind}") + (f"/{vname}" if vname else "")
            tag = f"{mode}-{kind}-run{mi + 1}"  # (file names of letters, digits and dashes: they travel back)
            master = mooncake_master(args, tag) if kind == "mooncake" else None
            proc = serve(args, mode, port, master.url if master else store / "s", args.out / f"server_mode{tag}.log",
                         vflags)
            try:
                si, t_idle = engine_counters(port), time.perf_counter()
                r = {"idle": idle(port, blobs_idle)}
                r["idle"].update(per_step(si, engine_counters(port), time.perf_counter() - t_idle))
                print(f"{name}: idle {r['idle']}", flush=True)
                s0 = engine_counters(port)
                spies = profile(args, proc.pid, f"mode{mode}_x1")
                roots = [proc.pid] + ([master.proc.pid] if master is not None else [])
                c0, busy = cpu_snapshot(roots), gpu_busy()
                r["x1"] = load(port, bodies1, 1, args.clients, args.conc1)
                r["x1"]["cpu"], r["x1"]["gpu_busy_pct"] = cpu_used(c0, cpu_snapshot(roots)), gpu_busy_pct(busy)
                summarize(spies)
                s1 = engine_counters(port)
                r["x1"].update(per_step(s0, s1, r["x1"]["wall_s"]))
                print(f"{name}: 1 img/request {r['x1']}", flush=True)
                before = r["x1"]["img_s"]
                for flag, route, path in ((args.chat, "chat", b"/v1/chat/completions"), (args.sglang, "sglang", b"/sglang/encode")):
                    if flag:  # the same load in another engine's protocol, between two /encode passes (fresh images)
                        seed = base + 600_000 + 200_000 * (len(r) - 2)  # (clear of the other passes' images)
                        r[route] = other_route(args, pool, port, name, route, path, seed, n, before)
                        before = r[route]["x1_encode"]
                        s1 = engine_counters(port)
                if args.x8:
                    spies = profile(args, proc.pid, f"mode{mode}_x8")
                    r["x8"] = load(port, bodies8, 8, args.clients, args.conc8)
                    summarize(spies)
                    r["x8"].update(per_step(s1, engine_counters(port), r["x8"]["wall_s"]))
                    print(f"{name}: 8 img/request {r['x8']}", flush=True)
                r["store"] = kind
                if kind == "directory":
                    last_directory[mode] = r
                elif mode in last_directory:  # this backend against the directory run of this mode before it
                    r["vs_directory"] = {k: round(r[k]["img_s"] / last_directory[mode][k]["img_s"], 3) for k in ("x1", "x8")
                                         if k in r}
                # A mode given twice (--modes 4,4: two passes in one run) keeps both: "4", then "4#2".
                res["modes"][name if name not in res["modes"] else f"{name}#{mi + 1}"] = r
                save()
            finally:
                stop(proc)
                shutil.rmtree(store, ignore_errors=True)
                if master:
                    master.stop()

    loop = res.get("step_loop_img_s")
    print(f"\n{res['date']}  {res['gpu']}  {res['cpus']} CPUs  preset {args.preset}  step loop {loop} img/s")
    print("api processes | idle p50 ms | 1 img/req img/s (% loop) | its steady state | 8 img/req img/s (% loop)")
    pct = lambda v: f"{100 * v / loop:.0f}%" if loop else "-"  # noqa: E731
    for mode, r in res["modes"].items():
        x8 = f"{r['x8']['img_s']:>8} ({pct(r['x8']['img_s'])})" if "x8" in r else "-"
        print(f"{mode:>13} | {r['idle']['p50_ms']:>11} | {r['x1']['img_s']:>8} ({pct(r['x1']['img_s'])}) | "
              f"{r['x1'].get('img_s_steady')} | {x8}")
    print("per step at 1 img/request (ms): images, between steps, " + ", ".join(STEP_PHASES))
    for mode, r in res["modes"].items():
        x = r["x1"]
        if x.get("steps"):
            print(f"{mode:>13} | {x['images_per_step']} | {x['ms_between_steps']} | "
                  + ", ".join(str(x["phase_ms"][ph]) for ph in STEP_PHASES))
    for mode, r in res["modes"].items():
        if r["x1"].get("gc"):
            print(f"{mode:>13} | engine gc at 1 img/request (collections, ms in all): {r['x1']['gc']}")
    for name, r in res["modes"].items():
        if "vs_directory" in r:
            print(f"{name}: img/s {r['vs_directory']} of the directory run before it")
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
