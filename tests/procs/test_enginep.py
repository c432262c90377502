"""The engine process's answers to claims (service/procs/enginep.py): admission before decode by images and
by the tokens each image's header declares, places given back on cancel and on disconnect."""

from service.engine.batcher import BatchLimits, Batcher
from service.procs.enginep import EngineHost
from service.procs.ipc import item_to_wire
from service.metrics import Metrics
from service.store.directory import StoredItem


class _EmptyStore:
    def lookup(self, key):
        return None


class _DictStore:
    def __init__(self):
        self.items: dict[str, StoredItem] = {}

    def lookup(self, key):
        return self.items.get(key)


def test_claims_admit_by_images_and_header_tokens_and_give_places_back():
    batcher = Batcher(BatchLimits(max_batch_tokens=100, max_batch_images=8, max_wait_s=0.01, max_queue_images=3,
                                  max_queue_tokens=500))
    host = EngineHost(settings=None, model=None, store=_EmptyStore(), batcher=batcher, engine=None, metrics=None)
    sent: list = []
    conn = host.connected(sent.append)
    sha = "0" * 64

    def claim(rid: int, key: str, tokens: int) -> list:
        host.handle(conn, ["claim", rid, key, sha, tokens])
        return sent[-1]

    assert claim(1, "a", 400) == ["decode", 1]
    refused = claim(2, "b", 200)  # 400 + 200 tokens > 500, before anything is decoded
    assert refused[:3] == ["error", 2, "overloaded"] and "limit 500 tokens" in refused[3] and refused[4] >= 1
    assert claim(3, "c", 50) == ["decode", 3] and claim(4, "d", 20) == ["decode", 4]
    assert claim(5, "e", 1)[:3] == ["error", 5, "overloaded"]  # 3 images being decoded: full by count
    assert batcher.reserved() == 3
    host.handle(conn, ["cancel", 1])  # the API process gave up on image a (its decode failed, say)
    assert batcher.reserved() == 2 and claim(6, "b", 200) == ["decode", 6]
    host.disconnected(conn)  # the API process died: its places go back
    assert batcher.reserved() == 0


def test_a_submit_whose_key_was_stored_since_its_claim_is_answered_from_the_store():
    # Two requests with one image: both claims miss (nothing stored, nothing queued yet), so both API
    # processes decode it; the first is encoded and stored before the second submits. The second must
    # get the stored entry, not a second encode (seen as one image encoded twice under load).
    batcher = Batcher(BatchLimits(max_batch_tokens=100, max_batch_images=8, max_wait_s=0.01, max_queue_images=4,
                                  max_queue_tokens=500))
    store, metrics = _DictStore(), Metrics()
    host = EngineHost(settings=None, model=None, store=store, batcher=batcher, engine=None, metrics=metrics)
    sent: list = []
    conn = host.connected(sent.append)
    sha = "ab" * 32
    host.handle(conn, ["claim", 1, "k", sha, 4])
    host.handle(conn, ["claim", 2, "k", sha, 4])
    assert sent == [["decode", 1], ["decode", 2]] and batcher.reserved() == 2
    item = StoredItem(key="k", path="k/encoder_cache.safetensors", num_tokens=4, grid_thw=(1, 4, 4), shape=(4, 48),
                      dtype="float32", nbytes=1000, content_sha256=sha)
    store.items["k"] = item  # the first request's image, encoded and stored
    sent.clear()
    host.handle(conn, ["submit", 3, 2, "k", sha, "seg", 0, 48, 4, 4, [1, 4, 4], 4])
    assert sent == [["cell_free", "seg", 0, 48], ["queued", 3], ["result", 3, item_to_wire(item)]]
    assert batcher.reserved() == 1 and batcher.queue_depth() == 0  # its place given back, nothing queued
    assert metrics.cache_hits._value.get() == 1
    # Other bytes under that key: a conflict, and the cell and the place still go back.
    sent.clear()
    host.handle(conn, ["submit", 4, 1, "k", "cd" * 32, "seg", 64, 48, 4, 4, [1, 4, 4], 4])
    assert sent[0] == ["cell_free", "seg", 64, 48] and sent[1][:3] == ["error", 4, "key_conflict"]
    assert batcher.reserved() == 0
