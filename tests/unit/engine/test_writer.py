"""The store writer on the CPU: a real store in tmp_path, a real batcher, launched steps made by hand
(a fake copy-done event where the device's would be). A failed write answers only its own image, and
the step's output buffer goes back to the ring whatever happens."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from service.engine.batcher import Batcher, BatchLimits
from service.engine.job import EncodeJob
from service.engine.pool import OutputRing
from service.errors import BackendError, Unavailable
from service.metrics import Metrics
from service.engine.runner import Launched
from service.store.directory import DirectoryStore
from service.store.format import read_embeddings
from service.engine.writer import Writer
from tests.support.live import metric

D, L = 8, 1  # out_hidden_size, deepstack levels
W = D * (1 + L)


class FakeEvent:
    """A copy-done event: `synchronize` logs itself, or raises as a device fault surfacing there would."""

    def __init__(self, log: list, fault: Exception | None = None, seconds: float = 0.0):
        self.log, self.fault, self.seconds = log, fault, seconds

    def synchronize(self) -> None:
        self.log.append("sync")
        time.sleep(self.seconds)  # the device still computing
        if self.fault is not None:
            raise self.fault


def _setup(tmp_path, threads: int = 3):
    store = DirectoryStore(tmp_path / "store", 1 << 30, model_id="m", out_hidden_size=D, deepstack_levels=L,
                           writers=threads)
    batcher = Batcher(BatchLimits(max_batch_tokens=10_000, max_batch_images=64, max_wait_s=0, max_queue_images=100))
    ring = OutputRing(4, rows=64, width=W, dtype=torch.float32, device=torch.device("cpu"))  # the steps' outputs
    writer = Writer(store, batcher, Metrics(), threads=threads)
    return store, batcher, writer, ring


def _launched(batcher: Batcher, ring: OutputRing, keys: list[str], done=None, seed: int = 0):
    """Submit `keys` (key i has i + 1 tokens), take them in flight as one batch, and make its launched step
    with its rows in a buffer of `ring`: (the batch's items, the step, the tickets)."""
    tickets = [batcher.submit(k, EncodeJob(k, image=None, content_sha256=f"sha-{k}"), tokens=i + 1)
               for i, k in enumerate(keys)]
    batch = batcher.next_batch(timeout=0, busy=lambda: False)
    assert [it.key for it in batch.items] == keys
    offs = [0]
    for it in batch.items:
        offs.append(offs[-1] + it.tokens)
    output = ring.acquire()
    rows = output.host[: offs[-1]]
    rows.copy_(torch.randn(offs[-1], W, generator=torch.Generator().manual_seed(seed)))
    grids = [(1, 2, 2 * it.tokens) for it in batch.items]  # t * h * w / 4 = tokens
    job = Launched(host_out=rows, done=done, output=output, token_offsets=offs, grids=grids)
    return batch.items, job, tickets


def test_a_step_is_reserved_then_waited_for_then_committed_and_answered(tmp_path):
    store, batcher, writer, ring = _setup(tmp_path)
    log: list[str] = []
    real_reserve, real_commit = store.reserve, store.commit
    store.reserve = lambda *a, **k: log.append("reserve") or real_reserve(*a, **k)
    store.commit = lambda *a, **k: log.append("commit") or real_commit(*a, **k)
    keys = [f"k{i}" for i in range(5)]
    items, job, tickets = _launched(batcher, ring, keys, done=FakeEvent(log))
    assert ring.held() == 1
    writer.write(items, job)
    # Every entry reserved while the device computes, the one device wait, then the commits.
    assert log == ["reserve"] * 5 + ["sync"] + ["commit"] * 5
    for i, (key, t) in enumerate(zip(keys, tickets)):
        item = t.future.result(timeout=0)
        assert (item.key, item.num_tokens, item.content_sha256) == (key, i + 1, f"sha-{key}")
        stored = read_embeddings(tmp_path / "store", key)
        rows = job.host_out[job.token_offsets[i] : job.token_offsets[i + 1]]
        assert torch.equal(torch.cat([stored.main, *stored.deepstack], 1), rows)
    assert ring.held() == 0 and batcher.in_flight() == 0
    with pytest.raises(AssertionError, match="released twice"):
        job.output.release()  # the writer gave it back, exactly once
    writer.metrics.update_gauges(batcher, store)  # what a scrape does first (app.py, enginep.py)
    m = writer.metrics.exposition().decode()
    assert metric(m, "qve_store_items") == 5 and metric(m, "qve_store_bytes") == store.bytes_used > 0


def test_a_lone_image_is_reserved_mapped_and_answered_before_the_store_tidies(tmp_path):
    """A lone image's write is its answer's latency: its file is mapped at reservation (the commit is then a
    memmove) and its waiter is answered before the store unlinks what the entry evicted."""
    store, batcher, writer, ring = _setup(tmp_path)
    mapped: list[bool] = []
    real_reserve, real_trash = store.reserve, store._empty_trash
    store.reserve = lambda *a, **k: mapped.append(k.get("lone", False)) or real_reserve(*a, **k)
    answered_first: list[bool] = []
    items, job, tickets = _launched(batcher, ring, ["lone"], done=FakeEvent([]))
    store._empty_trash = lambda: answered_first.append(tickets[0].future.done()) or real_trash()
    writer.write(items, job)
    assert mapped == [True] and answered_first == [True]
    stored = read_embeddings(tmp_path / "store", "lone")
    assert torch.equal(torch.cat([stored.main, *stored.deepstack], 1), job.host_out)
    items, job, tickets = _launched(batcher, ring, ["a", "b"], done=FakeEvent([]))
    writer.write(items, job)
    assert mapped == [True, False, False]  # a step's entries: writev (mapping them costs throughput)
    assert all(t.future.result(timeout=0).key == k for t, k in zip(tickets, ["a", "b"]))


def _spares(store) -> list:
    """The store's spare file, once it is ready to be taken (its file exists a little before)."""
    return sorted(store.root.glob(".spare-*")) if store._spare is not None else []


def _wait_for(cond, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while not (got := cond()) and time.monotonic() < deadline:
        time.sleep(0.005)
    return got


def test_a_lone_image_is_answered_then_the_next_ones_file_is_made_ahead(tmp_path):
    """After a lone image, the writer makes its store a spare file of that size (on a reserve thread): the next
    lone image's reservation takes it, and a new one is made after that image too. A step's entries do not."""
    store, batcher, writer, ring = _setup(tmp_path)
    taken: list = []
    real_reserve = store.reserve
    store.reserve = lambda *a, **k: taken.append(r := real_reserve(*a, **k)) or r
    root = tmp_path / "store"
    items, job, tickets = _launched(batcher, ring, ["one"], done=FakeEvent([]), seed=1)
    writer.write(items, job)
    assert tickets[0].future.result(timeout=0).key == "one"
    first = _wait_for(lambda: _spares(store))
    assert len(first) == 1 and taken[0].tmp.parent == root / "one"  # the first lone image had none to take
    items, job, tickets = _launched(batcher, ring, ["two"], done=FakeEvent([]), seed=2)
    writer.write(items, job)
    assert taken[1].tmp == first[0]  # the spare, renamed onto two's entry
    stored = read_embeddings(root, "two")
    assert torch.equal(torch.cat([stored.main, *stored.deepstack], 1), job.host_out)
    second = _wait_for(lambda: _spares(store))
    assert len(second) == 1 and second != first
    items, job, tickets = _launched(batcher, ring, ["a", "b"], done=FakeEvent([]))
    writer.write(items, job)
    assert [r.tmp.parent for r in taken[2:]] == [root / "a", root / "b"] and _spares(store) == second


def test_a_step_reports_its_reserve_copy_wait_and_commit_times(tmp_path):
    """qve_step_phase_seconds: the writer's three phases of a step, the device's copy wait apart."""
    store, batcher, writer, ring = _setup(tmp_path)
    real_commit = store.commit
    store.commit = lambda *a, **k: time.sleep(0.01) or real_commit(*a, **k)  # a slow write
    items, job, _ = _launched(batcher, ring, ["a", "b", "c"], done=FakeEvent([], seconds=0.3))
    writer.write(items, job)
    m = writer.metrics.exposition().decode()
    phase = lambda name, what: metric(m, f"qve_step_phase_seconds_{what}", f'phase="{name}"')  # noqa: E731
    assert phase("reserve", "count") == phase("copy_wait", "count") == phase("commit", "count") == 1
    assert 0.3 <= phase("copy_wait", "sum") < 5.0  # the device's time, not the writer's
    assert 0.01 <= phase("commit", "sum") < 5.0
    assert phase("reserve", "sum") < 0.3  # (three small files: not the device's wait, on a loaded machine too)


class FakeTimingEvent:
    """A CUDA timing event's elapsed_time: milliseconds from this event to `other`."""

    def __init__(self, ms: float):
        self.ms = ms

    def elapsed_time(self, other: "FakeTimingEvent") -> float:
        return other.ms - self.ms


def test_a_step_reports_its_time_on_the_device(tmp_path):
    """The `device` phase: the step's span between its two compute-stream events, read after the copy;
    a step without the span (CPU) reports none."""
    store, batcher, writer, ring = _setup(tmp_path)
    items, job, _ = _launched(batcher, ring, ["a", "b"], done=FakeEvent([]))
    job.device_span = (FakeTimingEvent(1000.0), FakeTimingEvent(1042.5))
    writer.write(items, job)
    items, job, _ = _launched(batcher, ring, ["c"], done=FakeEvent([]))
    writer.write(items, job)
    m = writer.metrics.exposition().decode()
    assert metric(m, "qve_step_phase_seconds_count", 'phase="device"') == 1
    assert metric(m, "qve_step_phase_seconds_sum", 'phase="device"') == pytest.approx(0.0425)
    assert metric(m, "qve_step_phase_seconds_count", 'phase="commit"') == 2
    assert metric(m, "qve_step_phase_seconds_count", 'phase="device_gap"') == 0  # no step with a span before it


def test_the_device_gap_is_the_time_between_one_steps_end_and_the_next_steps_start(tmp_path):
    """`device_gap`: from the end event of the step written before to this step's start event, on the
    device's clock; never negative; not across a step without a span (CPU)."""
    store, batcher, writer, ring = _setup(tmp_path)
    spans = [(1000.0, 1040.0), (1047.5, 1090.0), (1090.0, 1130.0), None, (2000.0, 2010.0)]
    for i, span in enumerate(spans):
        items, job, _ = _launched(batcher, ring, [f"k{i}"], done=FakeEvent([]))
        job.device_span = None if span is None else tuple(FakeTimingEvent(ms) for ms in span)
        writer.write(items, job)
    m = writer.metrics.exposition().decode()
    # 1040 -> 1047.5 and 1090 -> 1090; after the CPU step, none (nothing says when the last device step ended)
    assert metric(m, "qve_step_phase_seconds_count", 'phase="device_gap"') == 2
    assert metric(m, "qve_step_phase_seconds_sum", 'phase="device_gap"') == pytest.approx(0.0075)


@pytest.mark.parametrize("where", ["reserve", "commit"])
def test_a_failed_store_write_answers_only_its_image(tmp_path, where):
    store, batcher, writer, ring = _setup(tmp_path)
    real = getattr(store, where)

    def failing(*a, **k):
        key = a[0] if where == "reserve" else a[0].key
        if key == "bad":
            if where == "commit":
                store.abort(a[0])  # as the store's own commit does when its write fails
            raise OSError(28, "No space left on device")
        if key == "full":
            if where == "commit":
                store.abort(a[0])
            raise Unavailable("the store is full", retry_after_s=1, code="store_full")
        return real(*a, **k)

    setattr(store, where, failing)
    items, job, tickets = _launched(batcher, ring, ["ok1", "bad", "full", "ok2"])
    writer.write(items, job)
    ok1, bad, full, ok2 = (t.future for t in tickets)
    assert ok1.result(timeout=0).key == "ok1" and ok2.result(timeout=0).key == "ok2"
    err = bad.exception(timeout=0)
    assert isinstance(err, BackendError)
    assert str(err) == "could not write embeddings to the store: [Errno 28] No space left on device"
    assert full.exception(timeout=0).code == "store_full"  # a ServiceError is the client's answer as it is
    assert ring.held() == 0 and batcher.in_flight() == 0
    assert store.lookup("bad") is None and store.lookup("full") is None and len(store) == 2


def test_a_device_fault_at_the_copy_wait_fails_the_whole_step_and_leaves_nothing_behind(tmp_path):
    store, batcher, writer, ring = _setup(tmp_path)
    items, job, tickets = _launched(batcher, ring, ["a", "b", "c"], done=FakeEvent([], fault=RuntimeError("illegal memory access")))
    writer.write(items, job)
    for t in tickets:
        err = t.future.exception(timeout=0)
        assert isinstance(err, BackendError) and "illegal memory access" not in str(err)
        assert str(err) == "encoding failed on the device (RuntimeError); the server's log has the error"
    assert ring.held() == 0 and batcher.in_flight() == 0 and len(store) == 0
    assert [p for p in (tmp_path / "store").rglob("*") if p.is_file()] == []  # every reservation aborted


def test_run_writes_every_published_step_then_returns_after_close(tmp_path):
    store, batcher, writer, ring = _setup(tmp_path, threads=2)
    thread = threading.Thread(target=writer.run)
    thread.start()
    try:
        steps = [_launched(batcher, ring, [f"s{s}_{i}" for i in range(3)], seed=s) for s in range(3)]
        for items, job, _ in steps:
            writer.publish(items, job)
        writer.close()
    finally:
        thread.join(30)
    assert not thread.is_alive()
    assert all(t.future.result(timeout=0).key == items[i].key for items, _, ts in steps for i, t in enumerate(ts))
    assert ring.held() == 0 and len(store) == 9


class _BatchedStore:
    """A store that takes a step's entries in one call (Mooncake's shape: MooncakeStore.commit_step), over
    a real directory store; `refuse` names keys whose entry the pool has no room for."""

    def __init__(self, inner: DirectoryStore, refuse: set[str] = frozenset(), fail: Exception | None = None):
        self.inner, self.refuse, self.fail = inner, refuse, fail
        self.calls: list[list[str]] = []

    def reserve(self, *a, **k):
        return self.inner.reserve(*a, **k)

    def abort(self, pending):
        self.inner.abort(pending)

    def commit(self, pending, rows, answer=None):
        raise AssertionError("a step of several images goes through commit_step")

    def commit_step(self, pendings, rows, answer):
        self.calls.append([p.key for p in pendings])
        if self.fail is not None:  # the whole call failed: every entry of it has that answer
            for i in range(len(pendings)):
                answer(i, self.fail)
            return
        for i, (p, r) in enumerate(zip(pendings, rows)):
            if p.key in self.refuse:
                self.inner.abort(p)
                answer(i, Unavailable("the Mooncake pool has no room for this entry now", retry_after_s=1, code="store_full"))
            else:
                answer(i, self.inner.commit(p, r))


def test_a_store_that_batches_gets_a_step_in_one_call_and_a_refused_entry_answers_only_its_image(tmp_path):
    inner, batcher, _, ring = _setup(tmp_path)
    store = _BatchedStore(inner, refuse={"full"})
    writer = Writer(store, batcher, Metrics(), threads=3)
    items, job, tickets = _launched(batcher, ring, ["a", "full", "b"])
    writer.write(items, job)
    assert store.calls == [["a", "full", "b"]]  # one call for the step, in staging order
    a, full, b = (t.future for t in tickets)
    assert a.result(timeout=0).key == "a" and b.result(timeout=0).key == "b"
    assert full.exception(timeout=0).code == "store_full"
    rows = job.host_out[job.token_offsets[2] : job.token_offsets[3]]
    stored = read_embeddings(tmp_path / "store", "b")
    assert torch.equal(torch.cat([stored.main, *stored.deepstack], 1), rows)
    assert ring.held() == 0 and batcher.in_flight() == 0

    # The whole call failing (the master gone mid-step): every image of the step has that answer.
    store.fail = Unavailable("the Mooncake pool is unreachable", retry_after_s=1, code="store_full")
    items, job, tickets = _launched(batcher, ring, ["c", "d"], seed=1)
    writer.write(items, job)
    assert all(t.future.exception(timeout=0).code == "store_full" for t in tickets)
    assert ring.held() == 0 and batcher.in_flight() == 0


class GatedEvent:
    """A copy-done event that fires when the test says so (the device still computing until then)."""

    def __init__(self):
        self.fired = threading.Event()

    def synchronize(self) -> None:
        assert self.fired.wait(10), "the test never fired this step's copy"


def test_a_published_step_is_reserved_while_the_writer_still_waits_on_the_step_before(tmp_path):
    """Reservations start at publish, on the reserve threads: a later step's files are allocated while the
    writer is still busy with an earlier step (here: waiting for its copy), not after it."""
    store, batcher, writer, ring = _setup(tmp_path, threads=4)
    reserved_by: dict[str, str] = {}
    real_reserve = store.reserve
    store.reserve = lambda key, *a, **k: reserved_by.setdefault(key, threading.current_thread().name) and \
        real_reserve(key, *a, **k)
    thread = threading.Thread(target=writer.run)
    thread.start()
    first, second = GatedEvent(), GatedEvent()
    items1, job1, tickets1 = _launched(batcher, ring, ["a", "b", "c"], done=first)
    writer.publish(items1, job1)
    items2, job2, tickets2 = _launched(batcher, ring, ["d", "e", "f", "g"], done=second, seed=1)
    writer.publish(items2, job2)
    deadline = time.monotonic() + 10
    while len(reserved_by) < 7 and time.monotonic() < deadline:
        time.sleep(0.01)
    # Every entry of both steps reserved, on the reserve threads, while the first step's copy has not fired.
    assert sorted(reserved_by) == ["a", "b", "c", "d", "e", "f", "g"]
    assert all(name.startswith("store-reserve") for name in reserved_by.values()), reserved_by
    assert not any(t.future.done() for t in tickets1 + tickets2)
    first.fired.set()
    second.fired.set()
    for tickets, job in ((tickets1, job1), (tickets2, job2)):
        for i, t in enumerate(tickets):
            item = t.future.result(timeout=10)
            stored = read_embeddings(tmp_path / "store", item.key)
            rows = job.host_out[job.token_offsets[i] : job.token_offsets[i + 1]]
            assert torch.equal(torch.cat([stored.main, *stored.deepstack], 1), rows)
    writer.close()
    thread.join(10)
    assert not thread.is_alive() and ring.held() == 0 and batcher.in_flight() == 0
