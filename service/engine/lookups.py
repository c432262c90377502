"""Store lookups off the engine host's thread, batched, for a store whose lookup is a network round trip
(Mooncake: an RPC to the master).

The host answers every API process from one thread (engine/host.py). A lookup per claim and per submit
on that thread serialized the round trips: on an H200 machine (gVisor's loopback, ~1.2 ms a lookup)
/encode at 1 image per request topped out at 406 img/s with Mooncake against 658 with the directory
(2026-12-01; the run's logs are in git history). Here one thread takes every lookup queued meanwhile into one
`store.lookup_many` (one batch_is_exist), so under load the round trips are shared and the host keeps
answering; an idle lookup costs one round trip, as before. A directory store is looked up in place
(a stat and a header read: a thread hop would cost more than it).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

from service.store.format import StoredItem

log = logging.getLogger(__name__)

Answer = Callable[["StoredItem | None | Exception"], None]


class StoreLookups:
    """`lookup(key, answer)`: answer(item or None, or the exception the store raised) is called on this
    object's thread (post it to wherever it belongs). Keys queued while a batch is out go in the next."""

    def __init__(self, store, max_batch: int = 256):
        self.store, self.max_batch = store, max_batch
        # What close() logs: how the round trips were shared (calls, keys, seconds inside lookup_many).
        self.calls, self.keys, self.busy_s = 0, 0, 0.0
        self._queue: queue.SimpleQueue[tuple[str, Answer] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="store-lookups", daemon=True)
        self._thread.start()

    def lookup(self, key: str, answer: Answer) -> None:
        self._queue.put((key, answer))

    def close(self, timeout: float = 10) -> None:
        """Answer what is queued, then stop."""
        self._queue.put(None)
        self._thread.join(timeout)
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
                found: list = self.store.lookup_many([key for key, _ in batch])
            except Exception as e:  # (the master unreachable: every lookup of the batch fails alike)
                found = [e] * len(batch)
            self.calls, self.keys, self.busy_s = self.calls + 1, self.keys + len(batch), self.busy_s + time.perf_counter() - t0
            for (_, answer), item in zip(batch, found, strict=True):
                try:
                    answer(item)
                except Exception:  # an answer that fails is a bug there; the other answers still go
                    log.exception("store lookup: its answer failed")
