"""The directory store's index: every entry of its root (or shard) in LRU order, with its size and its
minimum residency, and the eviction policy. Plain Python and no files: the store (service/store/directory.py)
holds its lock around every call, renames the victims' files aside and fills the index at start from the
files' headers.

NOTE (minimum residency): an entry that was just written or answered as a hit is not evicted for
`min_residency_s`: a consumer told "it is there" (vLLM's scheduler checks existence, its worker loads
later) must still find it. Every touch (a write, an answered lookup) moves an entry to the end of the LRU
order with keep_until = now + min_residency, so keep_until never decreases along the order, and the entries
in their residency are a suffix of it: a check visits only the entries it would evict.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from service.errors import Unavailable
from service.store.format import StoredItem


@dataclass
class Entry:
    nbytes: int
    item: StoredItem | None  # None: on disk and counted, but not a hit (other model/format, or malformed)
    keep_until: float = 0.0  # store clock: not evicted before this (answered by /encode; min residency)


class Index:
    """Keys -> entries, least recently used first; `bytes_used` is the sum of their sizes. Not thread-safe:
    the caller holds its store's lock."""

    def __init__(self, capacity_bytes: int, min_residency_s: float, clock: Callable[[], float]):
        if min_residency_s < 0:
            raise ValueError(f"min_residency_s must be >= 0, got {min_residency_s}")
        self.capacity_bytes, self.min_residency_s, self.clock = capacity_bytes, min_residency_s, clock
        self.entries: OrderedDict[str, Entry] = OrderedDict()  # LRU first, MRU last
        self.bytes_used = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self.entries)

    def load(self, found: list[tuple[int, str, Entry]]) -> None:
        """At start: entries found on disk as (mtime_ns, key, entry), indexed in mtime order."""
        for _, key, entry in sorted(found, key=lambda f: (f[0], f[1])):
            self.entries[key] = entry
            self.bytes_used += entry.nbytes

    def touch(self, key: str) -> Entry | None:
        """The entry of `key` if it is a hit: now the most recently used, and kept for the minimum residency
        (it was answered)."""
        entry = self.entries.get(key)
        if entry is None or entry.item is None:
            return None
        self.entries.move_to_end(key)
        entry.keep_until = max(entry.keep_until, self.clock() + self.min_residency_s)
        return entry

    def put(self, key: str, nbytes: int, item: StoredItem) -> None:
        """A written entry (replacing any of the key's), the most recently used, kept for the residency."""
        self.drop(key)
        self.entries[key] = Entry(nbytes=nbytes, item=item, keep_until=self.clock() + self.min_residency_s)
        self.bytes_used += nbytes

    def drop(self, key: str, entry: Entry | None = None) -> None:
        """Forget `key` (only if its entry is still `entry`, when given): its file is gone already."""
        old = self.entries.get(key)
        if old is not None and (entry is None or old is entry):
            del self.entries[key]
            self.bytes_used -= old.nbytes

    def check_room(self, key: str, incoming: int) -> None:
        """Raise `store_full` if `incoming` bytes for `key` cannot fit without evicting entries still in their
        minimum residency.

        Visits only the entries this put would evict (usually one), not the whole index (see the module
        NOTE). (Scanning every entry here cost ~0.4 ms of GIL per put with a few thousand entries, found
        with py-spy under HTTP load.)"""
        capacity = self.capacity_bytes
        old = self.entries.get(key)
        used = self.bytes_used - (old.nbytes if old is not None else 0)  # a put replaces `key`'s entry
        need = used + incoming - capacity  # bytes the eviction after this put must free
        if need <= 0:
            return
        now, freed = self.clock(), 0
        for k, e in self.entries.items():
            if k == key:
                continue
            if e.keep_until > now:  # this one and all after it are kept
                wait = max(1, math.ceil(e.keep_until - now))
                raise Unavailable(
                    f"the embedding store is full of entries answered in the last {self.min_residency_s:g} s "
                    f"({used - freed} of {capacity} bytes), which consumers may still be reading; "
                    f"retry in about {wait} s, or raise --store-capacity-bytes",
                    retry_after_s=wait, code="store_full",
                )
            freed += e.nbytes
            if freed >= need:
                return
        # Nothing young is left and still no room: only an item larger than the whole capacity gets
        # here, and it is written anyway (the store's NOTE on oversize items).

    def evict(self, keep: str | None, limit: int | None = None) -> list[str]:
        """Take out least recently used entries (never `keep`, never one in its minimum residency) until
        within capacity (or `limit` bytes); their keys, whose files the caller removes."""
        now = self.clock()
        limit = self.capacity_bytes if limit is None else limit
        victims = []
        while self.bytes_used > limit:
            # The first entry other than `keep`, unless it is still in its residency: then so are all
            # after it (see the module NOTE), and nothing may be evicted.
            victim = next((k for k in self.entries if k != keep), None)
            if victim is None or self.entries[victim].keep_until > now:
                break  # only `keep` and young entries are left
            self.bytes_used -= self.entries.pop(victim).nbytes
            self.evictions += 1
            victims.append(victim)
        return victims
