"""The store writer: the one thread that turns launched steps into store entries and answers.

    per step: reserve each image's entry (from its launch, on the reserve threads, while the device
              computes and the writer still writes earlier steps) -> wait the step's copy-done event ->
              commit each entry -> finish its waiters -> release the output buffer to its ring
    per part of a video split across steps (steploop.Part): wait its copy -> copy its rows into the
              video's whole output, in order -> release the buffer; after the last part, one entry

The store's only writer. A step's entries are written by the store itself (Store.commit_step: a
directory's writer threads, one Mooncake call); a failed write answers only its own image.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import time

import torch

from service import tracing
from service.engine.batcher import Batcher, Part, WorkItem
from service.engine.job import EncodeJob
from service.engine.runner import Launched
from service.errors import BackendError, clip, ServiceError
from service.metrics import Metrics
from service.media.video_preprocess import PreparedVideo
from service.store import Store
from service.store.format import StoredItem, VideoMeta

log = logging.getLogger(__name__)


class Writer:
    """Writes launched steps to the store. `run()` is the thread; `publish` hands it a step."""

    def __init__(self, store: Store, batcher: Batcher[EncodeJob], metrics: Metrics, *, threads: int):
        """`threads`: --store-writers (half of them reserve a step's entries ahead)."""
        self.store, self.batcher, self.metrics = store, batcher, metrics
        self._queue: queue.Queue[tuple[list[WorkItem[EncodeJob]], Launched | None, Part | None,
                                       list[concurrent.futures.Future] | None] | None] = queue.Queue()
        # A split video's output so far (key -> [its tokens, out_width] CPU tensor, None once it failed).
        # NOTE: allocated per video, not from the ring: a video's parts outnumber the ring's buffers.
        self._parts: dict[str, torch.Tensor | None] = {}
        # Reservations start when a step is published, on threads of their own: under load the writer is
        # still committing the step before, and a step's reservations waiting for it made the writer the
        # limit (448px at 1 image per request on an H200: reserve 11.6 + commit 15.1 ms per step of 24
        # images, one after the other, against 33 ms between steps).
        self._reserve_threads = max(1, threads // 2)
        self._reserve_pool = concurrent.futures.ThreadPoolExecutor(self._reserve_threads,
                                                                   thread_name_prefix="store-reserve")
        # The end event of the last step written (Launched.device_span[1]; None after a CPU step or a part of a
        # split video): the `device_gap` phase is the device's time from it to the next step's start.
        self._last_end = None

    def publish(self, items: list[WorkItem[EncodeJob]], launched: Launched | None, part: Part | None = None) -> None:
        """Hand over a launched step and its items (in staging order), to be written once its copy is done;
        with `part`, the step is that part of its one video (None launched: the part failed to launch). The
        entries of a step of several images start being reserved now."""
        reserving = self._reserve_ahead(items, launched) if part is None and len(items) > 1 else None
        self._queue.put((items, launched, part, reserving))

    def close(self) -> None:
        """No more steps (the loop has drained): write what is queued, then `run` returns."""
        self._queue.put(None)

    def run(self) -> None:
        while (step := self._queue.get()) is not None:
            items, launched, part, reserving = step
            if part is None:
                self.write(items, launched, reserving)
            else:
                self.write_part(items[0], launched, part)
        self._reserve_pool.shutdown()

    def _reserve_ahead(self, items: list[WorkItem[EncodeJob]], job: Launched) -> list[concurrent.futures.Future]:
        """Start reserving every entry of a step on the reserve threads: futures of contiguous shares of
        `held` (write joins them, in order)."""
        shapes, dtypes = _entry_shapes(job)

        def share(idx: range) -> list:
            return [self._reserve(items[j], shapes[j], dtypes[j], job.grids[j]) for j in idx]

        return [self._reserve_pool.submit(share, idx) for idx in _shares(len(items), self._reserve_threads)]

    def write(self, items: list[WorkItem[EncodeJob]], job: Launched,
              reserving: list[concurrent.futures.Future] | None = None) -> None:
        """Store one step's embeddings and answer every one of its items (result or error). `reserving`: its
        reservations started at publish (_reserve_ahead); None: reserve here."""
        n = len(items)
        offs = job.token_offsets
        t0 = time.perf_counter()
        # Every entry's file is reserved while the device still computes: allocating tmpfs pages is
        # most of a store write's cost, and so it overlaps the tower instead of following it.
        if reserving is None and n > 1:  # (a step not published: write called directly)
            reserving = self._reserve_ahead(items, job)
        if reserving is not None:
            held = [r for f in reserving for r in f.result()]  # (_reserve answers its own failures: no raise)
        else:  # a lone image, reserved here (a hand-off costs it latency): its write is its latency
            shapes, dtypes = _entry_shapes(job)
            held = [self._reserve(items[0], shapes[0], dtypes[0], job.grids[0], lone=True)]
        t_reserved = time.perf_counter()
        try:
            if job.done is not None:
                job.done.synchronize()  # the writer's one device wait: this step's D2H copy
                self.batcher.wake()  # the device may be idle now: a waiting batch can close
            traced = _computed(items)
            t_copied = time.perf_counter()
        except Exception as e:  # a device fault surfaced by the wait: nothing of this step is usable
            log.error("step of %d images failed on the device: %r", n, e)
            self._last_end = None  # (its events may never have fired: no gap is measured across it)
            for item, r in zip(items, held):
                if r is not None:
                    self.store.abort(r)
                    self.batcher.finish(item, error=BackendError(f"encoding failed on the device ({type(e).__name__}); the server's log has the error"))
        else:
            rows = [job.host_out[offs[i] : offs[i + 1]] for i in range(n)]
            if n == 1:  # a lone image is written here: a hand-off costs it latency
                self._commit(items[0], held[0], rows[0])
                if reserving is None and held[0] is not None:
                    # What the next lone image's write takes, made on a reserve thread while the server waits
                    # for it (Store.prepare_next): its reservation is then no longer its critical path.
                    self._reserve_pool.submit(self._prepare_next, held[0])
            else:
                self._commit_step(items, held, rows)
            _record(traced, n)
            phase = self.metrics.step_phase_seconds
            phase.labels(phase="reserve").observe(t_reserved - t0)
            phase.labels(phase="copy_wait").observe(t_copied - t_reserved)
            phase.labels(phase="commit").observe(time.perf_counter() - t_copied)
            if job.device_span is not None:  # (both events have fired: `done` follows them on the device)
                start, end = job.device_span
                phase.labels(phase="device").observe(start.elapsed_time(end) / 1e3)
                if self._last_end is not None:
                    # How long the device had no step between this one and the one before (steps run in
                    # order on one stream): no work, or a step launched after the previous one ended. Under
                    # load it says whether the step loop keeps the device fed.
                    phase.labels(phase="device_gap").observe(max(0.0, self._last_end.elapsed_time(start) / 1e3))
            self._last_end = job.device_span[1] if job.device_span is not None else None
        finally:
            if job.output is not None:
                job.output.release()  # every commit above has returned: the buffer is free
        # (The store's gauges are read at scrape time: Metrics.update_gauges.)

    def write_part(self, item: WorkItem[EncodeJob], job: Launched | None, part: Part) -> None:
        """One part of a video split across steps: its rows into the video's output; the last part stores it."""
        video = item.payload.image
        self._last_end = None  # (a part's device time is not observed: no gap across it either)
        if part.index == 0:
            assert job is not None, "a split video's first part failed in the step loop, which answers it: a bug"
            self._parts[item.key] = torch.empty(video.num_tokens, job.host_out.shape[1], dtype=job.host_out.dtype)
        out = self._parts.get(item.key)
        if job is None:  # this part never launched: the step loop's error is the answer
            self._parts.pop(item.key, None)
            if out is not None:
                self.batcher.finish(item, error=part.error)
            return
        try:
            if job.done is not None:
                job.done.synchronize()
                self.batcher.wake()
            _computed([item])
            if out is not None:
                tokens = job.token_offsets[-1]
                # Every part but the last holds the same groups: part k starts at k of them; the last ends the video.
                start = out.shape[0] - tokens if part.index == part.count - 1 else part.index * tokens
                out[start : start + tokens].copy_(job.host_out[:tokens])
        except Exception as e:  # a device fault: the video fails, its later parts are dropped
            log.error("part %d of %d of video %s failed on the device: %r", part.index + 1, part.count, item.key, e)
            self._parts[item.key] = None
            if out is not None:
                self.batcher.finish(item, error=BackendError(f"encoding failed on the device ({type(e).__name__}); the server's log has the error"))
        finally:
            if job.output is not None:
                job.output.release()
        if part.index == part.count - 1 and (out := self._parts.pop(item.key, None)) is not None:
            self._commit(item, self._reserve(item, tuple(out.shape), out.dtype, video.grid_thw), out)
            _record([item.payload] if item.payload.stamps is not None else [], 1, parts=part.count)

    def _reserve(self, item: WorkItem[EncodeJob], shape: tuple[int, int], dtype: torch.dtype,
                 grid: tuple[int, int, int], lone: bool = False):
        """Reserve one entry (`lone`: see Store.reserve), or answer its waiters with the error (then None)."""
        try:
            return self.store.reserve(item.key, shape, dtype, grid, content_sha256=item.payload.content_sha256,
                                      video=video_meta(item.payload.image), lone=lone)
        except Exception as e:
            self._store_failed(item, e)
            return None

    def _prepare_next(self, like) -> None:
        try:
            self.store.prepare_next(like)
        except Exception as e:  # (a bug: it answers its own failures with False) only costs the next image latency
            log.error("making a spare store file failed: %r", e)

    def _commit(self, item: WorkItem[EncodeJob], pending, rows: torch.Tensor) -> None:
        """Write one image's embeddings and answer its waiters (result or error, exactly once)."""
        if pending is None:
            return  # answered by _reserve

        def answer(outcome: StoredItem | Exception) -> None:  # (an error: a write past the store's deadline)
            if isinstance(outcome, Exception):
                self._store_failed(item, outcome)
            else:
                self.batcher.finish(item, result=outcome)

        try:  # answered as soon as the entry is published, before the store tidies up after it
            self.store.commit(pending, rows, answer=answer)
        except Exception as e:  # (raised before the answer: commit raises nothing after it)
            self._store_failed(item, e)

    def _commit_step(self, items: list[WorkItem[EncodeJob]], held: list, rows: list[torch.Tensor]) -> None:
        """A step's entries in one store call; each image answered with its own result or error, once."""
        live = [i for i, pending in enumerate(held) if pending is not None]  # (the others answered by _reserve)
        answered: set[int] = set()

        def answer(j: int, result: StoredItem | Exception) -> None:
            answered.add(j)
            if isinstance(result, Exception):
                self._store_failed(items[live[j]], result)
            else:
                self.batcher.finish(items[live[j]], result=result)

        try:
            self.store.commit_step([held[i] for i in live], [rows[i] for i in live], answer)
        except Exception as e:  # a bug of the store's: the entries it did not answer are answered with it
            log.error("store: writing a step failed: %r", e)
            for j in set(range(len(live))) - answered:
                answer(j, e)

    def _store_failed(self, item: WorkItem[EncodeJob], e: Exception) -> None:
        if isinstance(e, ServiceError):  # e.g. `store_full`: the client's answer (503 + Retry-After), as it is
            log.warning("store write for %s refused: %s", item.key, e.message)
            self.batcher.finish(item, error=e)
        else:
            log.error("store write for %s failed: %r", item.key, e)
            self.batcher.finish(item, error=BackendError(f"could not write embeddings to the store: {clip(str(e), 120)}"))


def _shares(n: int, threads: int) -> list[range]:
    """0..n-1 in at most `threads` contiguous shares of near-equal size, in order (one at least)."""
    k = max(1, min(threads, n))
    return [range(i * n // k, (i + 1) * n // k) for i in range(k)]


def _entry_shapes(job: Launched) -> tuple[list[tuple[int, int]], list[torch.dtype]]:
    """Each item's embeddings' shape and dtype in a launched step."""
    offs, width = job.token_offsets, job.host_out.shape[1]
    n = len(offs) - 1
    return [(offs[i + 1] - offs[i], width) for i in range(n)], [job.host_out.dtype] * n


def _computed(items: list[WorkItem[EncodeJob]]) -> list[EncodeJob]:
    """The traced items of a step whose output copy is done, stamped so (tracing.Stamps)."""
    traced = [item.payload for item in items if item.payload.stamps is not None]
    for job in traced:
        job.stamps.computed = tracing.now_ns()
    return traced


def _record(traced: list[EncodeJob], images: int, **attributes) -> None:
    """The queue, step and store-write spans of a step's traced items, once their entries are written."""
    if traced:
        stored = tracing.now_ns()
        for job in traced:
            job.stamps.record(stored, key=job.key, step_images=images, **attributes)


def video_meta(media) -> VideoMeta | None:
    """What a video's store entry records beside its embeddings; None for an image."""
    if not isinstance(media, PreparedVideo):
        return None
    return VideoMeta(frames_indices=media.indices, fps=media.fps, timestamps=media.timestamps)
