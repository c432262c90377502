"""The two ways an app instance decodes images and videos (api/runtime.py's Decoder), one per kind of process:

  * PoolDecoder: a single-process service. Decode processes (PIL decode and the bicubic resize hold
    the GIL most of the time), the pixels handed back as an array for the in-process engine host.
  * ArenaDecoder: an API process of a supervised service. Decode threads (this process does nothing
    but HTTP and decoding, and there are several such processes), the pixels written once into a cell
    of this process's shared-memory arena, which the engine process reads in place.

A video is decoded the same way (media/video_preprocess.prepare_video: PyAV decode of the sampled frames,
each resized as it comes): off the event loop, its uint8 frames [2 * groups, h, w, 3] one array or one arena
cell. A video's clip is bounded by its processor's max_pixels (a few MB); one bigger than the whole arena can
never be placed and is a 413 (`video_too_large`), not a 429. Videos pass a VideoGate first: at most
--video-decode-workers of them decode at once, fewer than there are decoders, so images always have one
(two long videos on a pool of two made every image wait for one of them to end), and the resized frames of
those decoding stay within --video-max-process-bytes.

An image's decode time is bounded where it runs (media/images.py: a JPEG's scans are capped, and PIL's
decode is stopped between chunks past --decode-timeout-s). What cannot be stopped there (simplejpeg, WebP,
libtiff, the resize) is ended in a decode process by the kernel, once the process has spent the timeout and
DECODE_KILL_GRACE_S of CPU on the image (a CPU-time timer: a legitimate decode on a busy machine is not
killed for waiting on a core); that image is answered 422 and the images that shared its pool are decoded
again on the new one, not answered 503. A video has a CPU budget too: --video-max-decode-s on each core its
decoder's threads may use, and DECODE_KILL_GRACE_S (the deadline inside the decode, checked at every frame,
answers first). Its decode reports every frame it decodes, and the stall watch counts that as progress: a
long video is not a stuck pool. Decode threads cannot be killed: an API process has only the bounds inside
the decode.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import bisect
import contextlib
import functools
import itertools
import logging
import multiprocessing
import os
import signal
import time
import weakref
from collections.abc import Callable

from service.api.runtime import Decoded
from service.config import Settings, usable_cores
from service.media.params import ImageLimits, PreprocessParams, VideoLimits, VideoParams
from service.engine.messages import Cell, Geometry, VideoInfo
from service.errors import ImageError, Overloaded, Unavailable, VideoError
from service.media.images import ImageHeader, PreparedImage, loaded_pid, prepare_image, warmup_png
from service.media.video import VideoHeader
from service.media.video_preprocess import PreparedVideo, plan_video, prepare_video
from service.metrics import Metrics
from service.procs.arena import Arena
from service.priority import Due, PriorityGate, Urgency, due, expired_error
from service.procs.child import exit_with

log = logging.getLogger(__name__)

# A decode waiting this long with no decode of its pool finishing and no video of it decoding a frame meanwhile
# means the pool is stuck (PoolDecoder.decode; --decode-stall-s). The largest admitted image decodes in about a
# second on one core, and a video's frames come one every few tens of milliseconds.
DECODE_STALL_S = Settings.model_fields["decode_stall_s"].default
# A new pool is on that clock only once a worker of it has answered (starting one through the forkserver
# took seconds on a loaded 2-core machine); one that has not answered by this time is stuck too.
POOL_START_LIMIT_S = 120.0
# An image's decode process is ended once it has spent --decode-timeout-s plus this of CPU on the image. The
# deadline inside the decode answers first where the decode can be stopped (PIL's); this covers what runs
# after its last check (a 64 MP image's resize took about a second) and decoders that cannot be stopped.
DECODE_KILL_GRACE_S = 5.0
# How often an image is decoded again because another image's kill took its worker with it (a process pool
# breaks whole); beyond that it is answered 503.
RESUBMITS = 3

# In a decode process: its pool's job slots, the pid of the process running each job that has a CPU budget
# (0: none). The pool's owner reads it once a process was ended, to learn whose image it was (_within_budget).
_slot_pids = None
# ... and the frames each slot's video decodes have decoded so far (_progress; one writer a slot: its job's
# process). The pool's owner reads them for the stall watch (PoolDecoder._note_progress).
_slot_beats = None
_job_slot = 0  # the slot of the job this decode process runs


def _init_worker(parent: int, slot_pids, slot_beats) -> None:
    """A decode process's initializer: exit with the service (exit_with); the pool's job slots."""
    global _slot_pids, _slot_beats
    exit_with(parent)
    _slot_pids, _slot_beats = slot_pids, slot_beats


def _progress() -> None:
    """In a decode process: its job decoded a frame (video.sampled_frames calls it for every frame)."""
    _slot_beats[_job_slot] += 1


def _within_budget(slot: int, cpu_s: float | None, fn, *args):
    """fn(*args) in a decode process that the kernel ends (SIGPROF, whose default action is to terminate) once
    it has spent `cpu_s` seconds of CPU time on it: wherever it is, a C decoder that cannot be stopped
    included. A timer of CPU time, not wall time: a decode waiting for a core on a busy machine is not ended.
    The job's slot holds this process's pid meanwhile, so that its pool's owner knows whose image it was."""
    global _job_slot
    _job_slot = slot
    if cpu_s is None:
        return fn(*args)
    _slot_pids[slot] = os.getpid()
    signal.setitimer(signal.ITIMER_PROF, cpu_s)
    try:
        return fn(*args)
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)
        _slot_pids[slot] = 0


def _warm_video(_i: int) -> None:
    from service.media.video_preprocess import warm

    warm()


def _warmed(fut) -> None:
    if not fut.cancelled() and fut.exception() is not None:
        log.warning("warming the video path failed (a first video pays its imports): %s", fut.exception())


def _geometry(prep: PreparedImage | PreparedVideo) -> Geometry:
    if isinstance(prep, PreparedVideo):
        n, h, w, _ = prep.frames.shape
        return Geometry(height=h, width=w, grid_thw=prep.grid_thw, tokens=prep.num_tokens,
                        video=VideoInfo(frames=n, indices=prep.indices, fps=prep.fps, timestamps=prep.timestamps))
    h, w = prep.pixels.shape[:2]
    return Geometry(height=h, width=w, grid_thw=prep.grid_thw, tokens=prep.num_tokens)


class VideoGate:
    """At most `slots` video decodes at once in one process, whose resized frames (VideoPlan.nbytes) total at
    most `max_bytes`: a video waits for both, its turn by its request's priority (service/priority.py), and
    leaves with a 504 if its deadline passes meanwhile. Images never wait here; with videos on fewer decoders
    than there are, a long video cannot take the decoder an image needs."""

    def __init__(self, slots: int, max_bytes: int, aging_s: float = 0.0, clock: Callable[[], float] = time.monotonic):
        assert slots >= 1, f"{slots} video decode slots: this is a bug"
        self.slots, self.max_bytes, self.aging_s, self._clock = slots, max_bytes, aging_s, clock
        self.running, self.held = 0, 0  # videos decoding now, and their resized frames' bytes
        self._waiters: list[tuple[Due, int, asyncio.Future]] = []  # in due order
        self._seq = itertools.count()

    def _fits(self, nbytes: int) -> bool:
        return self.running < self.slots and self.held + nbytes <= self.max_bytes

    @contextlib.asynccontextmanager
    async def hold(self, nbytes: int, urgency: Urgency = Urgency()):
        """A video decode's place, held while the block runs. A video that alone is more than `max_bytes` (the
        request's keys refuse it first) is a 413."""
        if nbytes > self.max_bytes:
            raise VideoError(f"the video is {nbytes} bytes once resized; the limit is {self.max_bytes} for the videos "
                             "a process decodes at once (--video-max-process-bytes)", code="video_too_large")
        urgency.check("its decode started", self._clock())
        if self._waiters or not self._fits(nbytes):
            order = (due(self._clock(), urgency.priority, self.aging_s), next(self._seq))
            while self._waiters and self._waiters[0][:2] < order or not self._fits(nbytes):
                entry = (*order, asyncio.get_running_loop().create_future())
                bisect.insort(self._waiters, entry, key=lambda e: e[:2])
                timeout = None if urgency.deadline is None else max(0.0, urgency.deadline - self._clock())
                try:
                    await asyncio.wait_for(asyncio.shield(entry[2]), timeout)
                except TimeoutError:
                    raise expired_error("its decode started") from None
                finally:
                    self._waiters.remove(entry)
        self.running += 1
        self.held += nbytes
        try:
            yield
        finally:
            self.running -= 1
            self.held -= nbytes
            self._wake()

    def _wake(self) -> None:
        for *_, waiter in self._waiters:  # (most urgent first: each looks again, in turn; those that fit go)
            if not waiter.done():
                waiter.set_result(None)


class _PoolBroke(Exception):
    """A decode's pool broke (a worker process ended) while it ran or when it was handed over."""

    def __init__(self, pool: concurrent.futures.ProcessPoolExecutor):
        super().__init__()
        self.pool = pool


class PoolDecoder:
    """Decode processes for a single-process service; the pixels come back as an array (pickled once)."""

    def __init__(self, workers: int, limits: ImageLimits, stall_s: float = DECODE_STALL_S,
                 clock: Callable[[], float] = time.monotonic, video_limits: VideoLimits = VideoLimits(),
                 kill_grace_s: float = DECODE_KILL_GRACE_S, video_slots: int = 1, aging_s: float = 0.0):
        """`clock` times the stall watch (tests inject a fake one). An image's decode process is ended after
        limits.decode_timeout_s + kill_grace_s of CPU on it, a video's after video_cpu_s(). At most
        `video_slots` videos decode at once (Settings.video_decode_slots). Decodes wait for a worker in their
        requests' priority order, aged by `aging_s` (--priority-aging-s)."""
        self.workers, self.limits, self.stall_s, self._clock = workers, limits, stall_s, clock
        self.video_limits, self.kill_grace_s, self.aging_s = video_limits, kill_grace_s, aging_s
        self.videos = VideoGate(video_slots, video_limits.max_process_bytes, aging_s)
        # When a decode last finished or a video decoded a frame (a pool that does neither is stuck).
        self._progress_at = clock()
        self._slot_pids = weakref.WeakKeyDictionary()  # pool -> its job slots' pids (_within_budget)
        self._slot_beats = weakref.WeakKeyDictionary()  # pool -> its job slots' frames decoded (_progress)
        self._beats_seen = weakref.WeakKeyDictionary()  # pool -> their sum when the stall watch last looked
        self._verdicts = weakref.WeakKeyDictionary()  # broken pool -> future of the slots its CPU budgets ended
        # At most `workers` decodes in a pool at a time, each in a job slot of its own: a decode handed to the
        # pool starts at once (the stall clock's waiting time is a decode's), and a slot names it.
        self._sem: PriorityGate | None = None
        self._sem_loop: asyncio.AbstractEventLoop | None = None
        self._free_slots: list[int] = []
        self.pool = self._new_pool()
        self.ready = False

    def _new_pool(self) -> concurrent.futures.ProcessPoolExecutor:
        # NOTE: forkserver/spawn, not fork: this process already runs threads (torch, the step loop).
        # Each worker exits when this process does: a SIGKILL of the service leaves no worker behind (and
        # then no forkserver: the workers were what kept it alive).
        method = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
        context = multiprocessing.get_context(method)
        slot_pids = context.Array("l", self.workers, lock=False)  # (shared memory: each slot has one writer)
        slot_beats = context.Array("Q", self.workers, lock=False)
        pool = concurrent.futures.ProcessPoolExecutor(self.workers, mp_context=context, initializer=_init_worker,
                                                      initargs=(os.getpid(), slot_pids, slot_beats))
        self._slot_pids[pool], self._slot_beats[pool], self._beats_seen[pool] = slot_pids, slot_beats, 0
        # The pool is up once a worker has answered: until then its decodes are not on the stall clock.
        self._started = (pool, self._clock(), pool.submit(loaded_pid))
        self._up_at: float | None = None
        self._started[2].add_done_callback(lambda _f: setattr(self, "_up_at", self._clock()))
        return pool

    def _stalled(self, pool, waiting_since: float) -> bool:
        """Whether `pool` counts as stuck for a decode waiting since `waiting_since`."""
        now = self._clock()
        tracked, created, _ = self._started
        if tracked is not pool:  # (a pool this decoder did not start: on the clock at once)
            up = 0.0
        elif self._up_at is None:
            return now - created > POOL_START_LIMIT_S
        else:
            up = self._up_at
        return now - max(waiting_since, self._progress_at, up) > self.stall_s

    def _note_progress(self, pool) -> None:
        """A video of `pool` that decoded a frame since the last look is progress: the stall clock starts again
        (a video that takes minutes is a long video, not a stuck pool)."""
        beats = self._slot_beats.get(pool)
        if beats is not None and (total := sum(beats)) != self._beats_seen.get(pool):
            self._beats_seen[pool] = total
            self._progress_at = self._clock()

    async def start(self, params: PreprocessParams, warm_video: bool = False) -> None:
        """Start every worker now (imports, forkserver) rather than on the first requests; `warm_video`: the
        video path's imports too (video_preprocess.warm)."""
        blob = warmup_png()
        await asyncio.to_thread(lambda: list(self.pool.map(prepare_image, [blob] * self.workers,
                                                           [params] * self.workers, [self.limits] * self.workers)))
        if warm_video:
            await asyncio.to_thread(lambda: list(self.pool.map(_warm_video, range(self.workers))))
        self.ready = True

    async def decode(self, data: bytes, header: ImageHeader, params: PreprocessParams,
                     urgency: Urgency = Urgency()) -> Decoded:
        """prepare_image in a decode worker (with the header read at admission: not parsed again). A dead worker (the OOM killer's SIGKILL) breaks the whole
        pool: it is replaced at once and this image answered 503, so one death costs one request.

        A pool can also stop answering without breaking: the chaos test met it once in CI (after a
        worker's SIGKILL the pool finished no more decodes and the executor never reported it broken;
        why was not found). So a decode that waits `stall_s` with no decode of its pool finishing
        meanwhile takes the pool for stuck: its workers are killed, a new pool starts, and the images
        waiting on the old one are answered 503.

        An image whose decode process spends its CPU budget (limits.decode_timeout_s + kill_grace_s) is
        ended by the kernel: that image is answered 422 (`image_too_complex`), and the others on the pool are
        decoded again on the new pool (up to RESUBMITS times)."""
        prep = await self._in_pool(prepare_image, data, params, self.limits, header,
                                   cpu_s=self.limits.decode_timeout_s + self.kill_grace_s, urgency=urgency)
        return Decoded(_geometry(prep), prep.pixels)

    async def decode_video(self, data: bytes, header: VideoHeader, params: VideoParams,
                           urgency: Urgency = Urgency()) -> Decoded:
        """prepare_video in a decode worker once the video gate lets it, watched as `decode` is: every frame it
        decodes is progress for the stall watch, and past video_cpu_s() of CPU its process is ended (413
        `video_too_long`; the decodes beside it go again on the new pool)."""
        async with self.videos.hold(plan_video(header, params).nbytes, urgency):
            prep = await self._in_pool(functools.partial(prepare_video, progress=_progress), data, header, params,
                                       self.video_limits, cpu_s=self.video_cpu_s(), video=True, urgency=urgency)
        return Decoded(_geometry(prep), prep.frames)

    def video_cpu_s(self) -> float:
        """A video decode's CPU budget: --video-max-decode-s on each core (FFmpeg's decoder threads use them
        all, so CPU time runs up to that many times faster than the wall clock) and kill_grace_s. A decode
        is never ended before its wall-time deadline, which it checks at every frame; this ends one that
        stops checking (a frame that never finishes decoding)."""
        return self.video_limits.max_decode_s * usable_cores() + self.kill_grace_s

    def _slots(self) -> PriorityGate:
        loop = asyncio.get_running_loop()
        if self._sem_loop is not loop:  # (made in the loop that uses it: tests run several loops in turn)
            self._sem, self._sem_loop = PriorityGate(self.workers, self.aging_s), loop
            self._free_slots = list(range(self.workers))
        return self._sem

    async def _in_pool(self, fn, *args, cpu_s: float | None = None, video: bool = False, urgency: Urgency = Urgency()):
        """fn(*args) in a decode worker, in a job slot of its own (`cpu_s`: its process's CPU budget, see
        _within_budget; `video`: a video's, for the error its budget gives), once its turn comes (`urgency`: a
        504 if its deadline passes first); a dead or stuck pool replaced (see `decode`)."""
        async with self._slots().hold(urgency):
            slot = self._free_slots.pop()
            try:
                for attempt in range(RESUBMITS + 1):
                    try:
                        return await self._attempt(slot, cpu_s, fn, args)
                    except _PoolBroke as broke:
                        ended = await self._verdict(broke.pool)
                        if slot in ended and video:
                            raise VideoError(
                                f"decoding the video took over {cpu_s:g} s of CPU, past its limit "
                                f"(--video-max-decode-s {self.video_limits.max_decode_s:g} on each of "
                                f"{usable_cores()} cores) in a part of its decode that cannot be interrupted, so "
                                "its process was stopped; send a shorter or smaller video",
                                code="video_too_long") from None
                        if slot in ended:
                            raise ImageError(
                                f"decoding the image took over {cpu_s:g} s of CPU, past its limit "
                                f"(--decode-timeout-s {self.limits.decode_timeout_s:g}) in a decoder that "
                                "cannot be interrupted, so its process was stopped; re-encode the image (as a "
                                "baseline JPEG or PNG) or downscale it", code="image_too_complex") from None
                        if not ended:
                            raise Unavailable("an image decode worker died while decoding (out of memory?); it has "
                                              "been replaced: retry", retry_after_s=1) from None
                        # Another image's decode was ended, and this one's process with it (a pool breaks whole).
                        log.info("decoding again on the new pool an image whose worker went with another's (%d)",
                                 attempt + 1)
                raise Unavailable("image decode workers were stopped repeatedly by other images' decodes: retry",
                                  retry_after_s=1)
            finally:
                self._free_slots.append(slot)

    async def _attempt(self, slot: int, cpu_s: float | None, fn, args):
        """One run of fn(*args) in the current pool (_PoolBroke: that pool broke); a stuck pool replaced and the
        work answered 503."""
        pool = self.pool
        waiting_since = self._clock()
        try:  # (a pool already broken raises here, at submit)
            fut = asyncio.get_running_loop().run_in_executor(pool, _within_budget, slot, cpu_s, fn, *args)
            while not (await asyncio.wait({fut}, timeout=1.0))[0]:
                self._note_progress(pool)
                if self._stalled(pool, waiting_since) or pool is not self.pool:
                    fut.cancel()
                    if self.pool is pool:
                        log.error("no decode finished in %.0f s: the decode pool is stuck; starting a new one",
                                  self.stall_s)
                        self.pool = self._new_pool()
                        for worker in list(pool._processes.values()):  # (private, stable since 3.2)
                            worker.kill()
                        pool.shutdown(wait=False, cancel_futures=True)
                    raise Unavailable("the decode workers stopped answering; they have been replaced: retry",
                                      retry_after_s=1)
            self._progress_at = self._clock()  # any outcome, a refused image too: the pool is alive
            return fut.result()
        except concurrent.futures.BrokenExecutor:  # BrokenProcessPool
            raise _PoolBroke(pool) from None

    async def _verdict(self, pool) -> frozenset[int]:
        """The job slots of broken `pool` whose process its CPU budget ended (empty: a worker died otherwise,
        e.g. the OOM killer's SIGKILL). The first to ask replaces the pool at once, then waits for the old
        one's processes to be reaped to read how each ended; the others wait for its answer."""
        if pool not in self._verdicts:
            verdict = self._verdicts[pool] = asyncio.get_running_loop().create_future()
            replaced = self.pool is pool  # (else the stall watch replaced it, and said so)
            if replaced:
                self.pool = self._new_pool()
            processes = dict(pool._processes or {})  # (private, stable since 3.2; None once shut down)
            # NOTE: exit codes only after shutdown(wait=True) has reaped every process: read while the
            # executor's own thread reaps them, a forkserver child's exit code can come back as 255.
            await asyncio.to_thread(pool.shutdown, wait=True, cancel_futures=True)
            ended = {pid for pid, p in processes.items() if p.exitcode == -signal.SIGPROF}
            pids = self._slot_pids.get(pool)
            slots = frozenset(s for s in range(len(pids)) if pids[s] in ended) if pids is not None else frozenset()
            if slots:
                log.warning("an image's decode ran past its CPU budget and its process was stopped (answered 422); "
                            "the other images on that pool are decoded again on a new one")
            elif replaced:
                log.error("a decode worker died (killed, out of memory?); started a new pool")
            verdict.set_result(slots)
        return await asyncio.shield(self._verdicts[pool])

    def release(self, decoded: Decoded) -> None:
        pass  # an array: the garbage collector has it

    def cell_free(self, cell: Cell) -> None:
        raise AssertionError(f"{cell} freed in a single-process service, which has no arena: this is a bug")

    async def shutdown(self) -> None:
        # NOTE: wait=True. Decode workers forked by the forkserver hold its liveness pipe; workers left
        # running (wait=False) keep the forkserver, and so themselves, alive after this process exits.
        await asyncio.to_thread(self.pool.shutdown, wait=True, cancel_futures=True)


class ArenaDecoder:
    """Decode threads for an API process; the pixels land in a cell of this process's arena."""

    def __init__(self, arena: Arena, workers: int, limits: ImageLimits, metrics: Metrics,
                 video_limits: VideoLimits = VideoLimits(), video_slots: int = 1, aging_s: float = 0.0):
        """At most `video_slots` of the `workers` threads decode videos at once (Settings.video_decode_slots).
        Decodes wait for a thread in their requests' priority order, aged by `aging_s` (--priority-aging-s)."""
        self.arena, self.limits, self.metrics, self.video_limits = arena, limits, metrics, video_limits
        self.videos = VideoGate(video_slots, video_limits.max_process_bytes, aging_s)
        # NOTE: threads, not processes: this process's only job is HTTP and decoding, and there are
        # several such processes; PIL releases the GIL while it decodes and resizes.
        self.pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="decode")
        # The executor's own queue is first come, first served: decodes wait here instead, one per thread.
        self.gate = PriorityGate(workers, aging_s)
        self.ready = True

    async def start(self, params: PreprocessParams, warm_video: bool = False) -> None:
        """Threads start on demand and cost nothing to start; `warm_video`: this process imports the video
        path's modules in a decode thread meanwhile (video_preprocess.warm), not holding up /ready."""
        if warm_video:
            asyncio.get_running_loop().run_in_executor(self.pool, _warm_video, 0).add_done_callback(_warmed)

    def _decode(self, data: bytes, header: ImageHeader | VideoHeader, params: PreprocessParams | VideoParams) -> Decoded:
        """Decode + preprocess (a decode thread) straight into a new arena cell: the pixels are written once."""
        cells: list[Cell] = []  # the cell prepare_image asked for, once it has
        video = isinstance(header, VideoHeader)

        def into_cell(nbytes: int):
            if video and nbytes > self.arena.size:
                raise VideoError(f"the video's resized frames are {nbytes} bytes, more than this process's pixel "
                                    f"arena holds ({self.arena.size}); send a shorter clip or raise --arena-bytes", code="video_too_large")
            try:
                off = self.arena.alloc(nbytes)
            except Overloaded as e:
                raise Overloaded(f"too many images being decoded or queued in this process ({e}); retry shortly",
                                 retry_after_s=1) from None
            cells.append(Cell(self.arena.name, off, nbytes))
            self.metrics.arena_bytes.set(self.arena.used)
            return self.arena.view(off, nbytes)

        try:
            prep = (prepare_video(data, header, params, self.video_limits, out=into_cell) if video
                    else prepare_image(data, params, self.limits, header, out=into_cell))
        except BaseException:
            for cell in cells:  # refused after it took its cell (a JPEG whose data is broken): no owner now
                self.cell_free(cell)
            raise
        return Decoded(_geometry(prep), cells[0])

    async def decode(self, data: bytes, header: ImageHeader, params: PreprocessParams,
                     urgency: Urgency = Urgency()) -> Decoded:
        async with self.gate.hold(urgency):
            return await asyncio.get_running_loop().run_in_executor(self.pool, self._decode, data, header, params)

    async def decode_video(self, data: bytes, header: VideoHeader, params: VideoParams,
                           urgency: Urgency = Urgency()) -> Decoded:
        async with self.videos.hold(plan_video(header, params).nbytes, urgency), self.gate.hold(urgency):
            return await asyncio.get_running_loop().run_in_executor(self.pool, self._decode, data, header, params)

    def release(self, decoded: Decoded) -> None:
        """Pixels that never reached an engine (an unneeded early decode, a submit that failed to leave)."""
        self.cell_free(decoded.pixels)

    def cell_free(self, cell: Cell) -> None:
        if cell.segment == self.arena.name:
            self.arena.free(cell.offset, cell.nbytes)
            # Kept current here, not at scrape time: any API process answers /metrics for all of them.
            self.metrics.arena_bytes.set(self.arena.used)

    async def shutdown(self) -> None:
        await asyncio.to_thread(self.pool.shutdown, wait=True, cancel_futures=True)
        log.info("pixel arena %s: %d bytes in use at exit", self.arena.name, self.arena.used)
        self.arena.close()
