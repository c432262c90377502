"""Recycled pinned-host staging buffers, each slot fenced by its own CUDA event.

The step loop writes a step's inputs (uint8 pixels, the image table, ...) into host memory and the
GPU reads them later, asynchronously: by an H2D copy or in place through unified addressing. The host
runs ahead of the GPU, so a buffer the host is about to overwrite may still be queued for reading.
vLLM's encoder-only path crashed exactly there (pinned inputs recycled while the GPU still read
them). Here every slot carries one event, recorded right after the last device work that reads the
slot, and `acquire` waits on it before handing the slot back to the host for writing.

A slot's buffers are one `StepBuffers` (a step's typed inputs, each at its maximum size). Use, once
per step, from the one thread that owns the pool (it is not thread-safe):

    with pool.acquired() as slot:                # fence: waits until the GPU is done with this slot
        n = stage(slot.buffers.pixels)           # host writes; slice, never reallocate
        launch_preprocess(slot.buffers.pixels[:n], ...)   # GPU reads the slot (UVA or H2D)
        slot.release(keepalive=(images_table,))  # record the event after that last read
        launch_the_rest(...)                     # device work that no longer reads the slot

The slot is released inside the block, right after its last read, not at the block's end: later
work of the step must not delay its reuse. If the block raises before that, `acquired` releases it
on the way out: recording the event then is still correct, since it orders after whatever was
already enqueued, and a slot left held would fail every later step that comes round to it.

On CPU the same code runs with no-op events: CPU ops are synchronous, so by the time `release` is
called the work that read the slot has finished.

The other direction has a ring of its own, `OutputRing`: pinned buffers that each step's result is
copied into (D2H), acquired by the step loop and released by the store writer once it has read them.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, fields
from typing import Any, Generic, Protocol, TypeVar

import numpy as np
import torch

T = TypeVar("T")


class EventLike(Protocol):
    """What the pool needs from an event (torch.cuda.Event fits; tests inject fakes)."""

    def record(self, stream: Any = None) -> None: ...

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


class NullEvent:
    """The CPU event: work is synchronous, so every recorded point has already been reached."""

    def record(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


@dataclass(kw_only=True)
class StepBuffers(Generic[T]):
    """A step's inputs, one field per buffer, each allocated once at its maximum size: a staging slot's
    host tensors (`StepBuffers[torch.Tensor]`, pinned on CUDA), numpy views of them (`numpy()`), or
    their device mirrors. A step fills the leading rows of each: `StepSize.rows()` says how many.
    Shapes at capacity, in StepSize's terms:"""

    pixels: T  # [pixel_bytes] uint8: the step's images back to back, each [H, W, 3] row-major
    images: T  # [images, 4] int32: per image (byte offset into pixels, H, W, first patch row)
    pos_hw: T  # [patches, 2] int64: (row, col) of each patch, for the rotary embedding
    interp_idx: T  # [patches, 4] int64: taps into the learned square position table
    interp_w: T  # [patches, 4] float32: bilinear weights of those taps
    cu_seqlens: T  # [cu_seqlens] int32: patch offsets of each image, padded layout (see graphs.py)

    @staticmethod
    def allocate(capacity: StepSize, device: torch.device | str, *, pin: bool = False,
                 zeros: bool = False) -> StepBuffers[torch.Tensor]:
        """Every buffer at `capacity`, on `device` (pinned host memory with `pin`; zero-filled with `zeros`)."""
        rows = capacity.rows()
        new = torch.zeros if zeros else torch.empty

        def buf(n: int, row: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            return new((n, *row), dtype=dtype, device=device, pin_memory=pin)

        return StepBuffers(pixels=buf(rows.pixels, (), torch.uint8),
                           images=buf(rows.images, (4,), torch.int32),
                           pos_hw=buf(rows.pos_hw, (2,), torch.int64),
                           interp_idx=buf(rows.interp_idx, (4,), torch.int64),
                           interp_w=buf(rows.interp_w, (4,), torch.float32),
                           cu_seqlens=buf(rows.cu_seqlens, (), torch.int32))

    def values(self) -> tuple[T, ...]:
        """The buffers in field order (to pair a slot's buffers with the device mirrors, or with rows)."""
        return tuple(getattr(self, name) for name in _BUFFERS)

    def numpy(self: StepBuffers[torch.Tensor]) -> StepBuffers[np.ndarray]:
        """numpy views of host tensors (the same memory): staging is then plain numpy slice assignment."""
        return StepBuffers(**{name: getattr(self, name).numpy() for name in _BUFFERS})


_BUFFERS = tuple(f.name for f in fields(StepBuffers))


@dataclass(frozen=True, kw_only=True)
class StepSize:
    """How much of a StepBuffers one step fills, or (as a pool's capacity) how much each buffer holds."""

    pixel_bytes: int  # the images' pixels, back to back
    images: int
    patches: int
    cu_seqlens: int  # entries (a step always writes the whole padded layout)

    def rows(self) -> StepBuffers[int]:
        """The leading rows of each buffer this size covers: the one map from sizes to buffers, used to
        allocate them at capacity and to copy what a step filled."""
        return StepBuffers(pixels=self.pixel_bytes, images=self.images, pos_hw=self.patches,
                           interp_idx=self.patches, interp_w=self.patches, cu_seqlens=self.cu_seqlens)


@dataclass
class PoolStats:
    acquires: int = 0
    waits_blocked: int = 0  # acquires whose slot event had not fired yet when checked with query()
    wait_seconds: float = 0.0  # host time spent blocked in those waits


class Slot:
    """One set of staging buffers plus the event that says when the GPU is done reading them."""

    __slots__ = ("index", "buffers", "_event", "_keepalive", "_state")

    _FREE, _HELD, _IN_FLIGHT = "free", "held", "in_flight"

    def __init__(self, index: int, buffers: StepBuffers[torch.Tensor], event: EventLike):
        self.index = index
        self.buffers = buffers  # host tensors at max size, pinned on CUDA; allocated once
        self._event = event
        self._keepalive: tuple[Any, ...] = ()
        self._state = Slot._FREE

    def release(self, stream: Any = None, keepalive: Iterable[Any] = ()) -> None:
        """Mark the end of this slot's use by the current step.

        Call right after enqueuing the last device work that reads this slot's buffers. Records the
        slot's event on `stream` (None: the current stream), so the event fires once that work has
        run. `keepalive` holds objects the queued work still uses (device tensors it reads or writes,
        views of these buffers handed to a kernel by pointer): the caching allocators would otherwise
        hand their memory to someone else while the GPU still uses it, since a raw-pointer read (a
        CuPy kernel through data_ptr()) is invisible to them. They are dropped at the next `acquire`
        of this slot, after the event fired.
        """
        assert self._state == Slot._HELD, f"This is a bug: slot {self.index} released while {self._state}"
        self._event.record(stream)
        self._keepalive = tuple(keepalive)
        self._state = Slot._IN_FLIGHT


class StagingPool:
    """A ring of host staging slots, handed out round robin, each reused only after its event fired.

    Invariant: num_slots >= steps in flight + 1. The step loop holds one slot while it writes the
    next step's inputs, and every step the GPU has not finished still owns the slot it reads. With
    fewer slots `acquire` still stays correct (it waits), but the host then waits for the GPU on every
    step and the loop loses its overlap; with more, it only costs host memory. Correctness never
    depends on the depth: a slot is handed back to the host only after its event fired.

    `fence=False` skips the wait. It exists for tests only, to show that without the fence the host
    overwrites buffers the device has not read yet; never turn it off in the service.
    """

    def __init__(
        self,
        capacity: StepSize,
        num_slots: int,
        device: torch.device,
        fence: bool = True,
        event_factory: Callable[[], EventLike] | None = None,
    ):
        """Each of `num_slots` slots holds one StepBuffers of `capacity`, in host memory (pinned when
        `device` is a GPU, which reads them)."""
        assert num_slots >= 1, f"This is a bug: num_slots must be >= 1, got {num_slots}"
        device = torch.device(device)
        on_cuda = device.type == "cuda"
        if event_factory is None:
            # NOTE: blocking=False (the default) makes synchronize() spin; it releases the GIL, and a
            # spin wakes sooner than a blocking-sync event, which matters on a ~ms step.
            event_factory = torch.cuda.Event if on_cuda else NullEvent
        self.device = device
        self.capacity = capacity
        self.fence = fence
        self.stats = PoolStats()
        # Pinned memory: H2D copies run asynchronously at full speed, and kernels can read it in
        # place through unified addressing. Allocated here once; steps only slice.
        self._slots = [Slot(i, StepBuffers.allocate(capacity, "cpu", pin=on_cuda), event_factory())
                       for i in range(num_slots)]
        self._next = 0

    @property
    def num_slots(self) -> int:
        return len(self._slots)

    def slot(self, index: int) -> Slot:
        """Slot `index`, for set-up only (e.g. making numpy views of its buffers once); steps use acquire()."""
        return self._slots[index]

    def acquire(self) -> Slot:
        """Return the next slot (round robin), once the device has finished reading it."""
        slot = self._slots[self._next]
        self._next = (self._next + 1) % len(self._slots)
        assert slot._state != Slot._HELD, (
            f"This is a bug: slot {slot.index} acquired again before release() "
            f"(release it in a finally block, even when the step fails)"
        )
        if slot._state == Slot._IN_FLIGHT and self.fence:
            self._wait(slot)
        # The event fired (or the fence is off, in tests): the device no longer uses what the
        # previous step kept alive, so the references can go.
        slot._keepalive = ()
        slot._state = Slot._HELD
        self.stats.acquires += 1
        return slot

    @contextlib.contextmanager
    def acquired(self) -> Iterator[Slot]:
        """`acquire()` and the guarantee of a `release()`, in one place (see the module docstring): the
        block releases the slot at its fence point; if it raises first, the slot is released here."""
        slot = self.acquire()
        try:
            yield slot
        except BaseException:
            if slot._state == Slot._HELD:
                slot.release()
            raise
        assert slot._state != Slot._HELD, f"This is a bug: slot {slot.index} still held after its step (release it)"

    def drain(self) -> None:
        """Wait for every in-flight slot and drop its references (at shutdown, before freeing)."""
        for slot in self._slots:
            if slot._state == Slot._IN_FLIGHT:
                self._wait(slot)
                slot._keepalive = ()
                slot._state = Slot._FREE

    def _wait(self, slot: Slot) -> None:
        if slot._event.query():
            return
        self.stats.waits_blocked += 1
        t0 = time.perf_counter()
        slot._event.synchronize()
        self.stats.wait_seconds += time.perf_counter() - t0


@dataclass(eq=False)
class OutputLease:
    """Output buffer `index` of an OutputRing, held by one step from `acquire` to `release`."""

    index: int
    host: torch.Tensor  # [max_tokens, out_width] model dtype, pinned on CUDA: where the step's D2H copy lands
    done: EventLike  # the buffer's event: the step records it after that copy; readers wait on it
    ring: OutputRing

    def release(self) -> None:
        """Give the buffer back: every read of the step's rows has returned (store commits, clones)."""
        self.ring.release(self)


class OutputRing:
    """Pinned host buffers that steps' results are copied into, one per step in flight or being written.

    Invariant: a buffer belongs to at most one step, from `acquire` (the step loop, before it enqueues
    the D2H copy) until `release` (the writer, after every read of those rows has returned): the next
    owner's copy overwrites it. So `acquire` blocks while every buffer is held, and releasing a buffer
    twice, or through a lease that no longer holds it, is a bug. Depth: the staging pool's slot count.
    A step holds its buffer from launch until written, so the loop blocks here only when the writer is
    `depth` steps behind it: back-pressure, not a correctness condition (correctness never depends on
    the depth). Thread-safe: the loop thread acquires, the writer thread releases.
    """

    def __init__(self, depth: int, rows: int, width: int, dtype: torch.dtype, device: torch.device,
                 event_factory: Callable[[], EventLike] | None = None):
        """`depth` buffers of [rows, width] `dtype` in host memory, pinned when `device` is a GPU."""
        assert depth >= 1, f"This is a bug: an output ring needs a buffer, got depth {depth}"
        on_cuda = torch.device(device).type == "cuda"
        if event_factory is None:
            event_factory = torch.cuda.Event if on_cuda else NullEvent
        self._host = [torch.empty(rows, width, dtype=dtype, pin_memory=on_cuda) for _ in range(depth)]
        self._events = [event_factory() for _ in range(depth)]
        self._holders: list[OutputLease | None] = [None] * depth  # under _lock
        self._lock = threading.Lock()
        self._free: queue.Queue[int] = queue.Queue()
        for i in range(depth):
            self._free.put(i)

    @property
    def depth(self) -> int:
        return len(self._host)

    def acquire(self) -> OutputLease:
        """A free buffer for one step's result; blocks until the writer releases one if none is."""
        i = self._free.get()
        lease = OutputLease(index=i, host=self._host[i], done=self._events[i], ring=self)
        with self._lock:
            assert self._holders[i] is None, f"This is a bug: output buffer {i} handed out while still held"
            self._holders[i] = lease
        return lease

    def release(self, lease: OutputLease) -> None:
        """Give `lease`'s buffer back (see OutputLease.release)."""
        with self._lock:
            assert self._holders[lease.index] is lease, (
                f"This is a bug: output buffer {lease.index} released twice, or by a step that no longer holds it")
            self._holders[lease.index] = None
        self._free.put(lease.index)

    def held(self) -> int:
        """Buffers acquired and not yet released."""
        with self._lock:
            return sum(h is not None for h in self._holders)
