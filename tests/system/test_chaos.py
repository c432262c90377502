"""SIGKILL of each process of the service at a random moment while load runs and store writes are in
flight, five times: an API process, the engine and the supervisor (--api-processes 2), then a decode
worker and the server itself (one process). After each: no orphan process; whenever a server is
started again on the same store: every file in it parses with the consumer's reader, no temp file is
left, the index matches the files, and every key answered before is a hit.

The moments are drawn from a seeded RNG; the seed is printed (and in every failure message). Rerun
with QVE_CHAOS_SEED=<seed> to replay the same moments."""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from service.store.format import FILE_NAME, read_embeddings
from tests.support import imagedata as data
from tests.support.live import ServiceProcess, json_body, metric
from tests.support.processes import ready_info, wait_for
from tests.support.proctree import alive, descendants

pytestmark = [pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm (POSIX shared memory)"),
              pytest.mark.slow]  # five SIGKILLs and four server starts under load: minutes


_RUNNING: list[Load] = []  # every Load started, for _stop_loads


@pytest.fixture(autouse=True)
def _stop_loads():
    """Stop every Load a test started when it ends, failed or not: client threads left posting keep
    pytest from exiting (CI once hung so after a failed wait, with an earlier Load still running)."""
    yield
    while _RUNNING:
        _RUNNING.pop().stop.set()


class Load:
    """Client threads posting distinct images until stopped; remembers what was answered 200."""

    def __init__(self, url: str, seed: int, clients: int = 4):
        self.url, self.seed = url, seed
        self.answered: dict[str, bytes] = {}  # key -> image bytes
        self.statuses: list[int | str] = []
        self.stop = threading.Event()
        self.pool = ThreadPoolExecutor(clients)
        self.futures = [self.pool.submit(self._client, c) for c in range(clients)]
        _RUNNING.append(self)

    def _client(self, c: int) -> None:
        i = 0
        with httpx.Client(timeout=30) as client:
            while not self.stop.is_set():
                i += 1
                blob = data.encode(data.textured_rgb(160, 128, seed=(self.seed * 1000 + c) * 100_000 + i), "PNG")
                try:
                    r = client.post(self.url + "/encode", json=json_body(blob))
                except httpx.TransportError as e:  # the process that held the connection was killed
                    self.statuses.append(type(e).__name__)
                    continue
                self.statuses.append(r.status_code)
                if r.status_code == 200:
                    self.answered[r.json()["items"][0]["key"]] = blob

    def wait_answers(self, n: int, timeout: float = 90) -> None:  # a fresh decode pool imports for seconds on a busy 2-core CI machine
        start = len(self.answered)
        wait_for(lambda: len(self.answered) >= start + n, timeout, f"{n} more answers under load")

    def finish(self) -> dict[str, bytes]:
        self.stop.set()
        for f in self.futures:
            f.result()
        self.pool.shutdown()
        return self.answered


def _server(store: Path, *extra: str) -> ServiceProcess:
    log = store.parent / f"server-{len(list(store.parent.glob('server-*.log')))}.log"  # one per restart
    return ServiceProcess(["serve", "--model", "tiny", "--device", "cpu", "--store", str(store), "--host", "127.0.0.1",
                           "--decode-workers", "2", "--max-wait-ms", "2", *extra], log)


def _check_store(server: ServiceProcess, store: Path, answered: dict[str, bytes], why: str) -> None:
    """A server just started on `store`: every file whole, no temp file, index = files, old keys are hits."""
    files = [p for p in store.rglob("*") if p.is_file() and p.name != ".lock"]
    assert not [p for p in files if p.name.startswith(".tmp")], f"{why}: temp files left after restart"
    assert all(p.name == FILE_NAME and p.parent.parent == store for p in files), f"{why}: stray files {files}"
    for p in files:
        read_embeddings(store, p.parent.name)  # raises on a torn or foreign file
    m = httpx.get(server.url + "/metrics", timeout=10).text
    assert metric(m, "qve_store_items") == len(files), why
    assert metric(m, "qve_store_bytes") == sum(p.stat().st_size for p in files), why
    assert set(answered) <= {p.parent.name for p in files}, f"{why}: answered keys missing from the store"
    cleaned = server.log.read_text().count("removing stale temp file")  # writes the kill cut short
    print(f"{why}: {len(files)} files, all whole; {cleaned} temp files of killed writes removed at restart")
    keys, blobs = list(answered), list(answered.values())
    for k in range(0, len(keys), 8):  # and the service answers them as hits
        r = httpx.post(server.url + "/encode", json=json_body(*blobs[k:k + 8]), timeout=60)
        assert r.status_code == 200, f"{why}: {r.text}"
        assert [(it["key"], it["cached"]) for it in r.json()["items"]] == [(key, True) for key in keys[k:k + 8]], why


def _decode_workers(pid: int) -> list[int]:
    """The decode workers of a single-process server: the children of its multiprocessing forkserver."""
    def ppid(p: int) -> int:
        return int(Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[1])

    below = descendants(pid)
    forkserver = [p for p in below if ppid(p) == pid and b"forkserver" in Path(f"/proc/{p}/cmdline").read_bytes()]
    workers = sorted(p for p in below if forkserver and ppid(p) == forkserver[0])
    assert workers, "no decode worker found"
    return workers


def _gone(pids: set[int], why: str) -> None:
    wait_for(lambda: not any(alive(p) for p in pids), 30, f"{why}: orphan processes {[p for p in pids if alive(p)]}")


def _kill_under_load(server: ServiceProcess, rng: random.Random, seed: int, victim, what: str) -> tuple[Load, int]:
    """Start load, wait until some answers are in, SIGKILL `victim()` at a random moment; return the load
    (still running) and the victim's pid."""
    load = Load(server.url, seed=rng.randrange(1 << 20))
    load.wait_answers(3)
    time.sleep(rng.uniform(0.05, 0.6))
    pid = victim()
    os.kill(pid, signal.SIGKILL)
    print(f"chaos seed {seed}: SIGKILL {what} (pid {pid}) after {len(load.answered)} answers")
    return load, pid


@pytest.mark.timeout(480)
def test_sigkill_of_every_process_at_random_moments_under_load(tmp_path):
    seed = int(os.environ.get("QVE_CHAOS_SEED", random.SystemRandom().randrange(1 << 32)))
    print(f"chaos seed {seed} (rerun with QVE_CHAOS_SEED={seed})")
    rng = random.Random(seed)
    store = tmp_path / "store"
    answered: dict[str, bytes] = {}
    why = f"chaos seed {seed}"

    def settle(load: Load) -> None:
        answered.update(load.finish())
        bad = [s for s in load.statuses if s not in (200, 503) and not isinstance(s, str)]
        assert not bad, f"{why}: answers other than 200 / 503 / a dropped connection: {bad}"

    # --api-processes 2: an API process, then the engine (the supervisor exits 1 and its children go).
    server = _server(store, "--api-processes", "2", "--engine-exit-grace-s", "0.5")
    sup = server.proc.pid
    try:
        children = descendants(sup)
        load, api = _kill_under_load(server, rng, seed, lambda: ready_info(server)["api_pid"], "an API process")
        load.wait_answers(3)  # the other API process and the restarted one go on serving
        load2, engine = _kill_under_load(server, rng, seed, lambda: ready_info(server)["engine_pid"], "the engine")
        assert server.proc.wait(30) == 1, why
        settle(load)
        settle(load2)
        _gone(children | descendants(sup), f"{why}, engine killed")
    finally:
        server.stop()

    # Again on the same store; then the supervisor itself (its children get SIGTERM from the kernel).
    server = _server(store, "--api-processes", "2")
    sup = server.proc.pid
    try:
        _check_store(server, store, answered, f"{why}, after the engine's SIGKILL")
        children = descendants(sup)
        load, _ = _kill_under_load(server, rng, seed, lambda: sup, "the supervisor")
        server.proc.wait(10)
        _gone(children, f"{why}, supervisor killed")
        settle(load)
    finally:
        server.stop()

    # One process: a decode worker (replaced; at most one request 503), then the server itself.
    server = _server(store)
    try:
        _check_store(server, store, answered, f"{why}, after the supervisor's SIGKILL")
        load, _ = _kill_under_load(server, rng, seed, lambda: rng.choice(_decode_workers(server.proc.pid)), "a decode worker")
        load.wait_answers(3)  # a new pool serves
        children = descendants(server.proc.pid)
        load2, _ = _kill_under_load(server, rng, seed, lambda: server.proc.pid, "the single-process server")
        server.proc.wait(10)
        _gone(children, f"{why}, server killed")
        settle(load)
        settle(load2)
    finally:
        server.stop()

    server = _server(store)
    try:
        _check_store(server, store, answered, f"{why}, after the server's SIGKILL")
    finally:
        assert server.stop()
    print(f"chaos seed {seed}: 5 SIGKILLs, {len(answered)} keys answered before them, all hits after restarts")
