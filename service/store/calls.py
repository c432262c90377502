"""Calls into a client that can hang, each waited for at most a deadline: what every Mooncake call of this
package goes through (store/mooncake.py, store/values.py).

NOTE: why a thread per call: Mooncake's client calls block in C++ with no deadline one can pass. A read
from a host that is stopped (its sockets open, nothing answers) waits for the transfer engine's progress
timeout, 30 s, and with its retries 60 s; a call to a master that is gone costs 4.3 s of reconnecting;
one to a master that is stopped waits for the RPC timeout. Run on the caller's thread, such a call
held the engine host's one lookup thread (and every image behind it), a consumer's event loop, vLLM's
scheduler loop. Here the call runs on a thread of a pool and its caller waits at most `timeout_s`: past
that the call counts as failed (`Overdue`) and the caller goes on, while the call keeps its thread until
Mooncake returns. A call still queued when its deadline passes is never started.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
from collections import Counter
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class Overdue(Exception):
    """A call that did not return within its deadline (it may still be running)."""


class Calls:
    """A pool of threads for calls that may hang; `run(what, fn, ...)` waits at most `timeout_s`."""

    def __init__(self, timeout_s: float, *, threads: int = 16, name: str = "mooncake-call"):
        assert timeout_s > 0, "a deadline must be positive: this is a bug"
        self.timeout_s, self.name = timeout_s, name
        # NOTE: the pool's size bounds the threads that calls past their deadline can hold at once (a
        # stopped host holds each read from it for up to a minute); with every thread held, a new call is
        # Overdue at once rather than queued behind them. Daemon threads, started as needed: a call hung in
        # Mooncake must not hold the process's exit either (concurrent.futures' pool joins its threads).
        self._max_threads = threads
        self._threads: list[threading.Thread] = []
        self._idle = 0
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._out = 0  # calls started and not yet returned (or dropped unstarted)
        self._returned = threading.Condition(self._lock)
        self.overdue: Counter[str] = Counter()  # calls past their deadline since start, by `what`

    def start(self, what: str, fn: Callable[..., T], *args) -> concurrent.futures.Future:
        """fn(*args) on a thread of the pool; `wait` its future. Overdue at once if every thread is held."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._idle:
                self._idle -= 1  # (one of the threads waiting takes it)
            elif len(self._threads) < self._max_threads:
                t = threading.Thread(target=self._work, name=f"{self.name}-{len(self._threads)}", daemon=True)
                self._threads.append(t)
                t.start()
            else:
                self.overdue[what] += 1
                raise Overdue(f"Mooncake's {what} was not made: all {self._max_threads} threads for its calls "
                              "are held by calls past their deadline")
            self._out += 1
        self._queue.put((future, fn, args))
        return future

    def wait(self, what: str, future: concurrent.futures.Future, timeout_s: float | None = None) -> T:
        """The result of a call `start`ed, or Overdue once its deadline (timeout_s, default the pool's) has
        passed; `what` names it in the count and in the message."""
        limit = self.timeout_s if timeout_s is None else timeout_s
        try:
            return future.result(timeout=limit)
        except concurrent.futures.TimeoutError:
            future.cancel()  # (not yet taken by its thread: never started)
            with self._lock:
                self.overdue[what] += 1
            raise Overdue(f"Mooncake's {what} did not answer within {limit:g} s") from None

    def counts(self) -> Counter[str]:
        """A copy of `overdue`."""
        with self._lock:
            return Counter(self.overdue)

    def run(self, what: str, fn: Callable[..., T], *args) -> T:
        """fn(*args), or Overdue past the deadline (see the module docstring)."""
        return self.wait(what, self.start(what, fn, *args))

    def drain(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for every call out to return; whether they all did."""
        with self._returned:
            return self._returned.wait_for(lambda: self._out == 0, timeout_s)

    def close(self) -> None:
        """No new calls; a call still running is left to end on its own."""
        for _ in self._threads:
            self._queue.put(None)

    def _work(self) -> None:
        while (job := self._queue.get()) is not None:
            future, fn, args = job
            if future.set_running_or_notify_cancel():  # (False: cancelled at its deadline, never started)
                try:
                    future.set_result(fn(*args))
                except BaseException as e:
                    future.set_exception(e)
            with self._lock:
                self._idle += 1
                self._out -= 1
                self._returned.notify_all()
