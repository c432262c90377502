"""The batcher as plain Python: a fake clock for max-wait, real threads for coalescing and stress."""

from __future__ import annotations

import asyncio
import random
import subprocess
import sys
import threading
import time

import pytest

from service.engine.batcher import BACKLOG, BACKLOG_POLL_S, Batch, Batcher, BatchLimits
from service.errors import BackendError, DeadlineExceeded, Overloaded, Unavailable
from service.priority import Urgency


class FakeClock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, s: float) -> None:
        self.t += s


def make(max_batch_tokens=100, max_batch_images=64, max_wait_s=1.0, max_queue_images=512, clock=None,
         max_queue_tokens=None):
    limits = BatchLimits(max_batch_tokens, max_batch_images, max_wait_s, max_queue_images, max_queue_tokens)
    return Batcher(limits, clock=clock or FakeClock())


def keys(batch: Batch) -> list[str]:
    return [it.key for it in batch.items]


def run_in_thread(fn, *args):
    """Run fn in a thread; return a getter that joins (with a deadline) and returns its result."""
    box = {}

    def target():
        box["value"] = fn(*args)

    t = threading.Thread(target=target, daemon=True)
    t.start()

    def get(timeout=5.0):
        t.join(timeout)
        assert not t.is_alive(), "thread did not finish in time"
        return box["value"]

    return get


def wait_until_blocked(b: Batcher, threads: int = 1, timeout: float = 5.0) -> None:
    """Until `threads` threads wait on the batcher's condition (blocked inside next_batch): what the test
    does next must be what wakes them, not something they find on entry. CPython's Condition keeps its
    waiters in `_waiters`."""
    deadline = time.monotonic() + timeout
    while len(b._cond._waiters) < threads:
        assert time.monotonic() < deadline, "the consumer never blocked in next_batch"
        time.sleep(0.001)


# ---- closing rules ----------------------------------------------------------------------------------
def test_token_budget_closes_batch():
    clock = FakeClock()
    b = make(max_batch_tokens=100, max_wait_s=1.0, clock=clock)
    for k in "abc":
        b.submit(k, None, 40)
    first = b.next_batch(timeout=0)  # no clock advance: it closed on tokens, not on wait
    assert keys(first) == ["a", "b"] and first.tokens == 80 and first.closed_by == "tokens"
    assert b.queue_depth() == 1 and b.in_flight() == 2
    # The lone 40 fits in the budget, so it waits for max_wait (measured from its own enqueue).
    assert b.next_batch(timeout=0) is None
    clock.advance(1.0)
    second = b.next_batch(timeout=0)
    assert keys(second) == ["c"] and second.tokens == 40 and second.closed_by == "wait"
    assert b.stats.batches == 2


def test_exactly_full_budget_closes_without_waiting():
    b = make(max_batch_tokens=100)
    b.submit("a", None, 50)
    assert b.next_batch(timeout=0) is None
    b.submit("b", None, 50)
    batch = b.next_batch(timeout=0)
    assert keys(batch) == ["a", "b"] and batch.closed_by == "tokens"


def test_oversize_item_runs_alone():
    b = make(max_batch_tokens=100)
    b.submit("small", None, 30)
    b.submit("huge", None, 150)
    b.submit("tail", None, 10)
    first = b.next_batch(timeout=0)
    assert keys(first) == ["small"] and first.closed_by == "tokens"
    second = b.next_batch(timeout=0)
    assert keys(second) == ["huge"] and second.tokens == 150 and second.closed_by == "tokens"
    assert b.next_batch(timeout=0) is None  # "tail" (10) still waits for company
    assert b.queue_depth() == 1


def test_max_images_closes_batch():
    b = make(max_batch_tokens=10_000, max_batch_images=3)
    for i in range(7):
        b.submit(f"k{i}", None, 1)
    batches = [b.next_batch(timeout=0), b.next_batch(timeout=0)]
    assert [keys(x) for x in batches] == [["k0", "k1", "k2"], ["k3", "k4", "k5"]]
    assert all(x.closed_by == "images" for x in batches)
    assert b.next_batch(timeout=0) is None


def test_max_wait_measured_from_oldest_item():
    clock = FakeClock()
    b = make(max_batch_tokens=100, max_wait_s=1.0, clock=clock)
    b.submit("a", None, 10)
    clock.advance(0.5)
    b.submit("b", None, 10)
    clock.advance(0.49)
    assert b.next_batch(timeout=0) is None  # 0.99 s after "a": not yet
    clock.advance(0.01)
    batch = b.next_batch(timeout=0)  # exactly max_wait after "a" (only 0.5 after "b")
    assert keys(batch) == ["a", "b"] and batch.tokens == 20 and batch.closed_by == "wait"


def test_next_batch_real_wait_does_not_return_early():
    # Real clock: a lone item under budget comes back after max_wait, not before, and the waiting
    # consumer collects an item that arrives meanwhile.
    b = make(max_batch_tokens=100, max_wait_s=0.3, clock=time.monotonic)
    t0 = time.monotonic()
    b.submit("a", None, 10)
    get = run_in_thread(b.next_batch, 5.0)
    wait_until_blocked(b)  # waiting for max_wait, with "a" alone
    b.submit("b", None, 10)
    batch = get()
    elapsed = time.monotonic() - t0
    assert 0.3 <= elapsed < 2.0, elapsed
    assert keys(batch) == ["a", "b"] and batch.closed_by == "wait"


def test_blocked_next_batch_wakes_on_arrival():
    # max_wait is huge: only the notify from submit can end the wait in time.
    b = make(max_batch_tokens=100, max_wait_s=60.0, clock=time.monotonic)
    get = run_in_thread(b.next_batch, 10.0)
    wait_until_blocked(b)  # on an empty queue
    t0 = time.monotonic()
    b.submit("a", None, 60)
    b.submit("b", None, 60)  # "a" + "b" > budget: the batch [a] closes now
    batch = get()
    assert time.monotonic() - t0 < 2.0
    assert keys(batch) == ["a"] and batch.closed_by == "tokens"


def test_idle_device_closes_a_batch_at_once_busy_device_waits_for_company():
    # Continuous batching: nothing is gained by holding a lone image while the device has nothing to do.
    clock = FakeClock()
    b = make(max_batch_tokens=100, max_wait_s=1.0, clock=clock)
    device = {"busy": True}
    b.submit("a", None, 10)
    assert b.next_batch(timeout=0, busy=lambda: device["busy"]) is None  # busy: "a" waits for company
    b.submit("b", None, 10)
    device["busy"] = False
    batch = b.next_batch(timeout=0, busy=lambda: device["busy"])
    assert keys(batch) == ["a", "b"] and batch.closed_by == "idle"
    # Busy all along: max_wait still bounds the wait.
    device["busy"] = True
    b.submit("c", None, 10)
    clock.advance(1.0)
    batch = b.next_batch(timeout=0, busy=lambda: device["busy"])
    assert keys(batch) == ["c"] and batch.closed_by == "wait"


def test_wake_ends_a_wait_when_the_device_goes_idle():
    # max_wait is huge: only wake() (what the writer calls once a step is done) can end the wait in time.
    b = make(max_batch_tokens=100, max_wait_s=60.0, clock=time.monotonic)
    device = {"busy": True}
    b.submit("a", None, 10)
    get = run_in_thread(b.next_batch, 10.0, lambda: device["busy"])
    wait_until_blocked(b)  # "a" waits for company while the device is busy
    device["busy"] = False
    t0 = time.monotonic()
    b.wake()
    batch = get()
    assert time.monotonic() - t0 < 2.0
    assert keys(batch) == ["a"] and batch.closed_by == "idle"


def test_a_due_batch_is_held_while_a_launched_step_waits_behind_the_running_one():
    # BACKLOG steps in flight: one runs, one waits. A batch closed on max_wait now would only queue behind them.
    clock = FakeClock()
    b = make(max_batch_tokens=100, max_batch_images=3, max_wait_s=1.0, clock=clock)
    device = {"steps": BACKLOG}
    b.submit("a", None, 10)
    clock.advance(5.0)  # far past max_wait
    assert b.next_batch(timeout=0, busy=lambda: device["steps"]) is None  # held: it grows instead
    b.submit("b", None, 10)
    device["steps"] = BACKLOG - 1  # the waiting step started: the due batch closes on max_wait
    batch = b.next_batch(timeout=0, busy=lambda: device["steps"])
    assert keys(batch) == ["a", "b"] and batch.closed_by == "wait"
    # Held or not, a full batch closes at once.
    device["steps"] = BACKLOG + 1
    for k in "cdef":
        b.submit(k, None, 10)
    batch = b.next_batch(timeout=0, busy=lambda: device["steps"])
    assert keys(batch) == ["c", "d", "e"] and batch.closed_by == "images"
    # The rest is held (past max_wait), then closes at once when the device is idle.
    clock.advance(5.0)
    assert b.next_batch(timeout=0, busy=lambda: device["steps"]) is None
    device["steps"] = 0
    batch = b.next_batch(timeout=0, busy=lambda: device["steps"])
    assert keys(batch) == ["f"] and batch.closed_by == "idle"


def test_a_held_batch_closes_when_the_backlog_goes_without_a_wake():
    # The writer's wake() comes after it has caught up; the held batch polls the device meanwhile.
    b = make(max_batch_tokens=100, max_wait_s=0.0, clock=time.monotonic)
    device = {"steps": BACKLOG}
    checks = []  # when the held batch asked the device

    def busy():
        checks.append(time.monotonic())
        return device["steps"]

    b.submit("a", None, 10)
    get = run_in_thread(b.next_batch, 10.0, busy)
    deadline = time.monotonic() + 10
    while len(checks) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    held = list(checks)
    device["steps"] = 1  # no wake(): the poll must find it
    t0 = time.monotonic()
    batch = get()
    assert time.monotonic() - t0 < 2.0
    assert keys(batch) == ["a"] and batch.closed_by == "wait"
    # Re-checked while held, each check a BACKLOG_POLL_S wait after the one before: a poll, not a spin. (A
    # loaded machine may wake the thread late, never early; half the interval allows the timer's rounding.)
    assert len(held) >= 4
    assert min(b - a for a, b in zip(held, held[1:])) >= BACKLOG_POLL_S / 2


def test_next_batch_timeout_returns_none():
    b = make(clock=time.monotonic)
    t0 = time.monotonic()
    assert b.next_batch(timeout=0.05) is None
    assert 0.05 <= time.monotonic() - t0 < 2.0


def test_fifo_order_across_batches():
    b = make(max_batch_tokens=100, max_batch_images=4)
    sizes = [30, 70, 20, 20, 20, 20, 90, 5, 5]
    order = [f"k{i}" for i in range(len(sizes))]
    for k, n in zip(order, sizes):
        b.submit(k, None, n)
    b.close()  # drain: everything comes out now, in order
    seen = []
    while (batch := b.next_batch(timeout=0)) is not None:
        assert batch.tokens <= 100 and len(batch.items) <= 4
        seen += keys(batch)
    assert seen == order


# ---- coalescing -------------------------------------------------------------------------------------
def test_twenty_concurrent_identical_submits_encode_once():
    b = make(clock=time.monotonic)
    barrier = threading.Barrier(20)
    tickets = [None] * 20

    def client(i):
        barrier.wait()
        tickets[i] = b.submit("same-image", f"payload{i}", 196)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(5)
    assert b.queue_depth() == 1
    assert sum(not t.coalesced for t in tickets) == 1
    st = b.stats
    assert (st.submitted, st.coalesced) == (20, 19)

    b.close()
    batch = b.next_batch(timeout=0)
    assert len(batch.items) == 1 and batch.items[0].waiters == 20
    assert not any(t.future.done() for t in tickets)
    b.finish(batch.items[0], result="embedding-0")
    assert [t.future.result(timeout=1) for t in tickets] == ["embedding-0"] * 20
    assert b.next_batch(timeout=0) is None


def test_submit_joins_in_flight_item_and_new_item_after_finish():
    b = make(max_batch_tokens=10)
    t1 = b.submit("k", None, 10)
    (item,) = b.next_batch(timeout=0).items
    t2 = b.submit("k", None, 10)  # in flight: join, do not queue a second encode
    assert t2.coalesced and b.queue_depth() == 0 and b.in_flight() == 1
    b.finish(item, result="r1")
    assert t1.future.result(0) == t2.future.result(0) == "r1"
    assert b.in_flight() == 0
    t3 = b.submit("k", None, 10)  # finished: a fresh item (the caller's store check usually hits first)
    assert not t3.coalesced and b.queue_depth() == 1


class _Payload:
    """A payload that can be watched for its end (the engine's holds a view of the image's pixels)."""


def test_a_finished_or_cancelled_request_leaves_no_reference_cycle():
    # Reference counting alone (the collector off) must free a request's ticket, work item, payload and
    # futures once nobody holds them: a cycle among them would wait for a full collection, which stops every
    # thread of the engine (bench/RESULTS.md, 2026-12-04, "the engine's garbage").
    import gc
    import weakref

    b = make(max_batch_tokens=10)
    gc.collect()
    gc.disable()
    try:
        answered = []
        payload = _Payload()
        t1, t2 = b.submit("k", payload, 10), b.submit("k", None, 10)  # one item, two waiters
        t1.future.add_done_callback(lambda f: answered.append(f.result()))  # as the engine host answers
        t2.work_future.add_done_callback(lambda f: answered.append("pixels freed"))
        (item,) = b.next_batch(timeout=0).items
        b.finish(item, result="r")
        assert answered == ["r", "pixels freed"] and t2.future.result(0) == "r"
        watched = [weakref.ref(x) for x in (t1, t2, item, payload, t1.future, t2.future, item.future)]
        del t1, t2, item, payload
        assert [w() for w in watched] == [None] * len(watched)
        # A waiter that cancels (its client went away) while its item is queued: the item is dropped.
        t3 = b.submit("q", _Payload(), 10)
        watched = [weakref.ref(x) for x in (t3, t3.future, t3.work_future, t3.payload)]
        t3.cancel()
        assert b.queue_depth() == 0
        del t3
        assert [w() for w in watched] == [None] * len(watched)
    finally:
        gc.enable()


def test_finish_error_reaches_every_waiter():
    b = make(max_batch_tokens=10)
    tickets = [b.submit("k", None, 10) for _ in range(3)]
    (item,) = b.next_batch(timeout=0).items
    err = BackendError("step 7 failed: CUDA out of memory")
    b.finish(item, error=err)
    for t in tickets:
        with pytest.raises(BackendError, match="step 7 failed"):
            t.future.result(0)


def test_finish_twice_is_a_bug():
    b = make(max_batch_tokens=10)
    b.submit("k", None, 10)
    (item,) = b.next_batch(timeout=0).items
    b.finish(item, result=1)
    with pytest.raises(AssertionError, match="not in flight"):
        b.finish(item, result=2)


# ---- admission --------------------------------------------------------------------------------------
def test_admission_rejects_when_queue_full():
    b = make(max_batch_tokens=100, max_batch_images=2, max_queue_images=3)
    for k in "abc":
        b.submit(k, None, 10)
    with pytest.raises(Overloaded) as exc:
        b.submit("d", None, 10)
    assert exc.value.retry_after_s >= 1
    assert "queue is full" in exc.value.message and "3 images" in exc.value.message
    assert b.stats.rejected == 1 and b.queue_depth() == 3
    # Joining queued work adds none, so it is admitted even when full.
    assert b.submit("a", None, 10).coalesced
    # Scheduling frees room.
    assert keys(b.next_batch(timeout=0)) == ["a", "b"]
    assert not b.submit("d", None, 10).coalesced
    assert b.stats.rejected == 1 and b.queue_depth() == 2


def test_admission_bounds_the_queued_tokens_so_the_queued_pixels():
    b = make(max_batch_tokens=100, max_batch_images=64, max_queue_tokens=250)
    huge = b.submit("huge", None, 400)  # alone in the queue: admitted whatever its size
    with pytest.raises(Overloaded) as exc:
        b.submit("a", None, 10)  # 400 queued + 10 > 250
    assert "400 tokens waiting" in exc.value.message and "limit 250 tokens" in exc.value.message
    assert exc.value.retry_after_s >= 1 and b.stats.rejected == 1
    huge.cancel()  # dropped unscheduled: its tokens leave the count
    for k in "abc":
        b.submit(k, None, 80)  # 240 queued
    with pytest.raises(Overloaded):
        b.submit("d", None, 20)
    assert b.submit("a", None, 80).coalesced  # joining adds no work
    assert keys(b.next_batch(timeout=0)) == ["a"]  # 80 + 80 > the 100-token step budget
    b.submit("d", None, 90)  # scheduling freed 80: 250 queued now
    with pytest.raises(Overloaded):
        b.submit("e", None, 1)
    assert b.stats.rejected == 3 and b.queue_depth() == 3
    with pytest.raises(ValueError, match="max_queue_tokens"):
        BatchLimits(1, 1, 0.0, 1, 0)


def test_queue_places_admit_before_decode_and_count_until_used_or_released():
    b = make(max_batch_tokens=100, max_queue_images=3, max_queue_tokens=250)
    b.submit("q", None, 50)
    r1 = b.reserve(100)  # being decoded: counted as if queued
    with pytest.raises(Overloaded) as exc:
        b.reserve(150)  # 50 queued + 100 held + 150 > 250
    assert "being decoded" in exc.value.message and b.stats.rejected == 1
    r2 = b.reserve(80)
    with pytest.raises(Overloaded):
        b.submit("x", None, 1)  # 3 images waiting or being decoded: a submit without a place is refused too
    assert b.reserved() == 2 and b.queue_depth() == 1
    # The queue filled meanwhile, but a reserved image was admitted already: its submit never fails.
    assert keys(b.next_batch(timeout=0, busy=lambda: False)) == ["q"]  # scheduled: room for one more
    b.submit("y", None, 60)
    t1 = b.submit("a", None, 120, place=r1)  # more tokens than its header said: still queued
    assert not t1.coalesced and b.reserved() == 1 and b.queue_depth() == 2
    r2.release()
    r2.release()  # idempotent
    assert b.reserved() == 0
    b.submit("a", None, 120, place=r2)  # a used-up place admits nothing new; joining needs none
    assert b.stats.coalesced == 1 and b.reserved() == 0
    # A place whose image turns out to be queued already (coalesced) is given back by the submit.
    r3 = b.reserve(10)
    assert b.submit("y", None, 60, place=r3).coalesced and b.reserved() == 0
    # An empty queue admits any one image, as submit does; close() refuses new places.
    b2 = make(max_queue_tokens=10)
    b2.reserve(10_000).release()
    b2.close()
    with pytest.raises(Unavailable):
        b2.reserve(1)


# ---- cancellation -----------------------------------------------------------------------------------
def test_cancel_before_scheduling_drops_item():
    b = make(max_batch_tokens=100)
    ta = b.submit("a", None, 10)
    tb = b.submit("b", None, 10)
    ta.cancel()
    assert ta.future.cancelled() and b.stats.dropped == 1 and b.queue_depth() == 1
    b.close()
    batch = b.next_batch(timeout=0)
    assert keys(batch) == ["b"] and batch.tokens == 10
    assert b.next_batch(timeout=0) is None
    b.finish(batch.items[0], result="rb")
    assert tb.future.result(0) == "rb"
    ta.cancel()  # idempotent
    assert b.stats.dropped == 1


def test_cancelled_key_can_be_submitted_again():
    b = make()
    t1 = b.submit("a", None, 10)
    t1.cancel()
    t2 = b.submit("a", None, 10)
    assert not t2.coalesced and not t2.future.done() and b.queue_depth() == 1


def test_cancel_one_of_two_coalesced_waiters_still_runs():
    b = make(max_batch_tokens=100)
    t1 = b.submit("k", None, 10)
    t2 = b.submit("k", None, 10)
    t1.cancel()
    assert t1.future.cancelled() and not t2.future.done()
    assert b.stats.dropped == 0 and b.queue_depth() == 1
    b.close()
    (item,) = b.next_batch(timeout=0).items
    assert item.waiters == 1
    b.finish(item, result="r")
    assert t2.future.result(0) == "r" and t1.future.cancelled()


def test_cancel_after_scheduling_does_not_drop():
    b = make(max_batch_tokens=10)
    t = b.submit("k", None, 10)
    (item,) = b.next_batch(timeout=0).items
    t.cancel()
    assert t.future.cancelled() and b.stats.dropped == 0 and b.in_flight() == 1
    b.finish(item, result="r")  # the runner still reports; nobody is listening
    assert b.in_flight() == 0


def test_cancel_after_result_is_a_noop():
    b = make(max_batch_tokens=10)
    t = b.submit("k", None, 10)
    (item,) = b.next_batch(timeout=0).items
    b.finish(item, result="r")
    t.cancel()
    assert not t.future.cancelled() and t.future.result(0) == "r"


def test_asyncio_task_cancel_releases_only_its_waiter():
    # asyncio.wrap_future cancels the concurrent future when the awaiting task is cancelled (the
    # client disconnected). That must release that waiter only, and drop the item if it was the last.
    b = make(max_batch_tokens=100)

    async def scenario():
        t1 = b.submit("shared", None, 10)
        t2 = b.submit("shared", None, 10)
        t3 = b.submit("alone", None, 10)
        # t2's waiter stays; it is checked below without a task (asyncio.run would cancel it on exit).
        tasks = [asyncio.ensure_future(asyncio.wrap_future(t.future)) for t in (t1, t3)]
        await asyncio.sleep(0)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return t1, t2, t3

    t1, t2, t3 = asyncio.run(scenario())
    assert t1.future.cancelled() and t3.future.cancelled() and not t2.future.done()
    assert b.stats.dropped == 1
    b.close()
    batch = b.next_batch(timeout=0)
    assert keys(batch) == ["shared"] and batch.items[0].waiters == 1
    b.finish(batch.items[0], result="r")
    assert t2.future.result(0) == "r"


# ---- shutdown ---------------------------------------------------------------------------------------
def test_close_drains_queue_then_returns_none_and_rejects_submits():
    b = make(max_batch_tokens=100, max_batch_images=2, max_wait_s=60.0)
    for k in "abc":
        b.submit(k, None, 10)
    b.close()
    first, second = b.next_batch(timeout=0), b.next_batch(timeout=0)
    assert keys(first) == ["a", "b"] and first.closed_by == "images"
    assert keys(second) == ["c"] and second.closed_by == "drain"
    assert b.next_batch() is None  # timeout=None must not block once closed and empty
    with pytest.raises(Unavailable, match="shutting down"):
        b.submit("d", None, 10)
    with pytest.raises(Unavailable):
        b.submit("a", None, 10)  # not even a join: no new waiters after close
    assert b.in_flight() == 3  # in-flight work is the step loop's to finish


def test_close_wakes_blocked_consumer():
    b = make(clock=time.monotonic)
    get = run_in_thread(b.next_batch, None)
    wait_until_blocked(b)
    b.close()
    assert get() is None


def test_limits_are_validated():
    with pytest.raises(ValueError, match="max_batch_tokens"):
        BatchLimits(0, 1, 0.0, 1)
    with pytest.raises(ValueError, match="max_wait_s"):
        BatchLimits(1, 1, -1.0, 1)


def test_batcher_imports_no_torch_or_numpy():
    code = "import sys, service.engine.batcher; bad = {'torch', 'numpy'} & set(sys.modules); assert not bad, bad"
    subprocess.run([sys.executable, "-c", code], check=True)


# ---- stress -----------------------------------------------------------------------------------------
def test_stress_producers_and_consumer():
    # A small queue and a consumer that takes ~1 ms per step, so admission, coalescing and
    # multi-image batches all happen; every assertion below holds for any interleaving.
    limits = BatchLimits(max_batch_tokens=512, max_batch_images=8, max_wait_s=0.002, max_queue_images=32)
    b = Batcher(limits)
    n_producers, per_producer = 4, 400
    records = []  # (key, ticket, we_cancelled)
    records_lock = threading.Lock()
    batches: list[Batch] = []
    finish_counts: dict[int, int] = {}
    consumer_error = []

    def producer(seed):
        rng = random.Random(seed)
        mine = []
        for _ in range(per_producer):
            k = rng.randrange(200)  # few enough keys that identical ones meet in the queue
            key = f"img{k}"
            tokens = 600 if k == 0 else 16 * (1 + k % 8)  # img0 is over the budget: runs alone
            try:
                t = b.submit(key, key, tokens)
            except Overloaded:
                time.sleep(0.0005)
                continue
            cancelled = rng.random() < 0.2
            if cancelled:
                t.cancel()
            mine.append((key, t, cancelled))
        with records_lock:
            records.extend(mine)

    def consumer():
        try:
            while (batch := b.next_batch(timeout=5.0)) is not None:
                batches.append(batch)
                time.sleep(0.001)  # the "step"
                for item in batch.items:
                    finish_counts[id(item)] = finish_counts.get(id(item), 0) + 1
                    if item.key == "img13":
                        b.finish(item, error=BackendError(f"bad {item.key}"))
                    else:
                        b.finish(item, result=f"emb:{item.payload}")
        except BaseException as e:  # surfaced to the main thread below
            consumer_error.append(e)

    cons = threading.Thread(target=consumer)
    cons.start()
    prods = [threading.Thread(target=producer, args=(s,)) for s in range(n_producers)]
    for p in prods:
        p.start()
    for p in prods:
        p.join(10)
    b.close()
    cons.join(10)
    assert not cons.is_alive() and not consumer_error, consumer_error

    # Every batch respects the limits; nothing ran twice; keys are unique within a batch.
    for batch in batches:
        assert 1 <= len(batch.items) <= limits.max_batch_images
        assert batch.tokens == sum(it.tokens for it in batch.items)
        assert batch.tokens <= limits.max_batch_tokens or len(batch.items) == 1
        assert len({it.key for it in batch.items}) == len(batch.items)
    assert all(n == 1 for n in finish_counts.values())
    assert b.queue_depth() == 0 and b.in_flight() == 0

    # Every waiter that did not leave got exactly one, correct, answer.
    resolved = 0
    for key, t, cancelled in records:
        assert t.future.done()
        if t.future.cancelled():
            assert cancelled, "a waiter that stayed was cancelled"
            continue
        resolved += 1
        if key == "img13":
            assert isinstance(t.future.exception(0), BackendError)
        else:
            assert t.future.result(0) == f"emb:{key}"
    assert resolved > 0

    st = b.stats
    assert st.submitted == len(records)
    assert st.submitted - st.coalesced == len(finish_counts) + st.dropped  # every new item ran or was dropped
    assert st.batches == len(batches)


# ---- priorities, aging, deadlines, shedding --------------------------------------------------------------
def make_aged(aging_s: float, clock: FakeClock, max_queue_images=512, max_batch_images=64, max_queue_tokens=None):
    limits = BatchLimits(100, max_batch_images, 1.0, max_queue_images, max_queue_tokens, priority_aging_s=aging_s)
    return Batcher(limits, clock=clock)


def drain_keys(b: Batcher) -> list[str]:
    out = []
    while (batch := b.next_batch(timeout=0, busy=lambda: 0)) is not None:
        out += keys(batch)
        for it in batch.items:
            b.finish(it, result=it.key)
    return out


@pytest.mark.parametrize("aging_s", [0.0, 10.0])
def test_the_most_urgent_level_goes_first_and_each_level_in_arrival_order(aging_s):
    clock = FakeClock()
    b = make_aged(aging_s, clock, max_batch_images=2)
    for k, p in [("bulk1", 5), ("bulk2", 5), ("chat1", 0), ("bulk3", 5), ("chat2", 0), ("neg", -1)]:
        b.submit(k, None, tokens=1, urgency=Urgency(p))
        clock.advance(0.01)
    assert keys(b.next_batch(timeout=0, busy=lambda: 0)) == ["neg", "chat1"]
    assert drain_keys(b) == ["chat2", "bulk1", "bulk2", "bulk3"]


def test_aging_bounds_how_late_more_urgent_work_may_still_overtake():
    """Priority 2 arriving at t=0 against priority 1: overtaken only by what arrives within (2 - 1) * aging_s."""
    clock = FakeClock(0.0)
    b = make_aged(1.0, clock)
    b.submit("old-bulk", None, tokens=1, urgency=Urgency(2))
    clock.advance(0.9)
    b.submit("early-chat", None, tokens=1, urgency=Urgency(1))  # within the bound: goes first
    clock.advance(0.2)
    b.submit("late-chat", None, tokens=1, urgency=Urgency(1))  # 1.1 s after: never before old-bulk
    clock.advance(50)  # however long they all wait, the order holds
    assert drain_keys(b) == ["early-chat", "old-bulk", "late-chat"]
    # Strict priority (aging 0): the bulk image waits behind every more urgent one.
    b = make_aged(0.0, clock)
    b.submit("old-bulk", None, tokens=1, urgency=Urgency(2))
    clock.advance(1000)
    b.submit("late-chat", None, tokens=1, urgency=Urgency(1))
    assert drain_keys(b) == ["late-chat", "old-bulk"]


def test_a_more_urgent_join_moves_its_item_up_as_if_it_arrived_then():
    clock = FakeClock()
    b = make_aged(10.0, clock)
    for k in ("a", "b", "c"):
        b.submit(k, None, tokens=1, urgency=Urgency(5))
    b.submit("chat", None, tokens=1, urgency=Urgency(0))
    clock.advance(1)
    joined = b.join("c", Urgency(0))
    assert joined is not None and joined.coalesced
    assert b.join("a", Urgency(9)) is not None  # less urgent: a stays where it is
    assert drain_keys(b) == ["chat", "c", "a", "b"]
    assert joined.future.result(timeout=1) == "c"


def test_a_waiter_past_its_deadline_is_answered_504_and_its_item_never_runs():
    clock = FakeClock()
    b = make_aged(10.0, clock)
    late = b.submit("late", None, tokens=1, urgency=Urgency(0, deadline=clock() + 1))
    kept = b.submit("kept", None, tokens=1, urgency=Urgency(0, deadline=clock() + 5))
    clock.advance(2)
    batch = b.next_batch(timeout=0, busy=lambda: 0)
    assert keys(batch) == ["kept"]
    err = late.future.exception(timeout=1)
    assert isinstance(err, DeadlineExceeded) and err.code == "deadline_exceeded" and err.status == 504
    assert "before its step started" in err.message
    assert late.work_future.cancelled()  # dropped: the engine host gives its pixels back on this
    assert b.stats.expired == 1 and b.stats.dropped == 1
    clock.advance(10)  # in flight: a deadline bounds waiting only, so it is answered
    b.finish(batch.items[0], result="ok")
    assert kept.future.result(timeout=1) == "ok"


def test_each_waiter_of_a_shared_item_expires_on_its_own():
    clock = FakeClock()
    b = make_aged(10.0, clock)
    first = b.submit("k", None, tokens=1, urgency=Urgency(0, deadline=clock() + 1))
    second = b.join("k", Urgency(0))  # no deadline
    third = b.join("k", Urgency(0, deadline=clock() + 1))
    third.cancel()  # gone before its deadline: not counted as expired
    clock.advance(2)
    batch = b.next_batch(timeout=0, busy=lambda: 0)
    assert keys(batch) == ["k"]
    assert isinstance(first.future.exception(timeout=1), DeadlineExceeded)
    b.finish(batch.items[0], result="v")
    assert second.future.result(timeout=1) == "v"
    assert b.stats.expired == 1 and b.stats.dropped == 0


def test_a_deadline_wakes_a_waiting_step_loop():
    b = make(max_wait_s=30.0, clock=time.monotonic)
    t = b.submit("k", None, tokens=1, urgency=Urgency(0, deadline=time.monotonic() + 0.1))
    get = run_in_thread(lambda: b.next_batch(timeout=3, busy=lambda: 1))  # a step runs: the batch waits 30 s
    started = time.monotonic()
    assert isinstance(t.future.exception(timeout=2), DeadlineExceeded)
    assert time.monotonic() - started < 1.5
    assert get() is None and b.queue_depth() == 0


def test_a_full_queue_sheds_its_least_urgent_newest_items_for_more_urgent_work():
    clock = FakeClock()
    b = make_aged(10.0, clock, max_queue_images=3)
    bulk = [b.submit(f"bulk{i}", None, tokens=1, urgency=Urgency(5)) for i in range(2)]
    bulk.append(b.submit("bulk9", None, tokens=1, urgency=Urgency(9)))
    with pytest.raises(Overloaded):
        b.submit("same", None, tokens=1, urgency=Urgency(9))  # not more urgent than any: refused, nothing shed
    assert b.stats.shed == 0 and b.stats.rejected == 1
    chat = b.submit("chat", None, tokens=1, urgency=Urgency(0))
    err = bulk[2].future.exception(timeout=1)
    assert isinstance(err, Overloaded) and err.status == 429 and "shed" in err.message
    place = b.reserve(1, Urgency(1))  # admission before decode sheds too: the newest of the least urgent level
    assert isinstance(bulk[1].future.exception(timeout=1), Overloaded)
    assert not bulk[0].future.done() and b.stats.shed == 2
    with pytest.raises(Overloaded):
        b.reserve(1, Urgency(5))
    b.submit("placed", None, tokens=1, place=place, urgency=Urgency(1))
    assert drain_keys(b) == ["chat", "placed", "bulk0"] and chat.future.result(timeout=1) == "chat"


def test_shedding_that_would_not_make_room_sheds_nothing():
    clock = FakeClock()
    b = make_aged(10.0, clock, max_queue_images=10, max_queue_tokens=10)
    low = b.submit("low", None, tokens=2, urgency=Urgency(5))
    b.submit("high", None, tokens=7, urgency=Urgency(0))
    with pytest.raises(Overloaded, match="tokens"):
        b.submit("big", None, tokens=4, urgency=Urgency(0))  # shedding `low` frees 2 of the 3 needed
    assert not low.future.done() and b.stats.shed == 0


def test_waiting_counts_queued_and_held_places_per_level():
    clock = FakeClock()
    b = make_aged(10.0, clock)
    b.submit("a", None, tokens=3, urgency=Urgency(0))
    clock.advance(2)
    b.submit("b", None, tokens=4, urgency=Urgency(7))
    b.reserve(5, Urgency(7))
    clock.advance(1)
    w = b.waiting()
    assert w.images == {0: 1, 7: 2} and w.tokens == {0: 3, 7: 9} and w.oldest_s == pytest.approx(3.0)
    drain_keys(b)
    clock.advance(4)
    w = b.waiting()
    assert w.images == {7: 1} and w.tokens == {7: 5} and w.oldest_s == pytest.approx(5.0)  # the place, held 5 s
