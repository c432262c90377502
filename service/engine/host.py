"""The engine host: the one owner of claim, submit and cancel for one engine (one device, one store
shard). It answers the API side's messages (engine/messages.py) from the store, the batcher and the
step loop, whether they come from this process (`LocalTransport`, a single-process service) or from
API processes over a Unix socket (procs/ipc.py's EngineServer, in an engine process).

    Claim  -> stored and the same bytes: Hit | queued or running: Joined (no decode) | else Grant
              (a queue place, counted with the image's header tokens: admission before decode),
              or 504 when its request's deadline has passed (a hit is still answered)
    Submit -> stored meanwhile: Hit | its deadline passed: 504, nothing queued | else queued (Queued),
              its Result once written (or 504 if its deadline passes before its step starts)
              (the store is asked only what it knows without a round trip: what this engine wrote since)
    Cancel -> a grant's place or a wait given back

A host runs on one thread (its connections' `post` hops there): the event loop of a single-process
service, the ipc thread of an engine process. It never blocks; the writer thread's answers are posted,
and so are the store's lookups that are a round trip (Mooncake's, batched on a thread of their own),
meanwhile the claim waiting for one is `pending` (a cancel drops it).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Callable

import numpy as np

from service import tracing
from service.config import EngineOptions
from service.engine.batcher import Batcher, QueuePlace, Ticket
from service.engine.core import Engine
from service.engine.job import EncodeJob
from service.engine.loader import LoadedModel
from service.engine.runner import use_compile_cache
from service.engine.messages import (Cancel, Claim, EngineStatus, Failed, FromEngine, Grant, Hit, Joined,
    MetricsQuery, MetricsText, ModelInfo, Queued, Result, Status, StatusQuery, Submit, ToEngine)
from service.errors import BackendError, KeyConflict, ServiceError, VideoError
from service.media.images import PreparedImage, warmup_image
from service.media.preprocess import grid_for, num_tokens
from service.media.video_preprocess import PreparedVideo, video_grid
from service.metrics import Metrics
from service.priority import Urgency
from service.store import Identity, Store, open_store
from service.store.format import StoredItem
from service.store.keys import key_salt, validate_key
from service.tracing import Stamps

log = logging.getLogger(__name__)


def model_identity(model: LoadedModel) -> Identity:
    """Whose entries the engine's store holds: this model's, at its width and dtype."""
    return Identity(model_id=model.model_id, out_hidden_size=model.spec.out_hidden_size,
                    deepstack_levels=model.spec.deepstack_levels, dtype=str(model.dtype).replace("torch.", ""),
                    salt=model_salt(model))


def model_salt(model: LoadedModel) -> str:
    """The model's part of every content key (store/keys.py's key_salt)."""
    t = model.tower
    return key_salt(model.model_id, model.params, str(model.dtype), t.fp8_gemms, t.fp8_blocks)


def build_host(model: LoadedModel, options: EngineOptions, shard: tuple[int, int] = (0, 1)) -> EngineHost:
    """An engine for `model` on its device (compiled, graphs captured: seconds on a GPU) and its host.
    Call `warm_up()` (blocking) to start serving."""
    metrics = Metrics()
    use_compile_cache(model, options.runner)  # before the first compile
    engine = Engine(model, open_store(options.store, model_identity(model), shard), Batcher(options.limits),
                    options.runner, metrics, store_writers=options.store.writers)
    return EngineHost(engine, model, metrics, warmup=options.warmup)


class Connection:
    """One API side's link to the host: how to answer it, and what it holds."""

    def __init__(self, send: Callable[[FromEngine], None], post: Callable[[Callable[[], None]], None]):
        self.send = send  # on the host's thread only
        self.post = post  # run a function on the host's thread (from any thread)
        self.waits: dict[int, Ticket] = {}  # request id -> its wait for an entry
        self.grants: dict[int, QueuePlace] = {}  # claim id -> the queue place it was granted
        self.pending: set[int] = set()  # claims waiting for a store's lookup that is not answered at once
        self.open = True


class EngineHost:
    """What the engine does for each message (see the module docstring). Not thread-safe: one thread."""

    def __init__(self, engine: Engine, model: LoadedModel, metrics: Metrics, *, warmup: bool = True):
        self.engine, self.model, self.metrics = engine, model, metrics
        self.store: Store = engine.store
        self.batcher: Batcher[EncodeJob] = engine.batcher
        self._warmup = warmup
        self.ready = threading.Event()
        self.warmup_error: str | None = None
        self.startup: dict[str, float] = {"load_s": model.load_s, **engine.runner.startup}
        self._created = time.perf_counter()

    # ---- lifecycle ----------------------------------------------------------------------------
    def warm_up(self, before_ready: Callable[[], None] | None = None) -> None:
        """Run one step through the whole path (compiled kernels, graphs), start the step loop, and say
        ready. Blocking (seconds on a GPU); a failure is logged and reported by `status`, not raised.
        `before_ready`: what the process does last before it serves (an engine process: procs/child.py's
        settle_heap)."""
        try:
            t0 = time.perf_counter()
            if self._warmup:
                self.engine.encode_sync([warmup_image(self.model.params)])
            self.startup["warmup_s"] = round(time.perf_counter() - t0, 2)
            self.engine.start()
            if before_ready is not None:
                before_ready()
            self.startup["total_s"] = round(time.perf_counter() - self._created + self.model.load_s, 2)
            self.ready.set()
            log.info("engine ready: %s on %s (%s); start-up %s", self.model.model_id, self.model.device,
                     self.model.dtype, ", ".join(f"{k} {v}" for k, v in self.startup.items()))
        except Exception as e:
            self.warmup_error = f"warm-up failed ({type(e).__name__}: {e}); see the log"
            log.exception("warm-up failed: /ready and /health say so")

    def stop(self, timeout: float = 60) -> None:
        """Drain: no new work, the queued steps finish and are written, then the store is released."""
        self.batcher.close()
        self.engine.join(timeout)
        self.store.close()

    # ---- connections ----------------------------------------------------------------------------
    def connect(self, send: Callable[[FromEngine], None], post: Callable[[Callable[[], None]], None]) -> Connection:
        return Connection(send, post)

    def disconnect(self, conn: Connection) -> None:
        """The API side closed (or its process died): its waits are gone, its grants given back."""
        conn.open = False
        conn.pending.clear()
        for t in conn.waits.values():
            t.cancel()
        conn.waits.clear()
        for place in conn.grants.values():
            place.release()
        conn.grants.clear()

    # ---- messages -------------------------------------------------------------------------------
    def handle(self, conn: Connection, msg: ToEngine, pixels: np.ndarray | None = None,
               release: Callable[[], None] = lambda: None) -> None:
        """Answer one message. A Submit comes with its pixels (flat uint8, read in place until
        `release`, which is called once, on this thread, when nothing will read them again)."""
        try:
            if isinstance(msg, Claim):
                self._claim(conn, msg)
            elif isinstance(msg, Submit):
                assert pixels is not None, "a Submit without its pixels: this is a bug"
                self._submit(conn, msg, pixels, release)
            elif isinstance(msg, Cancel):
                self._cancel(conn, msg.id)
            elif isinstance(msg, StatusQuery):
                conn.send(Status(msg.id, self.status()))
            elif isinstance(msg, MetricsQuery):
                conn.send(MetricsText(msg.id, self.metrics_text()))
            else:
                raise AssertionError(f"unknown message {msg!r}: this is a bug")
        except Exception as e:
            self._fail(conn, msg, e)

    def _fail(self, conn: Connection, msg: ToEngine, e: Exception) -> None:
        """A ServiceError is the client's answer; anything else a bug: fail that request."""
        if not isinstance(e, ServiceError):
            log.exception("engine: %s %s failed", type(msg).__name__, msg.id)
        conn.send(_failed(msg.id, e))

    def _with_entry(self, conn: Connection, msg: Claim | Submit, then: Callable[[StoredItem | None], None],
                    drop: Callable[[], None] = lambda: None) -> None:
        """then(entry) on the host's thread, `entry` the store's for msg.key if it holds these bytes'
        embeddings, else None (an entry without a recorded hash is encoded again); a KeyConflict (the key
        names other bytes there) or a store error fails the message after drop() gave back what it holds.
        A claim asks the store (`find`); where that is a round trip (Mooncake) its answer comes later, on
        the store's thread: meanwhile the message is pending, and if it is cancelled or its connection
        goes, drop() is all that happens.

        NOTE: a submit asks only what the store knows without a round trip (`known`). Its check is for an
        entry stored since its claim missed, and within a host that entry is one this engine wrote (the
        store records it before the item leaves the batcher, so no submit falls between); another host's
        put meanwhile makes this one a duplicate encode, which is harmless. A second round trip per image
        cost Mooncake a fifth of the directory's img/s at 1 image per request on an H200."""
        if isinstance(msg, Claim):
            future = self.store.find(msg.key)
            if not future.done():
                conn.pending.add(msg.id)
                future.add_done_callback(
                    lambda f: conn.post(lambda: self._resume(conn, msg, _outcome(f), then, drop)))
                return
            found = _outcome(future)
        else:
            try:
                found = self.store.known(msg.key)
            except Exception as e:
                found = e
        self._answer(conn, msg, found, then, drop)

    def _resume(self, conn: Connection, msg: Claim | Submit, found: StoredItem | None | Exception,
                then: Callable[[StoredItem | None], None], drop: Callable[[], None]) -> None:
        """A lookup's later answer, on the host's thread: unless the message was cancelled meanwhile."""
        if msg.id not in conn.pending or not conn.open:
            drop()
            return
        conn.pending.discard(msg.id)
        self._answer(conn, msg, found, then, drop)

    def _answer(self, conn: Connection, msg: Claim | Submit, found: StoredItem | None | Exception,
                then: Callable[[StoredItem | None], None], drop: Callable[[], None]) -> None:
        try:
            if isinstance(found, Exception):
                raise found
            video = msg.video if isinstance(msg, Claim) else msg.geometry.video is not None
            entry = self._stored(found, msg.sha256, video)
        except Exception as e:
            drop()
            self._fail(conn, msg, e)
            return
        try:
            then(entry)
        except Exception as e:
            self._fail(conn, msg, e)

    def _stored(self, hit: StoredItem | None, sha256: str, video: bool) -> StoredItem | None:
        if hit is None or hit.content_sha256 is None:
            return None
        if hit.content_sha256 != sha256:
            raise KeyConflict("in the store")
        if (hit.video is not None) != video:  # the same bytes (a GIF, say) as the other kind: other embeddings
            raise KeyConflict(f"in the store, as {'an image' if hit.video is None else 'a video'}")
        self.metrics.cache_hits.inc()
        return hit

    def _claim(self, conn: Connection, msg: Claim) -> None:
        validate_key(msg.key)
        self._with_entry(conn, msg, lambda hit: self._claimed(conn, msg, hit))

    def _claimed(self, conn: Connection, msg: Claim, hit: StoredItem | None) -> None:
        if hit is not None:
            conn.send(Hit(msg.id, hit))
            return
        urgency = Urgency(msg.priority, msg.deadline)
        urgency.check("its image was decoded")
        joined = self.batcher.join(msg.key, urgency)  # an identical image already queued or running: no decode
        if joined is not None:
            if joined.payload.content_sha256 != msg.sha256 or isinstance(joined.payload.image, PreparedVideo) != msg.video:
                joined.cancel()
                raise KeyConflict("being encoded for another request")
            self.metrics.coalesced.inc()
            self._wait(conn, msg.id, joined)
            conn.send(Joined(msg.id))
            return
        # Admission before decode: the grant holds a queue place (with the image's tokens by its header)
        # until its submit; a full queue is Overloaded (429) before any pixels exist.
        conn.grants[msg.id] = self.batcher.reserve(msg.tokens, urgency)
        conn.send(Grant(msg.id))

    def _submit(self, conn: Connection, msg: Submit, pixels: np.ndarray, release: Callable[[], None]) -> None:
        place = conn.grants.pop(msg.grant, None)  # used up by this submit, whatever its outcome

        def drop() -> None:
            if place is not None:
                place.release()
            release()

        try:
            validate_key(msg.key)
            image = self._image(msg, pixels)
        except Exception:
            drop()
            raise
        # Stored meanwhile: two claims of one key can both miss (the first image not yet submitted), and
        # the first's encode can finish before this submit, when there is no queued item to join.
        self._with_entry(conn, msg, lambda hit: self._submitted(conn, msg, image, place, drop, release, hit), drop)

    def _submitted(self, conn: Connection, msg: Submit, image: PreparedImage | PreparedVideo, place: QueuePlace | None,
                   drop: Callable[[], None], release: Callable[[], None], hit: StoredItem | None) -> None:
        try:
            if hit is not None:
                drop()
                conn.send(Hit(msg.id, hit))
                return
            urgency = Urgency(msg.priority, msg.deadline)
            urgency.check("its image was queued")  # (decoded too late: dropped here, never encoded)
            stamps = Stamps(msg.traceparent, tracing.now_ns()) if msg.traceparent and tracing.enabled() else None
            ticket = self.batcher.submit(msg.key, EncodeJob(msg.key, image, msg.sha256, stamps), tokens=image.num_tokens,
                                         place=place, urgency=urgency)
        except Exception:
            drop()
            raise
        if ticket.coalesced:  # joined an item queued meanwhile: these pixels are not needed
            release()
            if ticket.payload.content_sha256 != msg.sha256:
                ticket.cancel()
                raise KeyConflict("being encoded for another request")
            self.metrics.coalesced.inc()
        else:
            # The pixels are read when the item's step is staged; its own future is done only after that
            # (finished) or when it was dropped unstaged. Either way nothing reads them again.
            ticket.work_future.add_done_callback(lambda _f: conn.post(release))
        self._wait(conn, msg.id, ticket)
        conn.send(Queued(msg.id, coalesced=ticket.coalesced))

    def _image(self, msg: Submit, pixels: np.ndarray) -> PreparedImage | PreparedVideo:
        """The submitted pixels as the batcher's image, once their geometry is the one this model's
        preprocessing gives that size (a decoder is another process: trust nothing)."""
        g = msg.geometry
        if g.video is not None:
            return self._video(msg, pixels)
        h, w = g.height, g.width
        params = self.model.params
        ok = (h > 0 and w > 0 and h % params.factor == 0 and w % params.factor == 0 and pixels.size == h * w * 3
              and pixels.dtype == np.uint8 and g.grid_thw == grid_for(h, w, params)
              and g.tokens == num_tokens(g.grid_thw, params))
        if not ok:
            raise BackendError(f"submit of {msg.key}: inconsistent geometry {h}x{w}, {pixels.size} bytes, "
                               f"grid {g.grid_thw}, {g.tokens} tokens")
        t, gh, gw = g.grid_thw
        return PreparedImage(pixels=pixels.reshape(h, w, 3), grid_thw=g.grid_thw, num_patches=t * gh * gw,
                             num_tokens=g.tokens)

    def _video(self, msg: Submit, pixels: np.ndarray) -> PreparedVideo:
        """The submitted frames as the batcher's video, checked as `_image` checks an image's pixels."""
        g, v, vp = msg.geometry, msg.geometry.video, self.model.video
        h, w, n = g.height, g.width, v.frames
        ok = (h > 0 and w > 0 and h % vp.factor == 0 and w % vp.factor == 0 and n > 0
              and n % vp.temporal_patch_size == 0 and pixels.size == n * h * w * 3 and pixels.dtype == np.uint8
              and g.grid_thw == video_grid(n, h, w, vp) and len(v.timestamps) == g.grid_thw[0] and v.indices
              and g.tokens == g.grid_thw[0] * g.grid_thw[1] * g.grid_thw[2] // vp.merge_size**2)
        if not ok:
            raise BackendError(f"submit of video {msg.key}: inconsistent geometry {n} x {h}x{w}, {pixels.size} bytes, "
                               f"grid {g.grid_thw}, {g.tokens} tokens")
        t, gh, gw = g.grid_thw
        if gh * gw > self.engine.runner.max_patches:  # (one temporal group must fit a step)
            raise VideoError(f"a frame of this video is {gh * gw} patches, more than a step holds "
                                f"({self.engine.runner.max_patches}); raise --max-batch-tokens", code="video_too_large")
        return PreparedVideo(pixels.reshape(n, h, w, 3), g.grid_thw, t * gh * gw, g.tokens, tuple(v.indices), v.fps,
                             tuple(v.timestamps))

    def _cancel(self, conn: Connection, rid: int) -> None:
        conn.pending.discard(rid)  # (its lookup's answer then gives back what it holds)
        if (t := conn.waits.pop(rid, None)) is not None:
            t.cancel()
        if (place := conn.grants.pop(rid, None)) is not None:
            place.release()

    def _wait(self, conn: Connection, rid: int, ticket: Ticket) -> None:
        conn.waits[rid] = ticket

        def done(f):
            def answer():
                if conn.waits.pop(rid, None) is None or not conn.open or f.cancelled():
                    return
                exc = f.exception()
                conn.send(_failed(rid, exc) if exc is not None else Result(rid, f.result()))
            conn.post(answer)

        ticket.future.add_done_callback(done)

    # ---- state ------------------------------------------------------------------------------------
    def status(self) -> EngineStatus:
        """/ready's answer, and what an API process needs to key and preprocess images itself."""
        failed = self.warmup_error
        if failed is None and self.ready.is_set() and not self.engine.alive():
            failed = "the step loop is not running; see the log"
        return EngineStatus(ready=self.ready.is_set() and failed is None, failed=failed,
                            store_error=self.store.health(), key_salt=model_salt(self.model),
                            params=self.model.params, video=self.model.video, pid=os.getpid(), info=self.model_info())

    def model_info(self) -> ModelInfo:
        m, runner = self.model, self.engine.runner
        return ModelInfo(model=m.model_id, device=str(m.device), dtype=str(m.dtype).replace("torch.", ""),
                         random_weights=m.random_weights, out_hidden_size=m.spec.out_hidden_size,
                         deepstack_levels=m.spec.deepstack_levels, compiled=m.tower.compiled,
                         cuda_graphs=len(runner.graphs) if runner.graphs else 0, startup_s=dict(self.startup),
                         min_pixels=m.params.min_pixels, max_pixels=m.params.max_pixels, store=self.store.location,
                         fp8_blocks=list(m.tower.fp8_blocks), fp8_gemms=list(m.tower.fp8_gemms),
                         attention=m.tower.attention_plan.describe())

    def metrics_text(self) -> str:
        self.metrics.update_gauges(self.batcher, self.store)
        return self.metrics.exposition(api_side=False).decode()


def _outcome(future) -> StoredItem | None | Exception:
    """A store lookup's answer: its item (None: a miss), or the error it raised."""
    return future.exception() or future.result()


def _failed(rid: int, e: BaseException) -> Failed:
    if isinstance(e, ServiceError):
        return Failed(rid, e.code, e.message, getattr(e, "retry_after_s", None))
    return Failed(rid, BackendError.code, f"the engine failed on this request ({type(e).__name__}); the server's log "
                                          "has the error")  # (logged by EngineHost._fail)


class LocalTransport:
    """A single-process service's transport: the EngineClient calls the host directly, on the event
    loop's thread (the host's thread here); the writer's answers are posted to the loop. No socket, no
    copy: a Submit's pixels are the decoder's array. With `owner`, closing it drains the host (its only
    client is going: the step loop finishes its queue, the store is released)."""

    travels = False  # a claim is answered before `send` returns: nothing to hide a decode behind

    def __init__(self, host: EngineHost, owner: bool = False):
        self.host, self.owner = host, owner
        self.connected = False
        self._conn: Connection | None = None

    async def connect(self, deliver: Callable[[FromEngine], None], lost: Callable[[], None]) -> None:
        loop = asyncio.get_running_loop()
        self._conn = self.host.connect(deliver, loop.call_soon_threadsafe)
        self._lost = lost
        self.connected = True

    def send(self, msg: ToEngine, pixels: np.ndarray | None = None) -> None:
        assert not (isinstance(msg, Submit) and msg.cell is not None), "an arena cell in process: this is a bug"
        flat = None if pixels is None else pixels.reshape(-1)
        self.host.handle(self._conn, msg, flat)

    async def close(self) -> None:
        if self._conn is not None:
            self.host.disconnect(self._conn)
            self.connected = False
            self._lost()
        if self.owner:
            await asyncio.to_thread(self.host.stop)
