"""Mooncake Store as the embedding store (service/store/mooncake.py), against a real mooncake_master on
loopback: the value is vLLM 0.33's layout, read back with Mooncake's own client and parsed as vLLM
parses it, bit for bit the directory backend's tensor; a lookup needs the whole entry of this model;
a stopped master is a clear 503 and the store serves again when it returns."""

from __future__ import annotations

import dataclasses
import json
import shutil
import struct
import time

import pytest
import torch

from service.store.options import MOONCAKE_BUFFER_BYTES, MOONCAKE_TIMEOUT_S, MooncakeOptions, parse_mooncake
from service.errors import Unavailable
from service.store.directory import DirectoryStore
from service.store.format import StoreFormatError, read_embeddings
from service.store.mooncake import MooncakeStore, meta_key, value_key
from service.store.pool import anonymous_mappings, connect
from service.store.reader import open_reader
from tests.support.mooncake_pool import LOOPBACK, Master, SegmentHost
from tests.support.netns import proc_listeners
from tests.support.errors import raises_code

OUT_HIDDEN, LEVELS = 8, 3
WIDTH = OUT_HIDDEN * (1 + LEVELS)


@pytest.fixture(scope="module")
def master(tmp_path_factory, mooncake_master_binary):
    # A lease of 30 s: entries here are read long after they were written.
    m = Master(mooncake_master_binary, LOOPBACK, tmp_path_factory.mktemp("mooncake") / "master.log", lease_ttl_ms=30_000)
    try:
        yield m
    finally:
        m.stop()


def _options(master: Master, segment: int = 64 << 20, namespace: str | None = None,
             timeout_s: float = MOONCAKE_TIMEOUT_S) -> MooncakeOptions:
    return MooncakeOptions(master=parse_mooncake(master.url), local_host="127.0.0.1", segment_bytes=segment,
                           buffer_bytes=MOONCAKE_BUFFER_BYTES, protocol="tcp", namespace=namespace, timeout_s=timeout_s)


def _store(master: Master, model: str = "m", dtype: str = "bfloat16", **kw) -> MooncakeStore:
    return MooncakeStore(master.url, _options(master, **kw), model_id=model, out_hidden_size=OUT_HIDDEN,
                         deepstack_levels=LEVELS, dtype=dtype, min_residency_s=30.0, salt=f"{model}|params|{dtype}")


def _vllm_parse(value: bytes, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM 0.33's reading of a Mooncake embedding value, written out: its header, its dtype code, its
    shape, then Qwen3-VL's split of [H | H*L] into the main embeddings and the deepstack taps."""
    magic, code, n, width = struct.unpack_from("<IIQQ", value)
    assert magic == 0x4D4F4F4E
    dtype = {0: torch.float32, 11: torch.float16, 12: torch.bfloat16}[code]
    tensor = torch.frombuffer(bytearray(value[24:]), dtype=dtype).view(n, width)
    main, deep = tensor.split([hidden, width - hidden], dim=-1)
    return main, deep.reshape(n, width // hidden - 1, hidden)  # (T, L, H), taps in layer order


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_value_is_vllms_layout_and_equals_the_directory_entry_bit_for_bit(master, tmp_path, dtype):
    torch.manual_seed(0)
    ec = torch.randn(37, WIDTH).to(getattr(torch, dtype))  # a 1x74x2 grid's tokens... any shape will do
    pooled = _store(master, model=f"layout-{dtype}", dtype=dtype)
    directory = DirectoryStore(tmp_path / "dir", 1 << 30, f"layout-{dtype}", out_hidden_size=OUT_HIDDEN,
                               deepstack_levels=LEVELS, dtype=dtype)
    item = pooled.put("img-1", ec, (1, 2, 74), content_sha256="ab" * 32)
    directory.put("img-1", ec, (1, 2, 74), content_sha256="ab" * 32)
    assert item.path is None and item.store_key == value_key(pooled.namespace, "img-1")
    assert item.store_key.startswith("embedding@model:layout-") and "@protocol:v3@id:img-1" in item.store_key

    other = connect(_options(master, segment=0))  # Mooncake's own client, another one than the writer's
    value = bytes(other.get(item.store_key))
    assert len(value) == 24 + ec.numel() * ec.element_size()
    assert struct.unpack_from("<IIQQ", value) == (0x4D4F4F4E, {"bfloat16": 12, "float32": 0}[dtype], 37, WIDTH)
    main, deep = _vllm_parse(value, OUT_HIDDEN)
    file = read_embeddings(tmp_path / "dir", "img-1")
    expected = torch.cat([file.main, *file.deepstack], dim=1)
    # Bit for bit: the same bytes as the directory's safetensors tensor.
    assert bytes(value[24:]) == expected.contiguous().view(torch.uint8).numpy().tobytes()
    assert torch.equal(main, file.main) and all(torch.equal(deep[:, i], file.deepstack[i]) for i in range(LEVELS))
    meta = json.loads(bytes(other.get(meta_key(pooled.namespace, "img-1"))))
    assert meta["grid_thw"] == [1, 2, 74] and meta["content_sha256"] == "ab" * 32 and meta["model"] == f"layout-{dtype}"
    # And this project's reader, by the answer's store_key alone, gives the directory reader's embeddings.
    reader = open_reader(master.url)
    read = reader.read("img-1", item.store_key)
    assert read.grid_thw == (1, 2, 74) and torch.equal(read.main, file.main)
    assert all(torch.equal(a, b) for a, b in zip(read.deepstack, file.deepstack))
    # The raw rows, for a process without torch (SGLang's pushes), are the same bytes; another answer's are not.
    assert bytes(reader.read_data(item)) == bytes(value[24:])
    with pytest.raises(StoreFormatError, match="not the entry answered"):
        reader.read_data(dataclasses.replace(item, shape=(36, WIDTH)))
    with pytest.raises(KeyError):
        reader.read_data(dataclasses.replace(item, key="absent", store_key=value_key(pooled.namespace, "absent")))
    other.close()


def test_a_lookup_finds_only_a_whole_entry_of_this_model(master):
    writer = _store(master, model="m1", namespace="embedding@model:shared@protocol:v3")
    ec = torch.randn(4, WIDTH).to(torch.bfloat16)
    writer.put("k", ec, (1, 4, 4), content_sha256="cd" * 32)
    found = writer.lookup("k")
    assert found is not None and found.content_sha256 == "cd" * 32 and found.shape == (4, WIDTH)
    assert found.store_key == "embedding@model:shared@protocol:v3@id:k"
    # Another model writing under the same namespace sees no hit (its embeddings would be another's).
    assert _store(master, model="m2", namespace="embedding@model:shared@protocol:v3").lookup("k") is None
    assert writer.lookup("never-written") is None
    # A value whose companion is gone (a lost half) is no hit either.
    writer.client.remove(meta_key(writer.namespace, "k"), True)
    assert writer.lookup("k") is None
    # A re-put replaces it whole (an upsert: a put onto an existing key would keep the old value); the writer's
    # lone-image commit (a reservation asked to be mapped, which means nothing here) answers once it is stored.
    answered = []
    pending = writer.reserve("k", (4, WIDTH), torch.bfloat16, (1, 4, 4), content_sha256="ef" * 32, lone=True)
    item = writer.commit(pending, ec * 2, answer=lambda stored: answered.append((stored, writer.lookup("k"))))
    again = writer.lookup("k")
    assert again is not None and again.content_sha256 == "ef" * 32 and answered == [(item, again)]
    assert torch.equal(open_reader(master.url, namespace=writer.namespace).read("k").main, (ec * 2)[:, :OUT_HIDDEN])


def _until_health(store, down: bool, within_s: float = 30) -> float:
    """Seconds until the store's health says the master is down (or up again); each answer within 1 s."""
    t0 = time.monotonic()
    while True:
        why, took = _timed(store.health)
        assert took < 1.0, f"health() took {took:.2f} s"
        if (why is not None) == down:
            return time.monotonic() - t0
        assert time.monotonic() - t0 < within_s, why
        time.sleep(0.05)


def test_a_stopped_master_is_a_503_that_says_so_and_the_store_serves_again_when_it_returns(master):
    store = _store(master, model="m-outage", timeout_s=1.0)
    ec = torch.randn(2, WIDTH).to(torch.bfloat16)
    store.put("before", ec, (1, 2, 4))
    assert store.unwritable is None
    master.stop()
    try:
        noticed = _until_health(store, down=True)  # the store's own probe notices; health() never waits on it
        assert "does not answer" in store.unwritable and master.url.removeprefix("mooncake://") in store.unwritable
        with raises_code(Unavailable, "store_unavailable") as e:
            store.lookup("before")  # neither hit nor miss: a miss would be encoded for nothing
        assert e.value.retry_after_s == 1 and e.value.code == "store_unavailable"
        with raises_code(Unavailable, "store_unavailable", match="does not answer"):
            store.put("during", ec, (1, 2, 4))
        _, refused_s = _timed(lambda: store.find("before").exception(timeout=5))
        assert refused_s < 0.5, f"a lookup while the master is known down took {refused_s:.2f} s"
        print(f"master stopped: noticed in {noticed:.2f} s, a lookup then refused in {refused_s * 1e3:.1f} ms")
    finally:
        master.start()
    _until_health(store, down=False)  # the master answers again
    while True:  # and the hosts' segments register with it again (a moment): until then a put is a 503
        try:
            item = store.put("after", ec, (1, 2, 4))
            break
        except Unavailable as e:  # (not store_full: a pool without segments yet is not a full one)
            assert e.code == "store_unavailable" and time.monotonic() < deadline, e
            time.sleep(0.5)
    assert store.lookup("after") == item
    assert store.lookup("before") is None  # the old master's metadata went with it: a miss, encoded again


@pytest.mark.parametrize("reader", ["ss", "proc"])
def test_the_master_listens_on_loopback_only(master, reader):
    # (read by `ss`, and from /proc as on a machine without iproute2: the two must agree)
    if reader == "ss" and shutil.which("ss") is None:
        pytest.skip("no `ss` on this machine (iproute2): the /proc reading checks it")
    listening = LOOPBACK.listening() if reader == "ss" else proc_listeners()
    mine = [s for s in listening if "mooncake_master" in s.processes]
    assert mine and all(s.address == "127.0.0.1" for s in mine), mine
    assert master.port in {s.port for s in mine}


def test_a_step_goes_in_two_calls_replacing_old_values_and_an_entry_the_pool_refuses_fails_alone(master):
    writer = _store(master, model="m-step", segment=32 << 20)
    torch.manual_seed(3)
    writer.put("s1", torch.randn(5, WIDTH).to(torch.bfloat16), (1, 2, 10), content_sha256="99" * 32)  # replaced below
    reader = open_reader(master.url, namespace=writer.namespace)
    calls: list[str] = []
    client = writer.client

    class Spy:  # Mooncake's client, each call's name recorded
        def __getattr__(self, name):
            return lambda *a, **k: calls.append(name) or getattr(client, name)(*a, **k)

    def step(entries):
        pendings = [writer.reserve(k, tuple(t.shape), t.dtype, (1, 2, 2 * t.shape[0]), content_sha256=f"{i:02d}" * 32)
                    for i, (k, t) in enumerate(entries)]
        calls.clear()
        writer.client = Spy()
        try:
            return writer.commit_many(pendings, [t for _, t in entries])
        finally:
            writer.client = client

    fresh = [("s1", torch.randn(5, WIDTH).to(torch.bfloat16)), ("s2", torch.randn(7, WIDTH).to(torch.bfloat16))]
    out = step(fresh)
    assert calls == ["batch_remove", "batch_put_from_multi_buffers"]  # the whole step, values and companions
    assert [o.key for o in out] == ["s1", "s2"]
    for (key, t), item in zip(fresh, out):
        assert torch.equal(reader.read(key, item.store_key).main, t[:, :OUT_HIDDEN])  # the new value, not the old
    assert writer.lookup("s1").content_sha256 == "00" * 32
    # What the engine host checks at a submit instead of a second round trip: this client's own puts.
    assert writer.written_lately("s2") == out[1] and writer.written_lately("never") is None

    huge = torch.zeros((96 << 20) // (WIDTH * 2), WIDTH, dtype=torch.bfloat16)  # more than any segment holds
    mixed = [("s3", torch.randn(3, WIDTH).to(torch.bfloat16)), ("big", huge), ("s4", torch.randn(9, WIDTH).to(torch.bfloat16))]
    out = step(mixed)
    assert [getattr(o, "code", type(o).__name__) for o in out] == ["StoredItem", "store_full", "StoredItem"], out
    # (Not read back: the master answers a failed allocation by evicting, from anyone's entries.)
    assert writer.lookup("big") is None and client.is_exist(meta_key(writer.namespace, "big")) == 0
    assert writer.written_lately("big") is None and writer.written_lately("s4") == out[2]


def test_a_video_entry_keeps_its_sampling_and_timestamps_in_the_companion(master):
    from service.store.format import VideoMeta

    writer = _store(master, model="mv")
    video = VideoMeta(frames_indices=(0, 10, 20), fps=24.0, timestamps=(0.2, 0.8))
    item = writer.put("vid", torch.randn(4, WIDTH).to(torch.bfloat16), (2, 2, 4), content_sha256="ab" * 32, video=video)
    assert item.video == video and item.modality == "video"
    found = writer.lookup("vid")
    assert found is not None and found.video == video
    meta = json.loads(bytes(writer.client.get(meta_key(writer.namespace, "vid"))))
    assert meta["modality"] == "video" and meta["frames_indices"] == [0, 10, 20] and meta["timestamps"] == [0.2, 0.8]
    read = open_reader(master.url, namespace=writer.namespace).read("vid", item.store_key)
    assert read.modality == "video" and read.video == video and read.grid_thw == (2, 2, 4)


def _resident(ranges: set[tuple[int, int]]) -> int:
    """Bytes resident of the mappings `ranges` (/proc/self/smaps' Rss of each)."""
    total, inside = 0, False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and ":" not in head:  # a mapping's first line: start-end perms ...
            start, end = (int(x, 16) for x in head.split("-"))
            inside = (start, end) in ranges
        elif inside and head == "Rss:":
            total += int(line.split()[1]) * 1024
    return total


def test_the_segment_is_faulted_in_at_start_so_the_first_puts_pay_no_page_faults(master):
    """A put into this host's own segment is a memcpy in Mooncake's one memcpy thread, and each
    page of a segment never written cost it a page fault and the kernel's zeroing: on the H200 that thread
    held Mooncake at 1 image per request to 0.62 of the directory's img/s, and here a fresh segment took
    puts at 272 MB/s against 9-12 GB/s once written (a probe, now in git history). connect faults the
    segment in: the mappings its setup made are resident from the start, and the first puts into them
    fault no pages."""
    import gc
    import resource

    segment = 128 << 20
    rows = [torch.randn(65536, WIDTH).to(torch.bfloat16) for _ in range(8)]  # 4 MiB each, 32 MiB in all
    gc.collect()
    before = anonymous_mappings()
    store = _store(master, segment=segment)
    try:
        new = anonymous_mappings() - before
        assert _resident(new) >= segment, f"{_resident(new)} bytes of the new mappings resident after connect"
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        keys = [f"fault-{i}" for i in range(len(rows))]
        out = store.commit_many([store.reserve(k, (65536, WIDTH), torch.bfloat16, (1, 512, 512)) for k in keys], rows)
        assert not any(isinstance(o, Exception) for o in out), out
        faulted = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
        # 32 MiB into untouched 4 KiB pages would be 8,192 faults
        assert faulted < 1000, f"{faulted} page faults for 32 MiB of puts into a segment faulted in at start"
    finally:
        store.close()


def test_the_store_protocol_finds_off_the_callers_thread_reads_evicts_and_commits_a_step(master):
    """What the engine uses of a store (service/store/base.py), on Mooncake: `find` is a round trip, answered
    on the lookups' thread; `known` is this engine's own recent writes; a step's entries answered by index."""
    import threading

    writer = _store(master, model="m-protocol")
    ec = torch.randn(3, WIDTH).to(torch.bfloat16)
    item = writer.put("p", ec, (1, 2, 6), content_sha256="12" * 32)
    threads = []
    found = writer.find("p")
    found.add_done_callback(lambda f: threads.append(threading.current_thread().name))
    assert found.result(timeout=10) == writer.lookup("p") and found.result().content_sha256 == "12" * 32
    assert writer.find("never").result(timeout=10) is None
    assert threads and threads[0] in ("store-lookups", threading.current_thread().name)
    assert writer.known("p") == item and writer.known("never") is None
    got = writer.read("p")
    assert torch.equal(torch.cat([got.main, *got.deepstack], 1), ec) and got.grid_thw == (1, 2, 6)
    assert writer.evict("p") is True and writer.find("p").result(timeout=10) is None and writer.known("p") is None
    with pytest.raises(KeyError):
        writer.read("p")
    rows = [torch.randn(2, WIDTH).to(torch.bfloat16), torch.randn(4, WIDTH).to(torch.bfloat16)]
    pendings = [writer.reserve(k, tuple(t.shape), t.dtype, (1, 2, 2 * t.shape[0])) for k, t in zip("xy", rows)]
    answers: dict[int, object] = {}
    writer.commit_step(pendings, rows, lambda i, result: answers.__setitem__(i, result))
    assert [answers[i].key for i in (0, 1)] == ["x", "y"]
    stats = writer.stats()
    assert stats.entries == 3 and stats.bytes_used > 0 and stats.evictions == 0 and writer.health() is None
    assert writer.location == master.url
    writer.close()


def _timed(fn, *args):
    t0 = time.monotonic()
    out = fn(*args)
    return out, time.monotonic() - t0


def test_a_stopped_host_costs_its_entries_a_miss_within_the_deadline_and_holds_up_no_other_lookup(master, tmp_path):
    """A host of the pool stopped (SIGSTOP: its sockets open, nothing answers): a read from its segment waits
    for Mooncake's transfer timeout (30-60 s). A lookup of its entry is a miss within --mooncake-timeout-s
    (counted), fresh lookups meanwhile are answered at once, the store's health at once, and the entry
    encoded again here is a hit."""
    namespace = "embedding@model:stopped@protocol:v3"
    sha = "5a" * 32
    host = SegmentHost(master.url, tmp_path / "host.log", namespace=namespace, model="m-stopped", out_hidden=OUT_HIDDEN,
                       levels=LEVELS, dtype="bfloat16", entries=[[f"held-{i}", 3 + i, sha] for i in range(3)])
    store = _store(master, model="m-stopped", namespace=namespace, timeout_s=1.0)
    try:
        assert store.lookup("held-0") is not None  # read from the other host's segment while it runs
        host.stop()
        stuck = store.find("held-1")  # a read from the stopped host's segment
        time.sleep(0.2)  # (so that the lookups below come after it)
        fresh = [store.find(f"fresh-{i}") for i in range(4)]
        t0 = time.monotonic()
        for f in fresh:
            assert f.result(timeout=3) is None
        fresh_s = time.monotonic() - t0
        health, health_s = _timed(store.health)
        assert stuck.result(timeout=3) is None  # a miss: the image is encoded again
        stuck_s = time.monotonic() - t0 + 0.2
        print(f"stopped host: fresh lookups {fresh_s:.2f} s, its entry's {stuck_s:.2f} s, health {health_s:.3f} s")
        assert fresh_s < 0.5 and 0.5 < stuck_s < 2.5 and health is None and health_s < 1.0
        assert store.timeouts()["read"] >= 1
        ec = torch.randn(4, WIDTH).to(torch.bfloat16)
        store.put("held-1", ec, (1, 2, 8), content_sha256=sha)  # encoded again, into this host's segment
        again, again_s = _timed(store.lookup, "held-1")
        assert again is not None and again.content_sha256 == sha and again_s < 1.0
    finally:
        host.kill()
        store.close()


def _raw_value(code: int, rows: int, width: int, data: bytes) -> bytes:
    return struct.pack("<IIQQ", 0x4D4F4F4E, code, rows, width) + data


@pytest.mark.parametrize("bad", ["rows", "width", "dtype", "truncated", "longer", "magic"])
def test_a_value_that_contradicts_its_companion_is_a_miss_and_the_next_put_replaces_it(master, bad):
    """Another writer's value under a key whose companion says otherwise (Mooncake has no authentication,
    and a vLLM deployment shares the namespace): every hit is checked, header and size, against its
    companion, so it is a miss (encoded again, and overwritten), not `cached: true` for an entry that every
    consumer would refuse."""
    store = _store(master, model=f"m-contra-{bad}")
    sha = "c0" * 32
    ec = torch.randn(4, WIDTH).to(torch.bfloat16)
    item = store.put("contra", ec, (1, 4, 4), content_sha256=sha)
    assert store.lookup("contra") == item
    data = ec.view(torch.uint8).numpy().tobytes()
    row = WIDTH * 2
    # (into this store's own segment: a put may otherwise land in a segment of an earlier test's host, killed)
    value = {"rows": _raw_value(12, 5, WIDTH, data + data[:row]),  # 5 rows where the companion says 4
             "width": _raw_value(12, 4, 7, data[: 4 * 7 * 2]),  # width 7
             "dtype": _raw_value(11, 4, WIDTH, data),  # float16 in a bfloat16 store
             "truncated": _raw_value(12, 4, WIDTH, data[:-row]),  # the header's rows, a row of bytes short
             "longer": _raw_value(12, 4, WIDTH, data + b"\0" * row),
             "magic": struct.pack("<IIQQ", 0xDEADBEEF, 12, 4, WIDTH) + data}[bad]
    assert store.client.remove(item.store_key, True) == 0 and store.client.put(item.store_key, value, store._config) == 0
    assert store.lookup("contra") is None
    with pytest.raises(Exception):  # the consumer's reader refuses it too (StoreFormatError)
        open_reader(master.url).read("contra", item.store_key)
    again = store.put("contra", ec, (1, 4, 4), content_sha256=sha)  # the miss is encoded again: it replaces it
    assert store.lookup("contra") == again
    assert torch.equal(open_reader(master.url).read("contra", again.store_key).main, ec[:, :OUT_HIDDEN])


def test_a_malformed_companion_is_a_miss_for_its_own_key_only(master):
    """Companions are read back and parsed per key; one that does not parse (not an object, a field of the
    wrong type: grid_thw "abc") is a miss for its key, and every lookup batched with it is answered as usual."""
    store = _store(master, model="m-malformed")
    sha = "d1" * 32
    ec = torch.randn(4, WIDTH).to(torch.bfloat16)
    innocent = [f"innocent-{i}" for i in range(12)]
    for key in [*innocent, "list", "grid", "tokens", "video"]:
        store.put(key, ec, (1, 4, 4), content_sha256=sha)
    good = json.loads(bytes(store.client.get(meta_key(store.namespace, "grid"))))
    bad = {"list": [good], "grid": {**good, "grid_thw": "abc"}, "tokens": {**good, "num_tokens": "4"},
           "video": {**good, "modality": "video", "frames_indices": None}}
    for key, meta in bad.items():
        mkey = meta_key(store.namespace, key)
        assert store.client.remove(mkey, True) == 0 and store.client.put(mkey, json.dumps(meta).encode(), store._config) == 0
    assert [store.lookup(key) for key in bad] == [None] * len(bad)
    batch = store.lookup_many([*innocent[:6], *bad, *innocent[6:]])
    assert [b is not None for b in batch] == [True] * 6 + [False] * len(bad) + [True] * 6
    assert all(b.grid_thw == (1, 4, 4) and b.content_sha256 == sha for b in batch if b is not None)
    # Through the engine's path too: lookups queued together share a batch.
    futures = [store.find(key) for key in [*bad, *innocent]]
    assert [f.result(timeout=10) is not None for f in futures] == [False] * len(bad) + [True] * len(innocent)


def test_reading_a_pool_entry_by_key_alone_says_to_pass_its_store_key_or_namespace(master):
    """read_embeddings("mooncake://...", key) needs the entry's namespace: a ValueError that says how to give
    it, not an assertion."""
    from service.store.reader import read_embeddings as read_any

    store = _store(master, model="m-by-key")
    item = store.put("by-key", torch.randn(2, WIDTH).to(torch.bfloat16), (1, 2, 4))
    with pytest.raises(ValueError, match=r"pass store_key= \(the /encode item's store_key\) or namespace="):
        read_any(master.url, "by-key")
    assert read_any(master.url, "by-key", store_key=item.store_key).grid_thw == (1, 2, 4)
    assert read_any(master.url, "by-key", namespace=store.namespace).grid_thw == (1, 2, 4)
    store.close()
