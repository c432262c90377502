"""The directory store's index (service/store/index.py): LRU order, the minimum residency, what a room check
visits and what an eviction takes."""

from __future__ import annotations

from collections import OrderedDict

import pytest

from service.errors import Unavailable
from service.store.format import StoredItem
from service.store.index import Entry, Index
from tests.support.errors import raises_code


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _item(key: str) -> StoredItem:
    return StoredItem(key=key, path=f"{key}/encoder_cache.safetensors", num_tokens=1, grid_thw=(1, 2, 2),
                      shape=(1, 8), dtype="float32", nbytes=100)


class CountingEntries(OrderedDict):
    """The index's entries, counting how many a scan visits."""

    visited = 0

    def items(self):
        for kv in super().items():
            self.visited += 1
            yield kv


def test_writes_and_answered_lookups_are_the_most_recent_and_kept_for_the_residency():
    clock = Clock()
    index = Index(capacity_bytes=300, min_residency_s=10, clock=clock)
    for k in "abc":
        index.put(k, 100, _item(k))
    assert list(index.entries) == ["a", "b", "c"] and index.bytes_used == 300
    clock.now += 11  # every residency over
    assert index.touch("a").item.key == "a" and list(index.entries) == ["b", "c", "a"]
    index.put("d", 100, _item("d"))
    assert index.evict(keep="d") == ["b"] and index.evictions == 1  # the least recently used, not "a" (answered)
    assert list(index.entries) == ["c", "a", "d"] and index.bytes_used == 300
    index.entries["c"].item = None  # on disk but not a hit (another model's file)
    assert index.touch("c") is None and index.touch("zz") is None


def test_an_entry_in_its_residency_is_never_evicted_and_a_store_full_of_them_refuses():
    clock = Clock()
    index = Index(capacity_bytes=200, min_residency_s=30, clock=clock)
    index.put("a", 100, _item("a"))
    index.put("b", 100, _item("b"))
    with raises_code(Unavailable, "store_full") as full:
        index.check_room("c", 100)
    assert full.value.retry_after_s == 30 and "(200 of 200 bytes)" in full.value.message
    index.put("c", 100, _item("c"))  # written anyway (a caller that checked before): nothing may go
    assert index.evict(keep="c") == [] and index.bytes_used == 300
    clock.now += 31
    index.check_room("d", 100)  # fits: old entries can go now
    assert index.evict(keep="c") == ["a"] and index.bytes_used == 200


def test_a_key_replaced_counts_once_and_drop_forgets_only_the_entry_it_names():
    index = Index(capacity_bytes=1000, min_residency_s=0, clock=Clock())
    index.put("a", 100, _item("a"))
    index.put("a", 250, _item("a"))
    assert index.bytes_used == 250 and len(index) == 1
    stale = Entry(nbytes=250, item=None)
    index.drop("a", stale)  # another thread's entry: left alone
    assert len(index) == 1
    index.drop("a", index.entries["a"])
    assert len(index) == 0 and index.bytes_used == 0


@pytest.mark.parametrize("entries", [100, 100_000])
def test_a_room_check_on_a_full_store_visits_only_what_it_would_evict(entries):
    """Under constant eviction every write checks for room; scanning the whole index there held the GIL
    ~0.4 ms per write with a few thousand entries (py-spy, H200 host, HTTP load). The entries in their
    residency are a suffix of the LRU order, so a check stops at the first of them, or at the entries
    that free enough."""
    clock = Clock()
    index = Index(capacity_bytes=entries * 1000, min_residency_s=30, clock=clock)
    index.entries = CountingEntries()
    index.load([(i, f"k{i}", Entry(nbytes=1000, item=None, keep_until=0.0 if i < entries // 2 else clock.now + 30))
                for i in range(entries)])
    index.check_room("new", 1000)  # must evict one old entry: fits
    assert index.entries.visited == 1
    for e in index.entries.values():
        e.keep_until = clock.now + 30
    index.entries.visited = 0
    with raises_code(Unavailable, "store_full") as full:
        index.check_room("new", 1000)
    assert index.entries.visited == 1  # the first entry says the rest are kept too
    assert full.value.retry_after_s == 30 and f"({entries * 1000} of {entries * 1000} bytes)" in full.value.message
