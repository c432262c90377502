"""Mooncake Store across hosts (issue 21), as real processes: a `mooncake_master`, two encoder hosts and an
LM host, each with its own Mooncake client, each in a network namespace of its own where this machine
lets the tests make one (tests/support/netns.py), else all on loopback with ports of their own:

    master  mooncake_master                                  (the pool's metadata)
    a, b    serve --store mooncake://master --mooncake-local-host <own address>   (64 MiB segment each)
    lm      consume --encoder-url b --store mooncake://master ...   (a client only), and the read-backs

One pool serves the whole module (starting it costs most of the time); the tests that stop something run
last and the pool restarts what they killed when a later test asks for it. The addresses test says which
mode ran (it is skipped on loopback, with the reason namespaces could not be made).
"""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch

from tests.support import imagedata as data
from tests.support.live import ServiceProcess, json_body, metric
from tests.support.lm_reference import MAX_TOKENS, chat_messages, monolithic
from tests.support.mooncake_pool import Master
from tests.support.netns import Host, Hosts
from tests.support.processes import IMAGES, wait_for

pytestmark = pytest.mark.slow  # every test here needs the pool of four real processes

SEGMENT = "64MiB"  # per encoder host: ample for the tiny checkpoint's entries (~20 KB each)
TIMEOUT_S = 1.0  # every Mooncake call's deadline (--mooncake-timeout-s): what a host that does not answer costs
# In a namespace of its own each process may take a fixed port (the namespace is empty); on loopback the
# master's ports are found free (it has no port-0 mode) and the servers bind port 0 and report theirs.


class Pool:
    """The module's hosts and processes: `encoder(name)` (started again if a test killed it), `consumer`."""

    def __init__(self, hosts: Hosts, master: Master, ckpt: Path, tmp: Path):
        self.hosts, self.master, self.ckpt, self.tmp = hosts, master, ckpt, tmp
        self.encoders: dict[str, ServiceProcess] = {}
        self.starts = 0
        self.consumer: ServiceProcess | None = None

    def start_encoder(self, name: str) -> ServiceProcess:
        host = self.hosts[name]
        self.starts += 1
        self.encoders[name] = ServiceProcess(
            ["serve", "--model", str(self.ckpt), "--device", "cpu", "--dtype", "float32", "--store", self.master.url,
             "--mooncake-local-host", host.address, "--mooncake-segment-bytes", SEGMENT, "--host", host.address,
             "--decode-workers", "1", "--max-wait-ms", "5", "--mooncake-timeout-s", str(TIMEOUT_S)],
            self.tmp / f"{name}-{self.starts}.log", wait=False, prefix=host.prefix)
        return self.encoders[name]

    def encoder(self, name: str) -> ServiceProcess:
        server = self.encoders[name]
        if server.proc.poll() is not None:  # killed by an earlier test
            server = self.start_encoder(name)
            server.wait_ready()
        return server

    def segment_mounted(self, *names: str) -> None:
        """Until each named encoder's segment is mounted in the pool: only then does what it puts land in its
        own segment. NOTE: a master that came back knows no segment until each host's client mounts its own
        again (its heartbeat, seconds later); meanwhile a host's puts land in the others' segments. A fresh-
        clone CI run killed host a right after such a return, its entries were in b's segment, and b
        rightly answered them cached."""
        def mounted() -> bool:
            have = set(self.master.segments())
            for name in names:
                m = re.search(r"Successfully created client on port (\d+)", self.encoders[name].log.read_text())
                if m is None or f"{self.hosts[name].address}:{m.group(1)}" not in have:
                    return False
            return True

        wait_for(mounted, 90, f"the segments of {', '.join(names)} mounted in the pool")

    def read_back(self, items: list[dict]) -> dict[str, tuple[list[int], torch.Tensor]]:
        """Each item's entry as an LM host reads it from the pool (a process on `lm` with its own client,
        through the reader API the consumer uses): key -> (grid_thw, [tokens, main | deepstack...])."""
        out = self.tmp / f"read-back-{time.monotonic_ns()}.pt"
        pairs = [v for item in items for v in (item["key"], item["store_key"])]
        lm = self.hosts["lm"]
        done = subprocess.run([*lm.prefix, sys.executable, "-c", _READ_BACK, self.master.url, lm.address, str(out),
                               *pairs], cwd=ServiceProcess.ROOT, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-3000:]
        return torch.load(out)


_READ_BACK = """
import sys, torch
from service.store.reader import open_reader
store, local_host, out, *pairs = sys.argv[1:]
reader = open_reader(store, local_host=local_host)
got = {}
for key, store_key in zip(pairs[::2], pairs[1::2]):
    e = reader.read(key, store_key)
    got[key] = (list(e.grid_thw), torch.cat([e.main, *e.deepstack], dim=1))
reader.close()
torch.save(got, out)
"""


@pytest.fixture(scope="module")
def pool(tmp_path_factory, tiny_checkpoint, mooncake_master_binary):
    tmp = tmp_path_factory.mktemp("multihost")
    with Hosts(["master", "a", "b", "lm"]) as hosts:
        print(f"\nhosts: {hosts.mode}" + (f" ({hosts.why})" if hosts.why else f" on {hosts.subnet} via {hosts.bridge}"))
        master = Master(mooncake_master_binary, hosts["master"], tmp / "master.log")
        p = Pool(hosts, master, tiny_checkpoint, tmp)
        try:
            # All three load their models at once: the consumer needs only b's URL to start.
            a, b = p.start_encoder("a"), p.start_encoder("b")
            b.wait_ready(bound_only=True)
            lm = hosts["lm"]
            p.consumer = ServiceProcess(["consume", "--model", str(tiny_checkpoint), "--encoder-url", b.url,
                                         "--store", master.url, "--mooncake-local-host", lm.address,
                                         "--mooncake-timeout-s", str(TIMEOUT_S),
                                         "--host", lm.address], tmp / "lm.log", wait=False, prefix=lm.prefix)
            for server in (a, b, p.consumer):
                server.wait_ready()
            yield p
        finally:
            # The servers first: each closes its Mooncake client while the master still answers.
            stopped = {name: server.stop() for name, server in [*p.encoders.items(), ("lm", p.consumer)] if server}
            master.stop()
        # A server a test killed is not asked to have stopped gracefully; every other must have.
        killed = {name for name, server in p.encoders.items() if server.proc.returncode == -signal.SIGKILL}
        assert all(ok for name, ok in stopped.items() if name not in killed), stopped


def _post(server: ServiceProcess, *blobs: bytes, uuids=None) -> httpx.Response:
    return httpx.post(server.url + "/encode", json=json_body(*blobs, uuids=uuids), timeout=120)


def _counters(server: ServiceProcess) -> dict[str, float]:
    text = httpx.get(server.url + "/metrics", timeout=30).text
    return {"steps": metric(text, "qve_steps_total", 'result="ok"'),
            "encoded": metric(text, "qve_images_total", 'outcome="encoded"'),
            "cached": metric(text, "qve_images_total", 'outcome="cached"')}


def _grew(before: dict, after: dict) -> dict:
    return {k: after[k] - before[k] for k in before}


def _fresh(seed: int) -> bytes:
    """An image no other test posts (a new key)."""
    return data.encode(data.textured_rgb(64 + seed % 7 * 8, 64, seed=4200 + seed), "PNG")


def test_every_host_advertises_only_its_own_address(pool):
    hosts = pool.hosts
    mooncake_hosts = {"a": pool.encoders["a"].log, "b": pool.encoders["b"].log, "lm": pool.consumer.log}
    for name, log in mooncake_hosts.items():
        # The transfer engine's own line: what it tells its peers to connect to.
        line = next(x for x in log.read_text().splitlines() if "P2P handshake, listening on" in x)
        assert line.rsplit(" ", 1)[1].rsplit(":", 1)[0] == hosts[name].address, (hosts.mode, name, line)
    segments = pool.master.segments()  # the encoders' segments, named by their advertised address
    assert sorted(s.rsplit(":", 1)[0] for s in segments) == sorted([hosts["a"].address, hosts["b"].address]), segments
    if hosts.mode == "loopback":
        pytest.skip(f"hosts on loopback ({hosts.why}): each advertises 127.0.0.1, but Mooncake's data ports listen "
                    "on 0.0.0.0, reachable from outside; the namespace checks did not run")
    for name, host in hosts.hosts.items():
        # Inside a namespace that has only lo and eth0 (its own address), even 0.0.0.0 is that namespace's.
        own = subprocess.run(["ip", "-n", host.netns, "-4", "-o", "addr", "show"], capture_output=True,
                             text=True).stdout
        assert sorted(line.split()[3] for line in own.splitlines()) == sorted(["127.0.0.1/8", f"{host.address}/24"])
        listeners = host.listening()
        assert listeners, f"nothing listens on {name}"
        inside = {host.address, "0.0.0.0", "*", "[::]", "127.0.0.1", "[::1]"}
        assert all(x.address in inside for x in listeners), (name, listeners)
        names = {p for x in listeners for p in x.processes}
        assert names <= {"mooncake_master", "python", "python3", "python3.11"}, (name, names)
    print(f"namespaces {', '.join(h.netns for h in hosts.hosts.values())} on {hosts.subnet}: segments {segments}")


def test_an_image_encoded_on_host_a_is_answered_cached_on_host_b_without_encoding(pool):
    a, b = pool.encoder("a"), pool.encoder("b")
    blob = _fresh(1)
    a0, b0 = _counters(a), _counters(b)
    r = _post(a, blob)
    assert r.status_code == 200, r.text
    (first,) = r.json()["items"]
    assert first["cached"] is False and "path" not in first and first["store_key"].endswith("@id:" + first["key"])
    r = _post(b, blob)
    assert r.status_code == 200, r.text
    (second,) = r.json()["items"]
    assert second == {**first, "cached": True}  # the same entry: key, store key, grid, shape, dtype
    assert _grew(a0, _counters(a)) == {"steps": 1, "encoded": 1, "cached": 0}
    assert _grew(b0, _counters(b)) == {"steps": 0, "encoded": 0, "cached": 1}  # no step ran on b for it


def test_try_names_a_pool_entry_by_its_store_key(pool):
    """`qwen3vl-encoder try` against an encoder on Mooncake: the entry is a key in the pool, not a file."""
    a = pool.encoder("a")
    done = subprocess.run([sys.executable, "-m", "service", "try", "--url", a.url], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    (entry,) = [line for line in done.stdout.splitlines() if line.startswith("  entry ")]
    key = next(line.split()[1] for line in done.stdout.splitlines() if line.startswith("  key "))
    assert f"@id:{key}  (in the Mooncake pool at {pool.master.url})" in entry and "  file " not in done.stdout


def test_a_uuid_bound_on_host_a_is_a_conflict_on_host_b(pool):
    a, b = pool.encoder("a"), pool.encoder("b")
    r = _post(a, _fresh(2), uuids=["multihost-uuid"])
    assert r.status_code == 200 and r.json()["items"][0]["key"] == "multihost-uuid", r.text
    r = _post(b, _fresh(3), uuids=["multihost-uuid"])  # other bytes under the same uuid, on the other host
    assert r.status_code == 409 and r.json()["error"]["code"] == "key_conflict", r.text


@pytest.mark.parametrize("names", [["astronaut.png"], ["chelsea.png", "coffee.png"]], ids=["one image", "two images"])
def test_chat_on_a_third_host_equals_monolithic_generation(pool, tiny_checkpoint, names):
    """The images are encoded on a first, so their entries live in a's segment; the consumer on lm asks b
    (which answers them cached, from the pool) and reads them from a's segment."""
    a, b = pool.encoder("a"), pool.encoder("b")
    pool.segment_mounted("a")
    blobs = [data.photo(n, max_side=400) for n in names]
    r = _post(a, *blobs)
    assert r.status_code == 200 and not any(i["cached"] for i in r.json()["items"]), r.text
    b0 = _counters(b)
    text = "compare the two images" if len(blobs) > 1 else "describe the image"
    r = httpx.post(pool.consumer.url + "/v1/chat/completions", timeout=120,
                   json={"messages": chat_messages(blobs, text), "max_tokens": MAX_TOKENS, "temperature": 0,
                         "return_token_ids": True})
    assert r.status_code == 200, r.text
    prompt_ids, expected = monolithic(tiny_checkpoint, blobs, text)
    got = r.json()["choices"][0]["token_ids"]
    print(f"{len(blobs)} image(s) ({pool.hosts.mode}): {len(prompt_ids)} prompt tokens, generated {got}")
    assert got == expected and len(expected) >= 2
    assert r.json()["usage"]["prompt_tokens"] == len(prompt_ids)
    assert _grew(b0, _counters(b)) == {"steps": 0, "encoded": 0, "cached": len(blobs)}


class HealthWatch:
    """GET /health of some servers every 0.1 s on a thread of its own, each answer timed, until stopped:
    the slowest answer of each (a timeout counts as 5 s) and every status seen."""

    def __init__(self, *servers: ServiceProcess):
        import threading

        self.servers, self.slowest, self.statuses = servers, {s.url: 0.0 for s in servers}, {s.url: set() for s in servers}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with httpx.Client(timeout=5) as client:
            while not self._stop.is_set():
                for server in self.servers:
                    t0 = time.monotonic()
                    try:
                        status = client.get(server.url + "/health").status_code
                    except httpx.HTTPError as e:
                        status = type(e).__name__
                    self.slowest[server.url] = max(self.slowest[server.url], time.monotonic() - t0)
                    self.statuses[server.url].add(status)
                self._stop.wait(0.1)

    def stop(self) -> dict[str, float]:
        self._stop.set()
        self._thread.join(10)
        return {url: round(s, 3) for url, s in self.slowest.items()}


def test_a_stopped_host_costs_its_entries_a_re_encode_within_the_deadline_and_stalls_nothing_else(pool):
    """Host a stopped (SIGSTOP: its sockets open, nothing answers), its entries in its own segment: b's
    lookup of one of them reads from a's segment, and Mooncake would wait a minute for it. It is a miss
    after --mooncake-timeout-s (b encodes the image again, counted), a fresh image posted meanwhile is
    answered at once, and /health of b and of the consumer answers within 1 s throughout."""
    a, b = pool.encoder("a"), pool.encoder("b")
    pool.segment_mounted("a")
    held = [_fresh(30), _fresh(31)]
    r = _post(a, *held)
    assert r.status_code == 200 and not any(i["cached"] for i in r.json()["items"]), r.text
    text0 = httpx.get(b.url + "/metrics", timeout=30).text
    watch = HealthWatch(b, pool.consumer)
    a.proc.send_signal(signal.SIGSTOP)
    try:
        with ThreadPoolExecutor(2) as ex:
            t0 = time.monotonic()
            stuck = ex.submit(_post, b, held[0])  # its lookup reads a's segment
            time.sleep(0.3)
            t1 = time.monotonic()
            fresh = _post(b, _fresh(32))
            fresh_s = time.monotonic() - t1
            r = stuck.result(timeout=60)
            stuck_s = time.monotonic() - t0
        again = _post(b, held[0])  # now in b's own segment
    finally:
        a.proc.send_signal(signal.SIGCONT)
        slowest = watch.stop()
    print(f"a stopped ({pool.hosts.mode}): a's entry on b {stuck_s:.2f} s, a fresh image meanwhile {fresh_s:.2f} s, "
          f"slowest /health {slowest}")
    assert r.status_code == 200 and r.json()["items"][0]["cached"] is False, r.text  # encoded again on b
    assert fresh.status_code == 200 and fresh.json()["items"][0]["cached"] is False, fresh.text
    assert again.status_code == 200 and again.json()["items"][0]["cached"] is True, again.text
    assert stuck_s < TIMEOUT_S + 10 and fresh_s < 5, (stuck_s, fresh_s)
    assert max(slowest.values()) < 1.0 and all(st == {200} for st in watch.statuses.values()), (slowest, watch.statuses)
    grew = metric(httpx.get(b.url + "/metrics", timeout=30).text, "qve_store_timeouts_total", 'call="read"') - \
        metric(text0, "qve_store_timeouts_total", 'call="read"')
    assert grew >= 1, grew


def _refused_while_master_is_gone(server: ServiceProcess, blob: bytes) -> dict:
    t0 = time.monotonic()
    r = _post(server, blob)
    took = time.monotonic() - t0
    ready = httpx.get(server.url + "/ready", timeout=60)
    health = httpx.get(server.url + "/health", timeout=60)
    return {"status": r.status_code, "code": r.json()["error"]["code"] if r.status_code != 200 else None,
            "retry_after": r.headers.get("retry-after"), "took_s": round(took, 2), "ready": ready.status_code,
            "ready_body": ready.json(), "health": health.status_code}


def test_master_stopped_is_503_with_retry_after_then_both_hosts_serve_again(pool):
    """The master killed: once each host's probe has seen it gone (within --mooncake-timeout-s and a probe's
    second), /encode answers 503 store_unavailable at once, never hangs; /health answers 503 within 1 s
    throughout (it never waits on the store); and when the master is back both hosts serve again."""
    a, b = pool.encoder("a"), pool.encoder("b")
    before = _fresh(10)
    r = _post(a, before)
    assert r.status_code == 200 and r.json()["items"][0]["cached"] is False, r.text
    watch = HealthWatch(a, b)
    pool.master.stop()
    try:
        t0 = time.monotonic()
        for server in (a, b):  # each host's own probe notices: its /health says so
            wait_for(lambda s=server: httpx.get(s.url + "/health", timeout=5).status_code == 503, 30,
                     f"{server.url} /health 503")
        noticed_s = time.monotonic() - t0
        with ThreadPoolExecutor(4) as ex:
            answers = list(ex.map(_refused_while_master_is_gone, (a, b, a, b), map(_fresh, (11, 12, 15, 16))))
        time.sleep(1.5)  # a few more /health answers, with the master still gone
    finally:
        slowest = watch.stop()
        pool.master.start()  # at the same address, as a restarted master would be
    print(f"master stopped ({pool.hosts.mode}): noticed in {noticed_s:.2f} s; slowest /health {slowest}; {answers}")
    for got in answers:
        assert got["status"] == 503 and got["code"] == "store_unavailable", got
        assert int(got["retry_after"]) >= 1, got
        assert got["took_s"] < 1.0, got  # at once: no lookup waits on a master known to be gone
        assert got["ready"] == 503 and got["ready_body"]["phase"] == "store", got
        assert "master" in got["ready_body"]["store_error"] and got["health"] == 503, got
    assert noticed_s < TIMEOUT_S + 5, noticed_s
    assert max(slowest.values()) < 1.0 and all(st <= {200, 503} for st in watch.statuses.values()), (slowest, watch.statuses)
    t0 = time.monotonic()
    for server in (a, b):
        wait_for(lambda s=server: httpx.get(s.url + "/ready", timeout=60).status_code == 200, 60, f"{server.url} ready")
    ready_s = time.monotonic() - t0
    # Each host writes again once its client has mounted its segment in the new master (its heartbeat does
    # that); until then a put fails, answered 503 with Retry-After, never anything else.
    blobs, meanwhile = {"a": _fresh(13), "b": _fresh(14)}, []
    for name, server in (("a", a), ("b", b)):
        deadline = time.monotonic() + 60
        while (r := _post(server, blobs[name])).status_code != 200:
            meanwhile.append((name, r.status_code, r.json()["error"]["code"], r.headers.get("retry-after")))
            assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1, r.text
            assert time.monotonic() < deadline, f"{name} did not write again within 60 s: {meanwhile[-3:]}"
            time.sleep(0.2)
        assert r.json()["items"][0]["cached"] is False, r.text
    print(f"after the master's return: /ready 200 in {ready_s:.1f} s, both hosts wrote in "
          f"{time.monotonic() - t0:.1f} s; {len(meanwhile)} answers meanwhile: {sorted(set(x[1:] for x in meanwhile))}")
    # One pool again: both segments mounted, and what each host wrote is a hit on the other.
    pool.segment_mounted("a", "b")
    for server, blob in ((a, blobs["b"]), (b, blobs["a"])):
        r = _post(server, blob)
        assert r.status_code == 200 and r.json()["items"][0]["cached"] is True, r.text
    # The master's metadata went with it (docs/multihost.md): an entry from before is encoded again.
    r = _post(b, before)
    assert r.status_code == 200 and r.json()["items"][0]["cached"] is False, r.text


def test_sigkill_of_host_a_host_b_serves_new_images_and_re_encodes_the_lost_ones(pool, reference):
    a, b = pool.encoder("a"), pool.encoder("b")
    pool.segment_mounted("a")  # so that a's entries are in a's segment, and lost with it
    blobs = data.valid_images()
    lost, new = IMAGES[:4], IMAGES[4:8]
    r = _post(a, *(blobs[n] for n in lost))
    assert r.status_code == 200 and not any(i["cached"] for i in r.json()["items"]), r.text
    r = _post(b, blobs[lost[0]])  # a hit on b while a lives: the entry is in a's segment
    assert r.status_code == 200 and r.json()["items"][0]["cached"] is True, r.text
    a.proc.send_signal(signal.SIGKILL)
    a.proc.wait(10)
    b0 = _counters(b)
    # The lost and the new images at once, one per request: within the master's client TTL (10 s) its
    # existence answers about a's entries are stale, so each lost one is a read that fails.
    t0 = time.monotonic()
    with ThreadPoolExecutor(4) as ex:
        answers = list(ex.map(lambda n: _post(b, blobs[n]), lost + new))
    print(f"after a's SIGKILL ({pool.hosts.mode}): 8 images on b in {time.monotonic() - t0:.1f} s")
    for name, r in zip(lost + new, answers):
        assert r.status_code == 200, (name, r.text)
        assert r.json()["items"][0]["cached"] is False, name  # a's copies are gone: encoded here
    grew = _grew(b0, _counters(b))
    assert grew["encoded"] == 8 and grew["cached"] == 0 and grew["steps"] >= 1, grew
    items = [r.json()["items"][0] for r in answers]
    again = [_post(b, blobs[n]) for n in lost]  # now in b's segment
    assert all(r.status_code == 200 and r.json()["items"][0]["cached"] is True for r in again)
    # What an LM host reads back is each image's own embedding, whole: transformers' float32 tower's.
    got = pool.read_back(items)
    for name, item in zip(lost + new, items):
        grid, ref = reference[name]
        stored_grid, ec = got[item["key"]]
        assert stored_grid == grid == item["grid_thw"] and list(ec.shape) == item["shape"], name
        diff = (ec - ref).abs().max().item()
        assert diff <= 1e-5, f"{name}: max abs diff {diff}"


def test_a_host_started_again_after_sigkill_rejoins_the_pool(pool):
    """a (killed by the test above, or here when run alone) starts again with a new client and segment:
    entries written on either host are hits on the other again."""
    if pool.encoders["a"].proc.poll() is None:
        pool.encoders["a"].proc.send_signal(signal.SIGKILL)
        pool.encoders["a"].proc.wait(10)
    b = pool.encoder("b")
    on_b, on_a = _fresh(20), _fresh(21)
    r = _post(b, on_b)
    assert r.status_code == 200 and r.json()["items"][0]["cached"] is False, r.text
    a = pool.encoder("a")  # started again
    assert pool.encoders["a"].proc.poll() is None
    r = _post(a, on_b)
    assert r.status_code == 200 and r.json()["items"][0]["cached"] is True, r.text
    r = _post(a, on_a)
    assert r.status_code == 200 and r.json()["items"][0]["cached"] is False, r.text
    r = _post(b, on_a)  # read from a's new segment
    assert r.status_code == 200 and r.json()["items"][0]["cached"] is True, r.text
    assert any(s.startswith(pool.hosts["a"].address + ":") for s in pool.master.segments())
