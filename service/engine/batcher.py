"""The batcher: a bounded queue of encode work, in priority order, that the step loop drains one batch at a time.

HTTP handlers (event-loop thread) `submit` one work item per image and await the ticket's future;
each step-loop thread calls `next_batch`, runs it, and reports every item with `finish`. This module
decides *what* runs and never touches the GPU: plain Python, no torch, no numpy, tested with a plain
queue and a fake clock.

Life of an item::

    submit ──► queued ──(next_batch)──► in flight ──(finish)──► done (future resolved)
                 │
                 ├──(every waiter cancelled or past its deadline)──► dropped (future cancelled, never runs)
                 └──(shed for more urgent work, the queue full)──► answered 429, never runs

- Order: a batch takes the queue's most urgent items (service/priority.py: lower priority first, first come
  first served within a level, aged by --priority-aging-s so that no level starves). A waiter more urgent
  than its item's own (a join) moves the item up to its level, as if it had arrived then.
- Deadlines: each waiter may carry one (time on the batcher's clock). A waiter whose deadline passes while
  its item is queued is answered `deadline_exceeded` (504) when the step loop next plans; the item is
  dropped once no waiter is left. An item in flight is answered: a deadline bounds waiting, not work.
- Coalescing: a key that is queued or in flight is encoded once; later submits of it join the
  existing item (`waiters += 1`) instead of adding work, so they also bypass admission.
- Admission: at most `max_queue_images` items (and `max_queue_tokens` tokens) wait unscheduled;
  beyond that `submit` raises `Overloaded` (429), unless shedding queued items of strictly lower priority
  (the least urgent first, newest first within a level) makes room: those are answered 429 instead. In-flight items are bounded by the step loop, not
  here. Admission can come before decode: `reserve` holds a queue place (and the image's tokens, from
  its header) while the image is decoded, and `submit(..., place=)` uses it up, so a full queue
  refuses an image before its pixels exist and an admitted one is never refused after decoding.
- A batch closes on the token budget, the image limit, at once when the step loop says the device
  is idle (continuous batching: nothing would be gained by waiting), `max_wait_s` after its oldest
  item was enqueued while the device runs one step, or at once while draining after `close()`. While
  a launched step still waits behind the running one (BACKLOG steps in flight), a due batch is held
  and grows: closed now it would only queue behind that step, so it starts no sooner, only smaller.

Threading: all state lives behind one `threading.Condition`. Future callbacks (which may run user
code such as asyncio's `call_soon_threadsafe`) are always fired *outside* that lock.

Payloads: the batcher never looks inside one. Its classes are generic over the payload type `P` (the
engine queues `Batcher[EncodeJob]`), so the step loop and the writer read payloads typed, while the
tests queue plain strings or None.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, replace
from typing import Generic, Literal, NamedTuple, TypeVar

from service.config import BatchLimits  # the limits' type, derived from Settings there (Settings.batch_limits)
from service.errors import Overloaded, Unavailable
from service.priority import Due, Levels, Urgency, due, expired_error

# Steps in flight (running, or launched and waiting behind the running one) at which a batch past max_wait
# is held instead of closed, and re-checked every BACKLOG_POLL_S (the writer's wake() comes only after
# it has caught up). Why: under load at 1 image per request, closing on max_wait queued steps of ~26
# 448px images behind each other on the device, which ran them at 740 img/s against 860 at 64 (an
# H200). Measured with the hold: steps of 31.8 images instead of 25.5, the
# throughput the same (727.9 against 725.6 img/s), because the store's writes were then the limit.
BACKLOG = 2
BACKLOG_POLL_S = 0.001

# NOTE: a fixed hint for clients' Retry-After. The batcher does not see step times, so it cannot
# predict when room frees up; one second is several steps at any realistic load.
RETRY_AFTER_S = 1

CloseReason = Literal["tokens", "images", "idle", "wait", "drain"]
P = TypeVar("P")  # a work item's payload: opaque to the batcher (the engine's EncodeJob)


class _Future(Future):
    """A Future that lets go of its done-callbacks once it has called them.

    Why: concurrent.futures.Future keeps them for its whole life, and every callback here refers back to
    its future's owner (a Ticket's bound methods, the engine host's answer closures), so each finished
    request left a reference cycle of about 40 objects (its tickets, work item, pixels' views, futures and
    their Conditions) that only a full collection frees. Under load at 1 image per request an H200
    engine's full collections found 70-165k objects each, 78-87% of them this garbage, and stopped
    every thread of the process for 63-165 ms.
    Without the cycles, reference counting frees a request's objects as it ends."""

    def _invoke_callbacks(self) -> None:  # (stable since 3.2: set_result, set_exception and cancel call it)
        super()._invoke_callbacks()
        self._done_callbacks = []  # a callback added later is called at once and never stored


@dataclass(eq=False)  # identity semantics: payloads may be arrays, and two items are never "equal"
class WorkItem(Generic[P]):
    key: str  # store key; unique among queued + in-flight items
    payload: P  # opaque to the batcher (the engine's: decoded pixels + geometry)
    tokens: int  # output tokens this image adds to a step
    future: Future  # the item's own result; tickets mirror it. Set only by `finish` or a drop.
    waiters: int  # tickets still interested; 0 while queued means drop it
    enqueued_at: float  # batcher clock; max_wait is measured from here
    priority: int = 0  # its most urgent waiter's (a more urgent join moves it up): its level in the queue
    due: Due = (0.0, 0.0)  # its order in the queue (service/priority.py)


@dataclass
class Batch(Generic[P]):
    items: list[WorkItem[P]]  # FIFO order, all now in flight
    tokens: int  # sum of items' tokens; > max_batch_tokens only for a single oversize item
    closed_by: CloseReason


class Part(NamedTuple):
    """One step's share of an item split across steps (a video over the token budget: the step loop splits
    it at temporal groups, the writer joins the parts into one entry)."""

    index: int  # this step's place among the item's steps, from 0
    count: int  # the item's steps in all
    error: BaseException | None = None  # this part failed to launch (then it comes without a Launched)


@dataclass
class BatcherStats:
    submitted: int = 0  # accepted submits (tickets issued), coalesced ones included
    coalesced: int = 0  # submits that joined a queued or in-flight item
    dropped: int = 0  # items removed before running because every waiter had gone
    rejected: int = 0  # submits refused by admission (Overloaded / 429)
    shed: int = 0  # queued items answered 429 to make room for more urgent work
    expired: int = 0  # waiters answered 504: their deadline passed while their item was queued
    batches: int = 0  # batches handed to the step loop


@dataclass
class Waiting:
    """What waits for a step, per priority level: the autoscaling signal (metrics.py exports it)."""

    images: dict[int, int]  # priority -> images queued or holding a queue place (being decoded)
    tokens: dict[int, int]  # priority -> their output tokens
    oldest_s: float  # how long the longest-waiting of them has waited (0: none)


class Ticket(Generic[P]):
    """One waiter's handle on a (possibly shared) work item.

    `future` is this waiter's own future, not the item's: it mirrors the item's result or error.
    NOTE: per-waiter futures are deliberate. `asyncio.wrap_future(ticket.future)` cancels the
    concurrent future when the awaiting task is cancelled (client disconnected); with one shared
    future that would cancel every other waiter of a coalesced item too. Here a cancelled ticket
    future only releases this waiter, the same as `cancel()`.
    """

    def __init__(self, batcher: Batcher[P], item: WorkItem[P], coalesced: bool):
        self.future: Future = _Future()
        self.coalesced = coalesced  # True if this submit joined an item already queued or in flight
        self._batcher = batcher
        self._item = item
        self._gone = False  # this waiter no longer counts in its item's waiters (cancelled, or past its deadline)

    @property
    def payload(self) -> P:
        """The payload of the item this ticket waits on (for a joined item: the first submitter's)."""
        return self._item.payload

    @property
    def work_future(self) -> Future:
        """The shared item's own future: done once the item is finished (after its step staged and
        stored it) or dropped unstaged. The engine process frees an image's pixel cell on it."""
        return self._item.future

    def cancel(self) -> None:
        """This waiter has gone. Dropping the item (if it was the last one and the item has not been
        scheduled) happens in the future's done-callback, so `future.cancel()` has the same effect.
        A no-op once the result has been delivered."""
        self.future.cancel()

    def _attach(self) -> None:
        # Called outside the batcher lock: if the item is already done, add_done_callback runs
        # _deliver right here, and a cancelled future's callback takes the batcher lock.
        self.future.add_done_callback(self._on_own_done)
        self._item.future.add_done_callback(self._deliver)

    def _on_own_done(self, fut: Future) -> None:
        if fut.cancelled():
            self._batcher._release(self)

    def _deliver(self, item_fut: Future) -> None:
        if self.future.done():  # this waiter already gone
            return
        try:
            if item_fut.cancelled():
                self.future.cancel()
            elif (exc := item_fut.exception()) is not None:
                self.future.set_exception(exc)
            else:
                self.future.set_result(item_fut.result())
        except InvalidStateError:
            pass  # lost a race with this waiter's cancel(): it no longer wants the result


class QueuePlace:
    """A queue place held for one image while it is decoded (admission before decode): counted like a
    queued image of `tokens` tokens until `Batcher.submit(..., place=)` uses it or `release()`."""

    def __init__(self, batcher: Batcher, tokens: int, priority: int, since: float):
        self.tokens = tokens  # the image's output tokens, as its header declares them
        self.priority, self.since = priority, since  # its request's; when it was granted (batcher clock)
        self._batcher = batcher
        self.held = True

    def release(self) -> None:
        """Give the place back (the image failed to decode, was a cache hit after all, or its request
        failed). A no-op once used or released."""
        with self._batcher._cond:
            self._batcher._unreserve_locked(self)


class Batcher(Generic[P]):
    """Bounded queue of work items in priority order; see the module docstring for the life of an item."""

    def __init__(self, limits: BatchLimits, clock: Callable[[], float] = time.monotonic):
        """`clock` stamps enqueue times, decides max-wait closing and deadlines; inject a fake one in tests.
        How long `next_batch` blocks for its own `timeout` is always real time (time.monotonic),
        so with a fake clock, poll with `next_batch(timeout=0)` after advancing it."""
        self.limits = limits
        self._clock = clock
        self._cond = threading.Condition()
        # Invariants (hold whenever the lock is free):
        # - a key is in at most one of _queued / _in_flight, so identical keys are encoded once;
        # - every queued item has waiters >= 1 (the last waiter leaving drops it at once, so a
        #   later submit of the key makes a fresh item rather than joining a cancelled one);
        # - every item in either map has a future that is not done (it is removed before its
        #   future is set or cancelled), so coalescing never joins a finished item;
        # - _queued is in priority order (service/priority.py's Levels), with O(1) removal on cancel.
        self._queued: Levels[WorkItem[P]] = Levels()
        self._in_flight: dict[str, WorkItem[P]] = {}
        self._places: dict[QueuePlace, None] = {}  # held QueuePlaces (images being decoded, admitted already), oldest first
        self._reserved_tokens = 0  # their tokens
        # Waiters with a deadline, a heap of (deadline, seq, ticket); an entry whose ticket has gone or whose item
        # has left the queue is dropped when it reaches the top (it holds at most a deadline's span of submits).
        self._deadlines: list[tuple[float, int, Ticket[P]]] = []
        self._seq = itertools.count()
        self._closed = False
        self._stats = BatcherStats()

    # ---- producer side (HTTP handlers) -----------------------------------------------------------
    def submit(self, key: str, payload: P, tokens: int, place: QueuePlace | None = None,
               urgency: Urgency = Urgency()) -> Ticket[P]:
        """Queue one image, or join the queued / in-flight item with the same key. Never blocks.

        With `place` (from `reserve`, before the image was decoded) the image was admitted then: the
        place is used up and the image is queued whatever the queue holds now. Without one, raises
        `Overloaded` when the queue is full (and shedding less urgent work would not make room). Raises
        `Unavailable` after `close()`. `urgency`: this waiter's priority and deadline (batcher clock).
        """
        assert tokens > 0, f"an image has at least one output token, got {tokens}: this is a bug"
        shed: list[WorkItem[P]] = []
        try:
            with self._cond:
                if place is not None:
                    self._unreserve_locked(place)
                if self._closed:
                    raise Unavailable("the encoder is shutting down and takes no new work; retry on another instance")
                item = self._queued.get(key) or self._in_flight.get(key)
                if item is not None:
                    # Joining adds no work, so it is admitted even when the queue is full.
                    ticket = self._join_locked(item, urgency)
                else:
                    if place is None:
                        shed = self._admit_locked(tokens, urgency.priority)
                    now = self._clock()
                    item = WorkItem(key, payload, tokens, _Future(), waiters=1, enqueued_at=now,
                                    priority=urgency.priority, due=due(now, urgency.priority, self.limits.priority_aging_s))
                    self._queued.add(item)
                    ticket = Ticket(self, item, coalesced=False)
                    self._track_locked(ticket, urgency)
                    # notify_all: there may be one step-loop thread per GPU, and the one that wakes
                    # must be able to compute the new max-wait deadline.
                    self._cond.notify_all()
                self._stats.submitted += 1
        finally:
            _shed(shed)
        ticket._attach()
        return ticket

    def reserve(self, tokens: int, urgency: Urgency = Urgency()) -> QueuePlace:
        """Admission before decode: hold a queue place for one image of `tokens` output tokens (from its
        header) while it is decoded. Raises `Overloaded` when the queue (queued images plus the places
        already held) is full and shedding less urgent queued work would not make room, `Unavailable` after
        `close()`. Use it up with `submit(..., place=)` or give it back with `release()`."""
        tokens = max(1, tokens)
        shed: list[WorkItem[P]] = []
        try:
            with self._cond:
                if self._closed:
                    raise Unavailable("the encoder is shutting down and takes no new work; retry on another instance")
                shed = self._admit_locked(tokens, urgency.priority)
                place = QueuePlace(self, tokens, urgency.priority, self._clock())
                self._places[place] = None
                self._reserved_tokens += tokens
                return place
        finally:
            _shed(shed)

    def _admit_locked(self, tokens: int, priority: int) -> list[WorkItem[P]]:
        """Make room for one more image of `tokens` tokens: nothing to do, or the queued items of strictly
        lower priority to shed for it (removed here; the caller answers them outside the lock). Raises
        Overloaded when even shedding all of those would not make room (then none is shed). Caller holds _cond."""
        depth = len(self._queued) + len(self._places)
        queued_tokens = self._queued.tokens + self._reserved_tokens
        max_tokens = self.limits.max_queue_tokens
        over_images = depth + 1 - self.limits.max_queue_images
        over_tokens = 0 if not depth or max_tokens is None else queued_tokens + tokens - max_tokens
        if over_images <= 0 and over_tokens <= 0:
            return []
        victims, images, freed = [], 0, 0
        for item in self._queued.least_urgent(priority):
            if images >= over_images and freed >= over_tokens:
                break
            victims.append(item)
            images, freed = images + 1, freed + item.tokens
        if images >= over_images and freed >= over_tokens:
            for item in victims:
                self._queued.remove(item)
            self._stats.shed += len(victims)
            self._cond.notify_all()
            return victims
        self._stats.rejected += 1
        if over_images > 0:
            raise Overloaded(
                f"encode queue is full ({depth} images waiting or being decoded, limit "
                f"{self.limits.max_queue_images}); retry in about {RETRY_AFTER_S}s",
                retry_after_s=RETRY_AFTER_S,
            )
        raise Overloaded(
            f"encode queue is full ({depth} images of {queued_tokens} tokens waiting or being decoded; this "
            f"image adds {tokens}, limit {max_tokens} tokens); retry in about {RETRY_AFTER_S}s",
            retry_after_s=RETRY_AFTER_S,
        )

    def _unreserve_locked(self, place: QueuePlace) -> None:
        if place.held:
            place.held = False
            del self._places[place]
            self._reserved_tokens -= place.tokens

    def join(self, key: str, urgency: Urgency = Urgency()) -> Ticket[P] | None:
        """Join the queued or in-flight item for `key`, if there is one (no payload needed).

        Lets the front end skip decoding an image whose identical twin is already being encoded.
        Returns None when there is nothing to join (or after `close()`): the caller then submits.
        """
        with self._cond:
            item = None if self._closed else (self._queued.get(key) or self._in_flight.get(key))
            if item is None:
                return None
            ticket = self._join_locked(item, urgency)
            self._stats.submitted += 1
        ticket._attach()
        return ticket

    def _join_locked(self, item: WorkItem[P], urgency: Urgency) -> Ticket[P]:
        item.waiters += 1
        self._stats.coalesced += 1
        ticket = Ticket(self, item, coalesced=True)
        if self._queued.get(item.key) is item:
            self._track_locked(ticket, urgency)
            moved = due(self._clock(), urgency.priority, self.limits.priority_aging_s)
            if moved < item.due:  # a more urgent waiter: the item goes up to its level, as if it arrived now
                self._queued.remove(item)
                item.priority, item.due = urgency.priority, moved
                self._queued.add(item)
                self._cond.notify_all()
        return ticket

    def _track_locked(self, ticket: Ticket[P], urgency: Urgency) -> None:
        if urgency.deadline is not None:
            heapq.heappush(self._deadlines, (urgency.deadline, next(self._seq), ticket))
            self._cond.notify_all()  # a waiting next_batch times the earliest deadline

    def _release(self, ticket: Ticket[P]) -> None:
        """One waiter has gone; drop its item if it was the last and the item has not run."""
        with self._cond:
            if ticket._gone:
                return
            drop = self._leave_locked(ticket)
        if drop:
            ticket._item.future.cancel()  # outside the lock: its callbacks take the lock (see Ticket)

    def _leave_locked(self, ticket: Ticket[P]) -> bool:
        """`ticket` no longer counts; True when its item was dropped for it (the caller cancels its future)."""
        ticket._gone = True
        item = ticket._item
        item.waiters -= 1
        assert item.waiters >= 0, f"more releases than waiters for {item.key!r}: this is a bug"
        drop = item.waiters == 0 and self._queued.get(item.key) is item
        if drop:
            self._queued.remove(item)
            self._stats.dropped += 1
            # A waiting next_batch may have been timing the dropped head, or draining to empty.
            self._cond.notify_all()
        return drop

    def _expire_locked(self) -> tuple[list[Ticket[P]], list[WorkItem[P]]]:
        """The waiters whose deadline has passed while their item is queued, and the items dropped for it
        (the caller answers both outside the lock)."""
        now = self._clock()
        tickets, dropped = [], []
        while self._deadlines:
            deadline, _, ticket = self._deadlines[0]
            live = not ticket._gone and self._queued.get(ticket._item.key) is ticket._item
            if live and deadline > now:
                break
            heapq.heappop(self._deadlines)
            if live:
                tickets.append(ticket)
                self._stats.expired += 1
                if self._leave_locked(ticket):
                    dropped.append(ticket._item)
        return tickets, dropped

    # ---- consumer side (step loop) ---------------------------------------------------------------
    def next_batch(self, timeout: float | None = None, busy: Callable[[], int] | None = None) -> Batch[P] | None:
        """Block until a batch closes and return it, its items now in flight.

        `busy` (from the step loop; called under the batcher's lock, so it must be cheap and must not
        call back into the batcher) says how many launched steps the device still runs. At 0 a non-empty
        batch closes at once; at 1 the batch waits for company, at most max_wait; at BACKLOG or more it
        waits past max_wait until fewer are in flight (or it is full). Call `wake()` when a step is done
        so a waiting batch re-checks. None: always as if one step runs. Waiters past their deadline are
        answered (504) before a batch is planned.

        Returns None when `timeout` seconds pass first (None: wait as long as needed), or once the
        batcher is closed and its queue is empty.
        """
        give_up_at = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._cond:
                batch, expired, dropped = self._next_locked(give_up_at, busy)
            if not expired:
                return batch
            for ticket in expired:  # outside the lock: the futures' callbacks run here
                try:
                    ticket.future.set_exception(expired_error("its step started"))
                except InvalidStateError:
                    pass  # cancelled meanwhile: it no longer wants an answer
            for item in dropped:
                item.future.cancel()

    def _next_locked(self, give_up_at: float | None, busy: Callable[[], int] | None
                     ) -> tuple[Batch[P] | None, list[Ticket[P]], list[WorkItem[P]]]:
        """next_batch's wait, under the lock: a batch (or None: timed out or drained), unless some waiters
        expired first (then those, and the items dropped for them, to answer outside the lock)."""
        while True:
            expired, dropped = self._expire_locked()
            if expired:
                return None, expired, dropped
            if not self._queued:
                if self._closed:
                    return None, [], []
                wait_s = None  # nothing to time: sleep until a submit or close notifies
            else:
                items, tokens, closed_by = self._plan()
                if closed_by is None and self._closed:
                    closed_by = "drain"
                steps = 1 if closed_by is not None or busy is None else busy()
                if closed_by is None and steps == 0:
                    closed_by = "idle"
                if closed_by is None:
                    # The batch closes max_wait after its OLDEST item.
                    wait_s = min(i.enqueued_at for i in items) + self.limits.max_wait_s - self._clock()
                    if wait_s <= 0 and steps < BACKLOG:
                        closed_by = "wait"
                    elif wait_s <= 0:  # held: re-check soon whether the backlog has gone
                        wait_s = BACKLOG_POLL_S
                if closed_by is not None:
                    return self._schedule(items, tokens, closed_by), [], []
            if self._deadlines:  # (the top may be stale: then this wakes early, which is harmless)
                until = max(0.0, self._deadlines[0][0] - self._clock())
                wait_s = until if wait_s is None else min(wait_s, until)
            if give_up_at is not None:
                left = give_up_at - time.monotonic()
                if left <= 0:
                    return None, [], []
                wait_s = left if wait_s is None else min(wait_s, left)
            # Spurious or early wake-ups are harmless: the loop re-plans from the current state.
            self._cond.wait(wait_s)

    def _plan(self) -> tuple[list[WorkItem[P]], int, CloseReason | None]:
        """The batch the queue's most urgent items would form now, and why it is already full (None: not yet)."""
        lim = self.limits
        items: list[WorkItem[P]] = []
        tokens = 0
        for item in self._queued.ordered():
            # The first item is always taken, so an image bigger than the budget runs alone.
            if items and tokens + item.tokens > lim.max_batch_tokens:
                return items, tokens, "tokens"
            items.append(item)
            tokens += item.tokens
            if len(items) == lim.max_batch_images:
                return items, tokens, "images"
            if tokens >= lim.max_batch_tokens:
                return items, tokens, "tokens"  # no further item (tokens >= 1) could fit
        return items, tokens, None

    def _schedule(self, items: list[WorkItem[P]], tokens: int, closed_by: CloseReason) -> Batch[P]:
        for item in items:
            # NOTE: side effects stay outside the asserts, which `python -O` strips.
            queued = self._queued.get(item.key) is item
            assert queued, "planned item not in the queue: this is a bug"
            self._queued.remove(item)
            # RUNNING: from here the item's future can no longer be cancelled, only finished.
            running = item.future.set_running_or_notify_cancel()
            assert running, f"queued item {item.key!r} was cancelled: this is a bug"
            self._in_flight[item.key] = item
        self._stats.batches += 1
        if self._queued:
            self._cond.notify_all()  # another step-loop thread may take the rest
        return Batch(items=items, tokens=tokens, closed_by=closed_by)

    def finish(self, item: WorkItem[P], result: object = None, error: BaseException | None = None) -> None:
        """Report an in-flight item: resolve every waiter with `result`, or with `error` if given.

        Call after the embeddings are in the store: the key leaves the in-flight map first, so a
        later submit of it makes a new item, and the caller's store check makes that a cache hit.
        """
        with self._cond:
            # Finishing twice (or an item never handed out) is a runner bug, not something to absorb.
            in_flight = self._in_flight.get(item.key) is item
            assert in_flight, f"finish({item.key!r}) of an item not in flight: this is a bug"
            del self._in_flight[item.key]
        # Outside the lock: setting the future runs every waiter's callback.
        if not item.future.done():
            if error is not None:
                item.future.set_exception(error)
            else:
                item.future.set_result(result)

    def wake(self) -> None:
        """The device went idle (or anything else a waiting `next_batch` should re-check)."""
        with self._cond:
            self._cond.notify_all()

    # ---- lifecycle and introspection ---------------------------------------------------------------
    def close(self) -> None:
        """Graceful drain: refuse new submits; `next_batch` hands out what is queued at once, then None."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    @property
    def closed(self) -> bool:
        return self._closed

    def queue_depth(self) -> int:
        """Images queued and not yet scheduled (admission counts these plus the held queue places)."""
        with self._cond:
            return len(self._queued)

    def reserved(self) -> int:
        """Queue places held by images being decoded (QueuePlaces not yet used or released)."""
        with self._cond:
            return len(self._places)

    def in_flight(self) -> int:
        """Items handed out by next_batch and not yet finished."""
        with self._cond:
            return len(self._in_flight)

    def waiting(self) -> Waiting:
        """What waits for a step (queued, or holding a queue place while decoded), per priority level. A scan
        of the queue (at most max_queue_images items): for a scrape, not for every request."""
        with self._cond:
            now = self._clock()
            images: dict[int, int] = {}
            tokens: dict[int, int] = {}
            oldest = now
            for level, queued in self._queued.by_level().items():
                images[level] = len(queued)
                tokens[level] = sum(item.tokens for item in queued)
                oldest = min([oldest, *(item.enqueued_at for item in queued)])
            for place in self._places:
                images[place.priority] = images.get(place.priority, 0) + 1
                tokens[place.priority] = tokens.get(place.priority, 0) + place.tokens
            if self._places:
                oldest = min(oldest, next(iter(self._places)).since)
            return Waiting(images, tokens, max(0.0, now - oldest))

    @property
    def stats(self) -> BatcherStats:
        """A consistent snapshot of the counters."""
        with self._cond:
            return replace(self._stats)


def _shed(items: list[WorkItem]) -> None:
    """Answer the items shed for more urgent work (outside the batcher's lock: their callbacks run here)."""
    for item in items:
        item.future.set_exception(Overloaded(
            f"shed from a full encode queue for more urgent work (priority {item.priority} is less urgent); retry "
            f"in about {RETRY_AFTER_S}s, or send it with a lower priority value", retry_after_s=RETRY_AFTER_S))
