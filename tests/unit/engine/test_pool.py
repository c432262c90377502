"""The staging pool and its fence, on CPU, against a fake device that runs several steps behind.

The fake device is a worker thread executing launched work items in FIFO order. Like a GPU with a
deep queue, it lags: it runs item i only once LAG newer items have been launched, or when the host
blocks waiting on it (a fake event's synchronize), or when the producer has finished. That makes the
outcome deterministic, with no timing involved: without the fence the host always overwrites a slot
(it reuses a slot every NUM_SLOTS steps, and LAG >= NUM_SLOTS) before the device has read it; with
the fence it never can. Also the output ring: one step per buffer, blocking when all are held.
"""

from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Callable

import pytest
import torch

from service.engine.pool import NullEvent, OutputRing, StagingPool, StepSize

NUM_SLOTS = 3
LAG = 4  # >= NUM_SLOTS: without the fence, every slot is rewritten before its reader runs
STEPS = 200
TIMEOUT_S = 30.0  # only guards against a hang if the code under test is broken
TINY = StepSize(pixel_bytes=4, images=1, patches=1, cu_seqlens=2)  # for tests of the slots, not their buffers


class FakeDevice:
    """A FIFO "GPU" that executes launched callables in a thread, LAG launches behind the host."""

    def __init__(self, lag: int):
        self.lag = lag
        self._cv = threading.Condition()
        self._items: list[Callable[[], None]] = []
        self.executed = 0  # items executed so far (FIFO, so items [0, executed) are done)
        self._host_waiting = 0
        self._closed = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def launch(self, fn: Callable[[], None]) -> None:
        with self._cv:
            self._items.append(fn)
            self._cv.notify_all()

    def launched(self) -> int:
        with self._cv:
            return len(self._items)

    def wait_until_executed(self, count: int) -> None:
        """Host blocks until `count` items ran; while it waits, the device runs without lag."""
        with self._cv:
            self._host_waiting += 1
            self._cv.notify_all()
            try:
                ok = self._cv.wait_for(lambda: self.executed >= count or self._error, timeout=TIMEOUT_S)
                assert ok, "fake device hung"
            finally:
                self._host_waiting -= 1

    def close(self) -> None:
        """The producer is done: run everything left, then stop."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(TIMEOUT_S)
        assert not self._thread.is_alive(), "fake device hung"
        if self._error:
            raise self._error

    def _runnable(self) -> bool:
        i = self.executed
        if i >= len(self._items):
            return False
        return len(self._items) - (i + 1) >= self.lag or self._host_waiting > 0 or self._closed

    def _run(self) -> None:
        try:
            while True:
                with self._cv:
                    self._cv.wait_for(lambda: self._runnable() or (self._closed and self.executed == len(self._items)))
                    if not self._runnable():
                        return  # closed and drained
                    fn = self._items[self.executed]
                fn()  # outside the lock: the host keeps running (and writing) meanwhile
                with self._cv:
                    self.executed += 1
                    self._cv.notify_all()
        except BaseException as e:  # surfaced by close()
            with self._cv:
                self._error = e
                self._cv.notify_all()


class FakeEvent:
    """Fires once the device has executed everything launched before record()."""

    def __init__(self) -> None:
        self._device: FakeDevice | None = None
        self._target = 0

    def record(self, stream: FakeDevice | None = None) -> None:
        assert isinstance(stream, FakeDevice), "the step passes the fake device as its stream"
        self._device = stream
        self._target = stream.launched()

    def query(self) -> bool:
        return self._device is None or self._device.executed >= self._target

    def synchronize(self) -> None:
        if self._device is not None:
            self._device.wait_until_executed(self._target)


def run_steps(fence: bool) -> tuple[int, StagingPool]:
    """STEPS steps of: acquire, fill the slot with the step id, launch a reader, release."""
    device = FakeDevice(LAG)
    pool = StagingPool(
        StepSize(pixel_bytes=1, images=1, patches=128, cu_seqlens=2),  # pos_hw: [128, 2] int64, what it reads
        num_slots=NUM_SLOTS,
        device=torch.device("cpu"),
        fence=fence,
        event_factory=FakeEvent,
    )
    mismatches = []

    def reader(buf: torch.Tensor, step: int) -> Callable[[], None]:
        def work() -> None:
            # The "kernel": does the slot still hold what the host staged for this step?
            if not bool((buf == step).all()):
                mismatches.append(step)

        return work

    for step in range(STEPS):
        slot = pool.acquire()
        x = slot.buffers.pos_hw
        x.fill_(step)
        device.launch(reader(x, step))
        slot.release(device)
    device.close()
    return len(mismatches), pool


def test_fence_prevents_overwrite_while_device_reads():
    mismatches, pool = run_steps(fence=True)
    assert mismatches == 0
    assert pool.stats.acquires == STEPS
    # The device lags by LAG > NUM_SLOTS - 1 steps, so the fence must have blocked the host.
    assert pool.stats.waits_blocked > 0
    assert pool.stats.wait_seconds > 0


def test_without_fence_the_host_overwrites_slots_in_use():
    mismatches, pool = run_steps(fence=False)
    # Every step whose slot was reused before the device ran it, i.e. all but the last NUM_SLOTS.
    assert mismatches > 0
    assert mismatches == STEPS - NUM_SLOTS
    assert pool.stats.waits_blocked == 0


class ManualEvent:
    """Fires when the test says so; remembers what was alive when the pool waited on it."""

    def __init__(self) -> None:
        self.fired = threading.Event()
        self.on_wait: Callable[[], None] | None = None

    def record(self, stream=None) -> None:
        self.fired.clear()

    def query(self) -> bool:
        return self.fired.is_set()

    def synchronize(self) -> None:
        if self.on_wait:
            self.on_wait()
        assert self.fired.wait(TIMEOUT_S), "event never fired"


def test_keepalive_dropped_only_after_event_fired():
    events: list[ManualEvent] = []

    def factory() -> ManualEvent:
        events.append(ManualEvent())
        return events[-1]

    pool = StagingPool(TINY, num_slots=2, device=torch.device("cpu"), event_factory=factory)
    slot0 = pool.acquire()
    kept = torch.ones(8)
    ref = weakref.ref(kept)
    slot0.release(stream=None, keepalive=(kept,))
    del kept
    gc.collect()
    assert ref() is not None, "released slot must hold its keepalive until its event fires"

    pool.acquire().release()  # slot 1 comes and goes; slot 0's references stay
    gc.collect()
    assert ref() is not None

    alive_during_wait = []
    events[0].on_wait = lambda: alive_during_wait.append(ref() is not None)
    timer = threading.Timer(0.05, events[0].fired.set)
    timer.start()
    again = pool.acquire()  # slot 0 again: blocks until the timer fires the event
    timer.join()
    gc.collect()
    assert again.index == 0
    assert alive_during_wait == [True], "keepalive must survive while the pool waits on the event"
    assert ref() is None, "keepalive must be dropped once the event fired"
    assert pool.stats.waits_blocked == 1 and pool.stats.wait_seconds > 0


def test_cpu_pool_round_robin_same_buffers_not_pinned():
    capacity = StepSize(pixel_bytes=1024, images=8, patches=16, cu_seqlens=11)
    pool = StagingPool(capacity, num_slots=3, device=torch.device("cpu"))
    expected = {"pixels": ((1024,), torch.uint8), "images": ((8, 4), torch.int32), "pos_hw": ((16, 2), torch.int64),
                "interp_idx": ((16, 4), torch.int64), "interp_w": ((16, 4), torch.float32),
                "cu_seqlens": ((11,), torch.int32)}
    ptrs: dict[int, tuple[int, ...]] = {}
    order = []
    for step in range(9):
        slot = pool.acquire()
        order.append(slot.index)
        bufs = {name: getattr(slot.buffers, name) for name in expected}
        assert {k: (tuple(b.shape), b.dtype) for k, b in bufs.items()} == expected
        assert all(b.device.type == "cpu" and not b.is_pinned() for b in bufs.values())
        slot.buffers.pixels[: step + 1].fill_(step)  # steps slice the max-size buffer
        ptr = tuple(b.data_ptr() for b in slot.buffers.values())
        assert ptrs.setdefault(slot.index, ptr) == ptr, "buffers must be allocated once, not per step"
        slot.release()
    assert order == [0, 1, 2] * 3
    assert len({p for ptr in ptrs.values() for p in ptr}) == 3 * 6, "every slot has buffers of its own"
    assert pool.stats.acquires == 9 and pool.stats.waits_blocked == 0
    assert isinstance(pool.slot(0)._event, NullEvent)
    assert pool.slot(1).buffers.pixels.data_ptr() == ptrs[1][0]
    # The rows a step of some size fills, per buffer, in the buffers' field order (what the H2D copies use).
    used = StepSize(pixel_bytes=300, images=2, patches=12, cu_seqlens=11).rows()
    assert used.values() == (300, 2, 12, 12, 12, 11) and capacity.rows().pos_hw == 16
    views = pool.slot(0).buffers.numpy()
    views.images[1] = (5, 6, 7, 8)
    assert pool.slot(0).buffers.images[1].tolist() == [5, 6, 7, 8], "numpy views share the slot's memory"
    pool.drain()


def test_acquire_before_release_is_a_bug():
    pool = StagingPool(TINY, num_slots=1, device=torch.device("cpu"))
    slot = pool.acquire()
    with pytest.raises(AssertionError, match="before release"):
        pool.acquire()
    slot.release()
    with pytest.raises(AssertionError, match="released while"):
        slot.release()
    assert pool.acquire() is slot


def test_acquired_block_releases_a_slot_its_step_did_not_get_to_release():
    records: list[tuple[int, object]] = []

    class RecordingEvent(NullEvent):
        def __init__(self, index: int):
            self.index = index

        def record(self, stream=None) -> None:
            records.append((self.index, stream))

    made = iter(range(2))
    pool = StagingPool(TINY, num_slots=2, device=torch.device("cpu"),
                       event_factory=lambda: RecordingEvent(next(made)))
    with pytest.raises(RuntimeError, match="staging failed"):
        with pool.acquired():
            raise RuntimeError("staging failed")  # before the step's own release: the block releases
    with pytest.raises(RuntimeError, match="tower failed"):
        with pool.acquired() as slot:
            slot.release("compute stream")  # the fence point, then the step fails: not released twice
            raise RuntimeError("tower failed")
    assert records == [(0, None), (1, "compute stream")]
    for _ in range(2):  # both slots came back: every later step gets its slot
        with pool.acquired() as slot:
            slot.release()
    with pytest.raises(AssertionError, match="still held"):
        with pool.acquired():
            pass  # a step that never released its slot is a bug, not something to cover up
    assert pool.stats.acquires == 5


def test_output_ring_hands_each_buffer_to_one_step_at_a_time_and_blocks_when_all_are_held():
    made: list[ManualEvent] = []
    ring = OutputRing(2, rows=6, width=3, dtype=torch.bfloat16, device=torch.device("cpu"),
                      event_factory=lambda: made.append(ManualEvent()) or made[-1])
    a, b = ring.acquire(), ring.acquire()
    assert (a.index, b.index) == (0, 1) and ring.held() == 2
    assert a.host.shape == (6, 3) and a.host.dtype == torch.bfloat16 and not a.host.is_pinned()
    assert (a.done, b.done) == (made[0], made[1]) and a.host.data_ptr() != b.host.data_ptr()

    got: list = []
    waiter = threading.Thread(target=lambda: got.append(ring.acquire()))
    waiter.start()
    waiter.join(0.1)
    assert waiter.is_alive() and got == [], "every buffer is held: acquire must wait for the writer"
    b_ptr = b.host.data_ptr()
    b.release()
    waiter.join(TIMEOUT_S)
    assert not waiter.is_alive()
    (c,) = got
    assert c.index == 1 and c.host.data_ptr() == b_ptr and c.done is made[1], "the same buffer and event, reused"
    with pytest.raises(AssertionError, match="released twice, or by a step that no longer holds it"):
        b.release()  # b's step is done with it; c's step holds it now
    c.release()
    with pytest.raises(AssertionError, match="released twice"):
        c.release()
    a.release()
    assert ring.held() == 0 and {ring.acquire().index, ring.acquire().index} == {0, 1}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_pool_pinned_and_fenced():
    steps, n = 8, 1 << 20
    pool = StagingPool(StepSize(pixel_bytes=1, images=1, patches=n // 4, cu_seqlens=2), num_slots=2,
                       device=torch.device("cuda"))
    out = torch.empty(steps, n, device="cuda")
    for step in range(steps):
        slot = pool.acquire()
        assert all(b.is_pinned() for b in slot.buffers.values())
        x = slot.buffers.interp_w.view(-1)  # [n] float32
        x.fill_(step)
        # Keep the GPU far behind (~25 ms of sleep per step against ~1 ms of host work), so reusing
        # this slot has to wait (5M cycles was not always enough on an H200).
        torch.cuda._sleep(50_000_000)
        out[step].copy_(x, non_blocking=True)
        slot.release(keepalive=(out,))
    torch.cuda.synchronize()
    # Each copy read its slot before the host rewrote it: every row holds its own step id.
    expected = torch.arange(steps, device="cuda", dtype=torch.float32)[:, None].expand(steps, n)
    assert torch.equal(out, expected)
    assert pool.stats.waits_blocked > 0
    pool.drain()
