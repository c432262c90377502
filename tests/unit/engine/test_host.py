"""The engine host's answers (service/engine/host.py), driven with typed messages and plain stand-ins for
the store: admission before decode by images and by the tokens each image's header declares, places
given back on cancel and on disconnect, a submit whose key was stored meanwhile, conflicts; with a
store whose lookups are round trips (Mooncake's shape: store/lookups.py's Lookups), lookups off the host's
thread, batched, one per image (a submit asks what this engine wrote itself), and what a cancel, a lost
connection or an unreachable master does to a claim waiting for one."""

import queue
import time
import threading

import numpy as np
import pytest

from service.engine.batcher import BatchLimits, Batcher
from service.engine.host import EngineHost
from service.engine.messages import Cancel, Claim, Failed, Geometry, Grant, Hit, Queued, Submit
from service.errors import Unavailable
from service.media.preprocess import grid_for, num_tokens
from service.metrics import Metrics
from service.media.params import PreprocessParams
from service.store.base import answered
from service.store.format import StoredItem
from service.store.lookups import Lookups


class _DictStore:
    """A store answered at once (a directory's shape)."""

    location = "memory"

    def __init__(self):
        self.items: dict[str, StoredItem] = {}

    def find(self, key):
        return answered(self.items.get(key))

    def known(self, key):
        return self.items.get(key)

    def health(self):
        return None


class _RemoteStore(_DictStore):
    """A store whose lookups are round trips, batched as MooncakeStore's are (Lookups): each `lookup_many`
    call is recorded, and waits for `go`."""

    def __init__(self):
        super().__init__()
        self.calls: list[list[str]] = []
        self.go = threading.Event()
        self.entered = threading.Semaphore(0)
        self.down = False
        self.written: dict[str, StoredItem] = {}  # what this engine's client put lately
        self.lookups = Lookups(self.lookup_many, threads=1)  # (one thread: which lookups share a batch is certain)

    def find(self, key):
        return self.lookups.lookup(key)

    def known(self, key):
        return self.written.get(key)

    def lookup_many(self, keys):
        self.calls.append(list(keys))
        self.entered.release()
        assert self.go.wait(10)
        if self.down:
            raise Unavailable("the Mooncake master at m:1 does not answer (error -1); retry shortly", code="store_unavailable")
        return [self.items.get(k) for k in keys]


class _Engine:
    """What the host reads of an Engine before it starts: its store, batcher and start-up phases."""

    def __init__(self, store, batcher):
        self.store, self.batcher = store, batcher
        self.runner = type("Runner", (), {"startup": {}})()


class _Model:
    params = PreprocessParams(min_pixels=32 * 32, max_pixels=64 * 64)
    load_s = 0.0


def _host(max_queue_images: int, max_queue_tokens: int, store=None) -> tuple[EngineHost, list, object]:
    batcher = Batcher(BatchLimits(max_batch_tokens=100, max_batch_images=8, max_wait_s=0.01,
                                  max_queue_images=max_queue_images, max_queue_tokens=max_queue_tokens))
    host = EngineHost(_Engine(store or _DictStore(), batcher), _Model(), Metrics())
    sent: list = []
    conn = host.connect(sent.append, lambda fn: fn())
    return host, sent, conn


def test_claims_admit_by_images_and_header_tokens_and_give_places_back():
    host, sent, conn = _host(max_queue_images=3, max_queue_tokens=500)
    sha = "0" * 64

    def claim(rid: int, key: str, tokens: int):
        host.handle(conn, Claim(rid, key, sha, tokens))
        return sent[-1]

    assert claim(1, "a", 400) == Grant(1)
    refused = claim(2, "b", 200)  # 400 + 200 tokens > 500, before anything is decoded
    assert isinstance(refused, Failed) and refused.id == 2 and refused.code == "overloaded"
    assert "limit 500 tokens" in refused.message and refused.retry_after_s >= 1
    assert claim(3, "c", 50) == Grant(3) and claim(4, "d", 20) == Grant(4)
    assert claim(5, "e", 1).code == "overloaded"  # 3 images being decoded: full by count
    assert host.batcher.reserved() == 3
    host.handle(conn, Cancel(1))  # the API side gave up on image a (its decode failed, say)
    assert host.batcher.reserved() == 2 and claim(6, "b", 200) == Grant(6)
    host.disconnect(conn)  # the API process died: its places go back
    assert host.batcher.reserved() == 0


def _geometry(h: int, w: int) -> Geometry:
    grid = grid_for(h, w, _Model.params)
    return Geometry(height=h, width=w, grid_thw=grid, tokens=num_tokens(grid, _Model.params))


def test_a_submit_whose_key_was_stored_since_its_claim_is_answered_from_the_store():
    # Two requests with one image: both claims miss (nothing stored, nothing queued yet), so both API
    # processes decode it; the first is encoded and stored before the second submits. The second must
    # get the stored entry, not a second encode (seen as one image encoded twice under load).
    store = _DictStore()
    host, sent, conn = _host(max_queue_images=4, max_queue_tokens=500, store=store)
    sha = "ab" * 32
    host.handle(conn, Claim(1, "k", sha, 4))
    host.handle(conn, Claim(2, "k", sha, 4))
    assert sent == [Grant(1), Grant(2)] and host.batcher.reserved() == 2
    item = StoredItem(key="k", path="k/encoder_cache.safetensors", num_tokens=4, grid_thw=(1, 4, 4), shape=(4, 48),
                      dtype="float32", nbytes=1000, content_sha256=sha)
    store.items["k"] = item  # the first request's image, encoded and stored
    sent.clear()
    released = []
    pixels = np.zeros(64 * 64 * 3, np.uint8)
    host.handle(conn, Submit(3, 2, "k", sha, _geometry(64, 64)), pixels, release=lambda: released.append(3))
    assert sent == [Hit(3, item)] and released == [3]  # answered from the store, the pixels given back at once
    assert host.batcher.reserved() == 1 and host.batcher.queue_depth() == 0  # its place given back, nothing queued
    assert host.metrics.cache_hits._value.get() == 1
    # Other bytes under that key: a conflict, and the pixels and the place still go back.
    sent.clear()
    host.handle(conn, Submit(4, 1, "k", "cd" * 32, _geometry(64, 64)), pixels, release=lambda: released.append(4))
    assert released == [3, 4] and isinstance(sent[0], Failed) and sent[0].code == "key_conflict"
    assert host.batcher.reserved() == 0


def test_a_submit_with_geometry_its_pixels_or_the_model_contradict_is_refused_and_gives_everything_back():
    host, sent, conn = _host(max_queue_images=4, max_queue_tokens=500)
    sha = "ef" * 32
    good = _geometry(64, 64)
    bad = [
        (good, np.zeros(64 * 64 * 3 - 3, np.uint8)),  # fewer bytes than 64x64 RGB
        (Geometry(64, 64, (1, 2, 2), 1), np.zeros(64 * 64 * 3, np.uint8)),  # a grid this size does not give
        (Geometry(64, 64, good.grid_thw, good.tokens + 1), np.zeros(64 * 64 * 3, np.uint8)),  # token count off
        (Geometry(48, 64, (1, 3, 4), 3), np.zeros(48 * 64 * 3, np.uint8)),  # not a multiple of patch * merge
    ]
    for rid, (geometry, pixels) in enumerate(bad, start=10):
        host.handle(conn, Claim(rid, f"k{rid}", sha, 4))
        released = []
        host.handle(conn, Submit(rid + 100, rid, f"k{rid}", sha, geometry), pixels, release=lambda: released.append(1))
        assert isinstance(sent[-1], Failed) and sent[-1].code == "backend_error", sent[-1]
        assert "inconsistent geometry" in sent[-1].message and released == [1]
    assert host.batcher.reserved() == 0 and host.batcher.queue_depth() == 0


@pytest.fixture
def remote():
    """(store, host, sent, conn, settle): a host on a _RemoteStore whose posted answers wait in a queue
    until `settle(n)` runs n of them here; closed after the test."""
    store = _RemoteStore()
    batcher = Batcher(BatchLimits(max_batch_tokens=100, max_batch_images=8, max_wait_s=0.01,
                                  max_queue_images=8, max_queue_tokens=500))
    host = EngineHost(_Engine(store, batcher), _Model(), Metrics())
    posted: queue.SimpleQueue = queue.SimpleQueue()
    sent: list = []
    conn = host.connect(sent.append, posted.put)

    def settle(n: int) -> None:
        for _ in range(n):
            posted.get(timeout=10)()

    yield store, host, sent, conn, settle
    store.go.set()  # (a lookup a test left waiting returns, so the lookups' thread can stop)
    host.batcher.close()
    store.lookups.close()


def test_a_remote_stores_lookups_run_off_the_hosts_thread_in_batches(remote):
    store, host, sent, conn, settle = remote
    sha = "ab" * 32
    host.handle(conn, Claim(1, "a", sha, 4))  # returns at once: its lookup is out
    assert store.entered.acquire(timeout=10) and sent == [] and conn.pending == {1}
    for rid, key in [(2, "b"), (3, "c"), (4, "d")]:  # meanwhile: queued for the next batch
        host.handle(conn, Claim(rid, key, sha, 4))
    store.items["c"] = StoredItem(key="c", path=None, store_key="ns@id:c", num_tokens=4, grid_thw=(1, 4, 4),
                                  shape=(4, 48), dtype="bfloat16", nbytes=408, content_sha256=sha)
    store.go.set()
    settle(4)
    assert store.calls == [["a"], ["b", "c", "d"]]  # two round trips for four lookups
    assert sent == [Grant(1), Grant(2), Hit(3, store.items["c"]), Grant(4)] and conn.pending == set()
    assert host.batcher.reserved() == 3
    # A submit does not ask the store again (one round trip per image): nothing this engine wrote, so queued.
    host.handle(conn, Submit(5, 1, "a", sha, _geometry(64, 64)), np.zeros(64 * 64 * 3, np.uint8))
    assert store.calls == [["a"], ["b", "c", "d"]] and sent[-1] == Queued(5, coalesced=False)


def test_a_remote_submit_whose_key_this_engine_stored_since_its_claim_is_a_hit_without_a_lookup(remote):
    # As test_a_submit_whose_key_was_stored_since_its_claim_is_answered_from_the_store, with Mooncake's
    # shape: both claims missed; the first image was encoded and put by this engine before the second
    # submits. The store's own record of its puts answers it, with no round trip.
    store, host, sent, conn, settle = remote
    sha = "ab" * 32
    store.go.set()
    host.handle(conn, Claim(1, "k", sha, 4))
    host.handle(conn, Claim(2, "k", sha, 4))
    settle(2)
    assert sent == [Grant(1), Grant(2)] and len(store.calls) in (1, 2)
    calls = len(store.calls)
    store.written["k"] = StoredItem(key="k", path=None, store_key="ns@id:k", num_tokens=4, grid_thw=(1, 4, 4),
                                    shape=(4, 48), dtype="bfloat16", nbytes=408, content_sha256=sha)
    released = []
    host.handle(conn, Submit(3, 2, "k", sha, _geometry(64, 64)), np.zeros(64 * 64 * 3, np.uint8),
                release=lambda: released.append(3))
    assert sent[-1] == Hit(3, store.written["k"]) and released == [3] and len(store.calls) == calls
    assert host.batcher.reserved() == 1 and host.batcher.queue_depth() == 0


def test_a_claim_or_submit_cancelled_or_disconnected_during_its_lookup_holds_nothing_after(remote):
    store, host, sent, conn, settle = remote
    sha = "cd" * 32
    store.go.set()
    host.handle(conn, Claim(1, "a", sha, 4))
    settle(1)
    assert sent == [Grant(1)] and host.batcher.reserved() == 1
    store.go.clear()
    host.handle(conn, Claim(3, "b", sha, 4))
    host.handle(conn, Cancel(3))  # the request went away while its claim's lookup was out
    host.handle(conn, Cancel(1))  # and another gave its grant back
    store.go.set()
    settle(1)
    assert sent == [Grant(1)]  # no answer
    assert host.batcher.reserved() == 0 and host.batcher.queue_depth() == 0 and conn.pending == set()
    # The API process dies while claims' lookups are out.
    store.go.clear()
    host.handle(conn, Claim(4, "c", sha, 4))
    host.handle(conn, Claim(6, "d", sha, 4))
    host.disconnect(conn)
    store.go.set()
    settle(2)
    assert sent == [Grant(1)] and host.batcher.reserved() == 0 and conn.pending == set()


def test_a_remote_store_that_does_not_answer_fails_the_waiting_claims_with_503_and_holds_nothing_for_them(remote):
    store, host, sent, conn, settle = remote
    sha = "ef" * 32
    store.go.set()
    host.handle(conn, Claim(1, "a", sha, 4))
    settle(1)
    store.down = True
    host.handle(conn, Claim(2, "b", sha, 4))
    host.handle(conn, Claim(3, "c", sha, 4))
    settle(2)
    failed = sent[1:]
    assert [f.id for f in failed] == [2, 3] and all(isinstance(f, Failed) for f in failed)
    assert {f.code for f in failed} == {"store_unavailable"} and "does not answer" in failed[0].message
    assert host.batcher.reserved() == 1 and conn.pending == set()  # only claim 1's grant


def test_fp8_blocks_are_part_of_every_content_key():
    """FP8 embeddings differ from bfloat16 ones: the same image must not hit the other's stored entry, and
    two FP8 towers keeping different blocks differ too."""
    from service.config import Settings
    from service.engine.host import model_salt as key_salt
    from service.engine.loader import load_model

    model = load_model(Settings(model="tiny", device="cpu"))
    plain = key_salt(model)
    model.tower.quantize_fp8(keep=(0,))
    one = key_salt(model)
    model.tower.fuse_patch_embed()  # back to the loaded weights
    model.tower.quantize_fp8(keep=())
    every = key_salt(model)
    model.tower.fuse_patch_embed()
    model.tower.quantize_fp8(keep=(), gemms=("qkv",))
    assert len({plain, one, every, key_salt(model)}) == 4 and one.endswith("|fp8 qkv+fc1+fc2 blocks 1,2")


def test_model_info_says_which_blocks_and_gemms_run_in_fp8(tmp_path):
    """/ready's fp8_blocks and fp8_gemms (ModelInfo): what --fp8-bf16-blocks and --fp8-gemms chose; empty in bf16."""
    from service.config import Settings
    from service.engine.loader import load_model

    model = load_model(Settings(model="tiny", device="cpu"))
    store = _DictStore()
    store.location = str(tmp_path)
    engine = _Engine(store, Batcher(BatchLimits(max_batch_tokens=100, max_batch_images=8, max_wait_s=0,
                                                max_queue_images=8)))
    engine.runner.graphs = None
    host = EngineHost(engine, model, Metrics())
    info = host.model_info()
    assert (info.fp8_blocks, info.fp8_gemms, info.store) == ([], [], str(tmp_path))
    model.tower.quantize_fp8(keep=(0,), gemms=("fc2", "qkv"))
    info = host.model_info()
    assert (info.fp8_blocks, info.fp8_gemms) == ([1, 2], ["qkv", "fc2"])  # (in the tower's order)


def test_an_entry_of_the_other_modality_under_a_uuid_is_a_conflict_not_a_hit():
    """One file's bytes (a GIF decodes as either) under one uuid as an image and then as a video: the image's
    entry is not the video's embeddings, so the claim is a conflict, as for other bytes."""
    from service.store.format import VideoMeta

    store = _DictStore()
    host, sent, conn = _host(max_queue_images=4, max_queue_tokens=500, store=store)
    sha = "cd" * 32
    store.items["u"] = StoredItem(key="u", path="u/encoder_cache.safetensors", num_tokens=4, grid_thw=(1, 4, 4),
                                  shape=(4, 48), dtype="float32", nbytes=1000, content_sha256=sha)
    store.items["v"] = StoredItem(key="v", path="v/encoder_cache.safetensors", num_tokens=4, grid_thw=(1, 4, 4),
                                  shape=(4, 48), dtype="float32", nbytes=1000, content_sha256=sha,
                                  video=VideoMeta((0, 1), 2.0, (0.0,)))
    host.handle(conn, Claim(1, "u", sha, 4))
    host.handle(conn, Claim(2, "v", sha, 4, video=True))
    assert sent == [Hit(1, store.items["u"]), Hit(2, store.items["v"])]
    sent.clear()
    host.handle(conn, Claim(3, "u", sha, 4, video=True))
    host.handle(conn, Claim(4, "v", sha, 4))
    assert [(type(m), m.code) for m in sent] == [(Failed, "key_conflict")] * 2, sent
    assert "as an image" in sent[0].message and "as a video" in sent[1].message
    assert host.batcher.reserved() == 0


def test_a_claim_past_its_deadline_is_a_504_unless_its_image_is_stored():
    store = _DictStore()
    host, sent, conn = _host(max_queue_images=4, max_queue_tokens=500, store=store)
    sha = "12" * 32
    item = StoredItem(key="hit", path="hit/encoder_cache.safetensors", num_tokens=4, grid_thw=(1, 4, 4), shape=(4, 48),
                      dtype="float32", nbytes=1000, content_sha256=sha)
    store.items["hit"] = item
    spent = time.monotonic() - 0.001
    host.handle(conn, Claim(1, "hit", sha, 4, deadline=spent))
    assert sent == [Hit(1, item)]  # a cached image is still answered
    host.handle(conn, Claim(2, "miss", sha, 4, deadline=spent))
    assert isinstance(sent[-1], Failed) and sent[-1].code == "deadline_exceeded" and "before its image was decoded" in sent[-1].message
    assert host.batcher.reserved() == 0  # no queue place, so nothing is decoded
    host.handle(conn, Claim(3, "miss", sha, 4, priority=3, deadline=time.monotonic() + 60))
    assert sent[-1] == Grant(3) and host.batcher.waiting().images == {3: 1}


def test_a_submit_decoded_past_its_deadline_is_a_504_and_nothing_is_queued():
    host, sent, conn = _host(max_queue_images=4, max_queue_tokens=500)
    sha = "34" * 32
    host.handle(conn, Claim(1, "k", sha, 4, deadline=time.monotonic() + 60))
    assert sent == [Grant(1)]
    released = []
    host.handle(conn, Submit(2, 1, "k", sha, _geometry(64, 64), deadline=time.monotonic() - 0.001),
                np.zeros(64 * 64 * 3, np.uint8), release=lambda: released.append(2))
    assert isinstance(sent[-1], Failed) and sent[-1].code == "deadline_exceeded" and "before its image was queued" in sent[-1].message
    assert released == [2] and host.batcher.reserved() == 0 and host.batcher.queue_depth() == 0
    # One in time is queued with its priority and deadline: past it, the step loop answers it 504.
    host.handle(conn, Claim(3, "k", sha, 4))
    host.handle(conn, Submit(4, 3, "k", sha, _geometry(64, 64), priority=2, deadline=time.monotonic() + 0.05),
                np.zeros(64 * 64 * 3, np.uint8), release=lambda: released.append(4))
    assert sent[-1] == Queued(4) and host.batcher.waiting().images == {2: 1}
    time.sleep(0.06)
    assert host.batcher.next_batch(timeout=0) is None  # expired: dropped, never in a step
    assert isinstance(sent[-1], Failed) and sent[-1].id == 4 and sent[-1].code == "deadline_exceeded"
    assert "before its step started" in sent[-1].message and released == [2, 4]
