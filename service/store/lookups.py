"""Lookups off the caller's thread, batched, for a store whose lookup is a network round trip (Mooncake:
an RPC to the master): what MooncakeStore.find answers with.

The engine host answers every API process from one thread (engine/host.py). A lookup per claim and per
submit on that thread serialized the round trips: on an H200 machine (gVisor's loopback, ~1.2 ms a lookup)
/encode at 1 image per request topped out at 406 img/s with Mooncake against 658 with the directory
(bench/RESULTS.md). Here one thread takes every lookup queued meanwhile into one `lookup_many` (one
batch_is_exist), so under load the round trips are shared and the host keeps answering; an idle lookup
costs one round trip. A directory store answers in place (a stat and a header read: a thread hop would
cost more than it).

Several threads take batches: a batch whose reads wait on a host that does not answer (each Mooncake call
is bounded by its deadline, store/calls.py, but a deadline is seconds) holds one of them, and the lookups
queued meanwhile go to another, so a fresh image never waits behind a stopped host's entries.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable

from service.store.format import StoredItem

log = logging.getLogger(__name__)

LookupMany = Callable[[list[str]], "list[StoredItem | None]"]


class Lookups:
    """`lookup(key)`: a future of the item (None: a miss) or of the exception `lookup_many` raised, done on
    one of this object's threads (its callbacks run there). Keys queued while every thread has a batch out
    go in the next one."""

    def __init__(self, lookup_many: LookupMany, max_batch: int = 256, threads: int = 4):
        self.lookup_many, self.max_batch = lookup_many, max_batch
        # What close() logs: how the round trips were shared (calls, keys, seconds inside lookup_many).
        self.calls, self.keys, self.busy_s = 0, 0, 0.0
        self._count = threading.Lock()
        self._queue: queue.SimpleQueue[tuple[str, concurrent.futures.Future] | None] = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._run, name="store-lookups", daemon=True) for _ in range(threads)]
        for t in self._threads:
            t.start()

    def lookup(self, key: str) -> concurrent.futures.Future:
        found: concurrent.futures.Future = concurrent.futures.Future()
        self._queue.put((key, found))
        return found

    def close(self, timeout: float = 10) -> None:
        """Answer what is queued, then stop."""
        for _ in self._threads:
            self._queue.put(None)
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        if self.calls:
            log.info("store lookups: %d keys in %d calls (%.1f a call), %.2f s in the store (%.2f ms a call)",
                     self.keys, self.calls, self.keys / self.calls, self.busy_s, 1e3 * self.busy_s / self.calls)

    def _run(self) -> None:
        stop = False
        while not stop:
            first = self._queue.get()
            if first is None:
                return
            batch = [first]
            while len(batch) < self.max_batch:
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:  # (answer this batch, then stop)
                    stop = True
                    break
                batch.append(nxt)
            t0 = time.perf_counter()
            try:
                found: list = self.lookup_many([key for key, _ in batch])
            except Exception as e:  # (the master unreachable: every lookup of the batch fails alike)
                found = [e] * len(batch)
            with self._count:
                self.calls, self.keys, self.busy_s = self.calls + 1, self.keys + len(batch), self.busy_s + time.perf_counter() - t0
            for (_, future), item in zip(batch, found, strict=True):
                # (a callback that raises is logged by the future and does not stop the others)
                if isinstance(item, Exception):
                    future.set_exception(item)
                else:
                    future.set_result(item)
