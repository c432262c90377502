"""Which waiting work goes first, and when it is too late: priority levels and deadlines.

Priority: an integer, lower first, 0 by default (vLLM's field and convention). Every waiting thing (a queued
image in the batcher, a decode waiting for a decoder) has a *due* key, and the least goes first:

    due = (arrival + priority * aging_s, arrival)      with --priority-aging-s > 0
    due = (priority, arrival)                          with 0: strict priority

Within a level that is first come, first served. Between levels it is aging: the rule "effective priority =
priority - waited / aging_s, least first" orders two waiting things the same way however long both wait, so
it is a key fixed at arrival. The starvation bound follows: work of priority q arriving more than
(p - q) * aging_s after work of priority p never goes before it. So a bulk image (priority 10) waits behind
at most what more urgent traffic sends within 10 aging periods of its arrival, never forever.

Deadline: a request's budget from its arrival (`deadline_ms`, --default-deadline-ms), carried as an absolute
time.monotonic() (one clock for every process of a host: CLOCK_MONOTONIC). Work whose deadline has passed
before it is decoded or before its step starts is dropped and answered 504; once it runs it is answered.

`Levels` is the batcher's queue in that order, `PriorityGate` the decoders' waiting room. Plain Python and
asyncio: every process uses them.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from service.errors import DeadlineExceeded

# The range a request's priority may take (vLLM's is a Python int; this keeps due keys exact in a float).
PRIORITY_MIN, PRIORITY_MAX = -(2**31), 2**31 - 1

Due = tuple[float, float]


def due(arrival: float, priority: int, aging_s: float) -> Due:
    """The order key of work of `priority` arriving at `arrival` (least first); see the module docstring."""
    if aging_s > 0:
        return (arrival + priority * aging_s, arrival)
    return (float(priority), arrival)


@dataclass(frozen=True, slots=True)
class Urgency:
    """How urgent one request's work is: its priority, and its deadline (time.monotonic(); None: none)."""

    priority: int = 0
    deadline: float | None = None

    @classmethod
    def at_arrival(cls, arrival: float, priority: int = 0, deadline_ms: int | None = None,
                   default_deadline_ms: int | None = None) -> Urgency:
        """A request's urgency from its arrival (time.monotonic()) and its fields (or the service's default)."""
        budget = deadline_ms if deadline_ms is not None else default_deadline_ms
        return cls(priority, None if budget is None else arrival + budget / 1000)

    def expired(self, now: float | None = None) -> bool:
        return self.deadline is not None and (time.monotonic() if now is None else now) >= self.deadline

    def check(self, where: str, now: float | None = None) -> None:
        """Raise the request's 504 if its deadline has passed (`where`: what it was about to do)."""
        if self.expired(now):
            raise expired_error(where)


def expired_error(where: str) -> DeadlineExceeded:
    return DeadlineExceeded(f"the request's deadline (deadline_ms, or --default-deadline-ms) passed before {where}; "
                            "nothing of it was done: give it a longer budget, or retry when the encoder is less busy")


class Waiting(Protocol):
    key: str
    priority: int
    due: Due
    tokens: int


W = TypeVar("W", bound=Waiting)


class Levels(Generic[W]):
    """Waiting items by key, each under its priority level, each level in due order (its arrival order: an item
    re-added after a promotion is due no sooner than those there). Most urgent first is a merge of the levels'
    heads. Not thread-safe: its owner's lock guards it."""

    def __init__(self) -> None:
        self._items: dict[str, W] = {}
        self._levels: dict[int, OrderedDict[str, W]] = {}  # (OrderedDict: the order, and O(1) removal)
        self.tokens = 0  # the items' tokens

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key: str) -> W | None:
        return self._items.get(key)

    def add(self, item: W) -> None:
        self._items[item.key] = item
        self._levels.setdefault(item.priority, OrderedDict())[item.key] = item
        self.tokens += item.tokens

    def remove(self, item: W) -> None:
        del self._items[item.key]
        level = self._levels[item.priority]
        del level[item.key]
        if not level:
            del self._levels[item.priority]
        self.tokens -= item.tokens

    def ordered(self) -> Iterator[W]:
        """Every item, most urgent first (lazily: a batch reads only its head)."""
        if len(self._levels) == 1:
            return iter(next(iter(self._levels.values())).values())
        return heapq.merge(*(level.values() for level in self._levels.values()), key=lambda item: item.due)

    def least_urgent(self, than: int) -> Iterator[W]:
        """The items of priority strictly greater than `than`: the least urgent level first, newest first in it."""
        for level in sorted((p for p in self._levels if p > than), reverse=True):
            yield from reversed(list(self._levels[level].values()))

    def by_level(self) -> dict[int, list[W]]:
        return {level: list(items.values()) for level, items in self._levels.items()}


class PriorityGate:
    """At most `permits` holders at once; waiters are let in by their due key (module docstring), and one whose
    deadline passes while it waits leaves with a 504. One event loop; `clock` is time.monotonic in service."""

    def __init__(self, permits: int, aging_s: float, clock: Callable[[], float] = time.monotonic):
        assert permits >= 1, f"a gate of {permits} permits: this is a bug"
        self.permits, self.aging_s, self._clock = permits, aging_s, clock
        self.held = 0
        self._waiters: list[tuple[Due, int, asyncio.Future]] = []  # a heap; a cancelled waiter's future is done
        self._seq = itertools.count()

    def waiting(self) -> int:
        return sum(1 for *_, f in self._waiters if not f.done())

    async def acquire(self, urgency: Urgency, what: str = "its decode started") -> None:
        """Wait for a permit (give it back with `release`). Raises the 504 once `urgency`'s deadline passes first."""
        urgency.check(what, self._clock())
        while self._waiters and self._waiters[0][2].done():  # (gone or timed out: their entries go lazily)
            heapq.heappop(self._waiters)
        if self.held < self.permits and not self._waiters:
            self.held += 1
            return
        fut = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiters, (due(self._clock(), urgency.priority, self.aging_s), next(self._seq), fut))
        timeout = None if urgency.deadline is None else max(0.0, urgency.deadline - self._clock())
        try:
            await asyncio.wait_for(asyncio.shield(fut), timeout)
        except BaseException as e:
            if fut.done() and not fut.cancelled():
                self.release()  # handed a permit as it gave up: pass it on
            else:
                fut.cancel()
            if isinstance(e, TimeoutError):
                raise expired_error(what) from None
            raise

    def release(self) -> None:
        """Give a permit back: straight to the most urgent waiter, if one waits."""
        while self._waiters:
            _, _, fut = heapq.heappop(self._waiters)
            if not fut.done():
                fut.set_result(None)  # (the permit passes to it: `held` unchanged)
                return
        self.held -= 1
        assert self.held >= 0, "a gate released more often than acquired: this is a bug"

    @contextlib.asynccontextmanager
    async def hold(self, urgency: Urgency, what: str = "its decode started"):
        """A permit held while the block runs."""
        await self.acquire(urgency, what)
        try:
            yield
        finally:
            self.release()
