"""Encode orchestration, behind the HTTP layer: keys, cache checks, claims, coalescing, decode, submit,
and waiting for the answers, with the runtimes that own the resources for it.

`encode(rt, inputs, client_gone)` takes parsed inputs (bytes, an optional uuid, where they were fetched
from) and answers one `Answer` per image, in order, or None if the client went away first. It never
sees an HTTP request: app.py parses, calls it, and maps its answers and its ServiceErrors to HTTP.
Two paths with the same answers: a single process (`Runtime`: the model, the batcher and the store
here) and an API process of a supervised service (`RemoteRuntime`: the engine process decides hits,
coalescing and admission, ipc.py).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import logging
import multiprocessing
import os
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import httpx
import numpy as np

from service.engine.batcher import QueuePlace, Ticket
from service.config import FaultInjection, ImageLimits, Settings
from service.errors import (
    BackendError,
    EmptyImage,
    ImageError,
    KeyConflict,
    Overloaded,
    ServiceError,
    Unavailable,
    at_index,
)
from service.media.images import PreparedImage, header_tokens, prepare_image
from service.metrics import Metrics
from service.store.directory import StoredItem
from service.store.format import CONTENT_KEY_PREFIX, validate_key
from service.procs.supervisor import exit_with

if TYPE_CHECKING:  # the single-process runtime's; an API process (RemoteRuntime) never imports torch
    from service.engine.loader import LoadedModel

log = logging.getLogger(__name__)

# A decode waiting this long with no decode of its pool finishing meanwhile means the pool is stuck
# (Runtime.decode). The largest admitted image decodes in about a second on one core.
DECODE_STALL_S = 30.0


@dataclass
class Input:
    """One image of a request, as parsed (app.py)."""

    data: bytes
    uuid: str | None
    source: str | None = None  # the URL it was fetched from (errors must not echo fetched content)


class Answer(NamedTuple):
    """One image's answer: its entry in the store, and whether it was there before this request."""

    stored: StoredItem
    cached: bool


# Whether the client has gone away (the HTTP request's `is_disconnected`): polled while a request waits.
ClientGone = Callable[[], Awaitable[bool]]


class Phases:
    """Where one request's time went, for its `Server-Timing` response header (W3C Server Timing: browsers'
    developer tools and `curl -i` show it): each `mark(name)` ends the phase `name` that began at the
    previous mark. Wall time of this request, not CPU time: concurrent requests overlap."""

    def __init__(self) -> None:
        self.start = self._last = time.perf_counter()
        self.spans: list[tuple[str, float]] = []

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        self.spans.append((name, now - self._last))
        self._last = now

    def header(self) -> str:
        parts = [f"{name};dur={s * 1e3:.3f}" for name, s in self.spans]
        return ", ".join(parts + [f"total;dur={(self._last - self.start) * 1e3:.3f}"])


async def encode(rt: Runtime | RemoteRuntime, inputs: list[Input], client_gone: ClientGone,
                 phases: Phases | None = None) -> list[Answer] | None:
    """Answer one item per input image, in order; None if the client went away first (its queued work
    is cancelled). Raises the request's ServiceError; nothing of a failed request stays queued.
    `phases` gets the marks keys, admit (cache checks, claims, queue places), decode (decoded and
    queued) and encode (every answer in the store)."""
    phases = phases or Phases()
    if isinstance(rt, RemoteRuntime):
        return await _encode_remote(rt, inputs, client_gone, phases)
    return await _encode_local(rt, inputs, client_gone, phases)


# ---- the running service --------------------------------------------------------------------------
class Runtime:
    """Everything one app instance owns. Built in the lifespan; torn down gracefully on shutdown."""

    def __init__(self, settings: Settings, model: LoadedModel):
        from service.engine.core import Engine
        from service.engine.runner import use_compile_cache
        from service.procs.enginep import build_batcher, build_store, key_salt

        self.created_at = time.perf_counter()
        self.settings, self.model = settings, model
        self.metrics = Metrics()
        store_options, runner_options = settings.store_options(), settings.runner_options(FaultInjection.from_env(os.environ))
        self.store = build_store(store_options, model)
        self.batcher = build_batcher(settings)
        use_compile_cache(model, runner_options)
        self.engine = Engine(model, self.store, self.batcher, runner_options, self.metrics,
                             store_writers=store_options.writers)
        # Seconds per start-up phase: load, compile, graph capture (in the Runner), warm-up (in start()).
        self.startup: dict[str, float] = {"load_s": model.load_s, **self.engine.runner.startup}
        self.decode_workers = settings.decode_workers or min(8, os.cpu_count() or 1)
        self.decoders = self._decode_pool()
        self._decode_done = time.monotonic()  # when a decode last finished (a pool that finishes none is stuck)
        self.http = httpx.AsyncClient(timeout=settings.url_timeout_s, follow_redirects=False)
        self.ready = threading.Event()
        self.started = False
        self.warmup_failed = False
        self.key_salt = key_salt(model).encode()

    def _decode_pool(self) -> concurrent.futures.ProcessPoolExecutor:
        # NOTE: processes, not threads: PIL decode + bicubic resize hold the GIL for most of their time.
        # forkserver/spawn, not fork: this process already runs threads (torch, the step loop).
        # Each worker exits when this process does: a SIGKILL of the service leaves no worker behind (and
        # then no forkserver: the workers were what kept it alive).
        method = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
        return concurrent.futures.ProcessPoolExecutor(self.decode_workers, mp_context=multiprocessing.get_context(method),
                                                      initializer=exit_with, initargs=(os.getpid(),))

    async def decode(self, data: bytes) -> PreparedImage:
        """prepare_image in a decode worker. A dead worker (the OOM killer's SIGKILL) breaks the whole
        pool: it is replaced at once and this image answered 503, so one death costs one request.

        A pool can also stop answering without breaking: the chaos test met it once in CI (after a
        worker's SIGKILL the pool finished no more decodes and the executor never reported it broken;
        why was not found). So a decode that waits DECODE_STALL_S with no decode of its pool finishing
        meanwhile takes the pool for stuck: its workers are killed, a new pool starts, and the images
        waiting on the old one are answered 503."""
        pool = self.decoders
        waiting_since = time.monotonic()
        try:  # (a pool already broken raises here, at submit)
            fut = asyncio.get_running_loop().run_in_executor(pool, prepare_image, data, self.model.params,
                                                             self.settings.image_limits)
            while not (await asyncio.wait({fut}, timeout=1.0))[0]:
                stalled = time.monotonic() - max(waiting_since, self._decode_done) > DECODE_STALL_S
                if stalled or pool is not self.decoders:
                    fut.cancel()
                    if self.decoders is pool:
                        log.error("no decode finished in %.0f s: the decode pool is stuck; starting a new one",
                                  DECODE_STALL_S)
                        self.decoders = self._decode_pool()
                        for worker in list(pool._processes.values()):  # (private, stable since 3.2)
                            worker.kill()
                        pool.shutdown(wait=False, cancel_futures=True)
                    raise Unavailable("the image decode workers stopped answering; they have been replaced: retry",
                                      retry_after_s=1)
            self._decode_done = time.monotonic()  # any outcome, a refused image too: the pool is alive
            prepared = fut.result()
        except concurrent.futures.BrokenExecutor:  # BrokenProcessPool
            if self.decoders is pool:
                log.error("a decode worker died (killed, out of memory?); starting a new pool")
                self.decoders = self._decode_pool()
                await asyncio.to_thread(pool.shutdown, wait=True, cancel_futures=True)
            raise Unavailable("an image decode worker died while decoding (out of memory?); it has been replaced: "
                              "retry", retry_after_s=1) from None
        return prepared

    def start(self) -> None:
        def warm_then_run():
            try:
                t0 = time.perf_counter()
                if self.settings.warmup:
                    image = warmup_image(self.model)
                    self.engine.encode_sync([image])
                    # Start every decode worker now (imports, forkserver) rather than on the first requests.
                    blob = _warmup_png()
                    list(self.decoders.map(prepare_image, [blob] * self.decode_workers,
                                           [self.model.params] * self.decode_workers,
                                           [self.settings.image_limits] * self.decode_workers))
                self.startup["warmup_s"] = round(time.perf_counter() - t0, 2)
                self.startup["total_s"] = round(time.perf_counter() - self.created_at + self.model.load_s, 2)
                self.engine.start()
                self.started = True
                self.ready.set()
                log.info("ready: %s on %s (%s); start-up %s", self.model.model_id, self.model.device,
                         self.model.dtype, ", ".join(f"{k} {v}" for k, v in self.startup.items()))
            except Exception:
                self.warmup_failed = True
                log.exception("warm-up failed: /ready and /health will say so")

        threading.Thread(target=warm_then_run, name="warmup", daemon=True).start()

    async def shutdown(self) -> None:
        # uvicorn has already waited for open requests; close the queue, let the loop drain and the writer flush.
        self.batcher.close()
        await asyncio.to_thread(self.engine.join, 60)
        # NOTE: wait=True. Decode workers forked by the forkserver hold its liveness pipe; workers left
        # running (wait=False) keep the forkserver, and so themselves, alive after this process exits.
        await asyncio.to_thread(self.decoders.shutdown, wait=True, cancel_futures=True)
        await self.http.aclose()
        self.store.close()  # the writer is done: release the root for a later service


@dataclass
class RemoteEngine:
    """Where an API process finds its engines (supervisor mode: one per device) and its own pixel arena."""

    socket_paths: list[str]
    arena_name: str
    arena_bytes: int


class RemoteRuntime:
    """An API process's runtime (supervisor mode): no model, no tensors. Decodes in threads, writes
    pixels into its shared-memory arena, and asks the engine process (ipc.py) for everything else."""

    def __init__(self, settings: Settings, remote: RemoteEngine):
        from service.procs.arena import Arena
        from service.procs.ipc import EngineRouter

        self.settings = settings
        self.metrics = Metrics()
        self.arena = Arena(remote.arena_name, remote.arena_bytes)
        self.client = EngineRouter(remote.socket_paths, self._cell_free)
        # NOTE: threads, not processes: this process's only job is HTTP and decoding, and there are
        # several such processes; PIL releases the GIL while it decodes and resizes.
        self.decoders = concurrent.futures.ThreadPoolExecutor(settings.decode_workers or 4, thread_name_prefix="decode")
        self.http = httpx.AsyncClient(timeout=settings.url_timeout_s, follow_redirects=False)
        self.info: dict | None = None  # the engine's status, once it has answered
        self.params = None
        self.key_salt = b""
        self.engine_lost = False
        self.mismatch: str | None = None  # the engines disagree on keys / preprocessing (see EngineRouter.status)
        self.requests_in_flight = 0  # requests between their keys and their last submit (an idle process decodes early)
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._connect())

    async def _connect(self) -> None:
        from service.config import PreprocessParams
        from service.procs.ipc import EngineMismatch

        await self.client.connect()
        while self.client.connected:
            try:
                info = await self.client.status()
            except EngineMismatch as e:  # never ready: /health and /ready say why, and the log
                self.mismatch = str(e)
                log.error("%s", e)
                return
            if self.params is None:
                self.params = PreprocessParams(*[tuple(x) if isinstance(x, list) else x for x in info["params"]])
                self.key_salt = info["key_salt"].encode()
            self.info = info
            if info["info"]["ready"]:
                break
            await asyncio.sleep(0.2)
        self.engine_lost = not self.client.connected

    def _cell_free(self, segment: str, offset: int, nbytes: int) -> None:
        if segment == self.arena.name:
            self.free_cell(offset, nbytes)

    def free_cell(self, offset: int, nbytes: int) -> None:
        self.arena.free(offset, nbytes)
        # Kept current here, not at scrape time: any API process answers /metrics for all of them.
        self.metrics.arena_bytes.set(self.arena.used)

    @property
    def ready(self) -> bool:
        return bool(self.info and self.info["info"]["ready"] and self.client.connected)

    async def require_ready(self) -> None:
        """503 until the engine answers ready (app.py asks before it reads the request body). This process
        polls the engine's status every 0.2 s while it starts; a request in that window asks the engine
        itself, so that a sibling API process's /ready 200 is never followed by a 503 from this one."""
        if not self.ready and self.info is not None and self.client.connected and self.mismatch is None:
            from service.procs.ipc import EngineMismatch

            try:
                info = await self.client.status()
            except (ServiceError, EngineMismatch):  # the poll (_connect) reports these
                info = None
            if info is not None and info["info"]["ready"]:
                self.info = info
        if not self.ready:
            raise Unavailable("the encoder is still starting (or its engine is not running); retry shortly",
                              retry_after_s=1)

    async def shutdown(self) -> None:
        if self._task is not None:
            self._task.cancel()
        await self.client.close()
        await asyncio.to_thread(self.decoders.shutdown, wait=True, cancel_futures=True)
        await self.http.aclose()
        log.info("pixel arena %s: %d bytes in use at exit", self.arena.name, self.arena.used)
        self.arena.close()


def _prepare_into_arena(rt: RemoteRuntime, data: bytes) -> tuple[PreparedImage, int]:
    """Decode + preprocess (a decode thread), then copy the pixels into a new arena cell."""
    from service.procs.arena import ArenaFull

    prep = prepare_image(data, rt.params, rt.settings.image_limits)
    try:
        off = rt.arena.alloc(prep.pixels.nbytes)
    except ArenaFull as e:
        raise Overloaded(f"too many images being decoded or queued in this process ({e}); retry shortly",
                         retry_after_s=1) from None
    rt.arena.view(off, prep.pixels.nbytes)[:] = prep.pixels.reshape(-1)
    rt.metrics.arena_bytes.set(rt.arena.used)
    return prep, off


async def _encode_remote(rt: RemoteRuntime, inputs: list[Input], client_gone: ClientGone,
                         phases: Phases) -> list[Answer] | None:
    """`_encode_local` for an API process: the same answers, with the engine process deciding hits,
    coalescing and admission (a claim per image, before it is decoded). The caller has checked
    `await rt.require_ready()`."""
    keys, shas, tokens = await _keys_for(rt, inputs, rt.params)
    phases.mark("keys")
    answers: dict[str, Answer] = {}
    waits: dict[str, tuple[int, asyncio.Future, bool]] = {}  # key -> (request id, future, coalesced)
    grants: dict[str, tuple[int, int]] = {}  # key -> (grant id, image index) to decode

    def conflict(i: int, where: str) -> KeyConflict:
        return at_index(KeyConflict(f"images[{i}]: uuid {keys[i]!r} is already bound to other image bytes ({where}); "
                                    "a uuid must name one image: choose another uuid, or leave it out"), i)

    def give_back() -> None:
        for rid, fut, _ in waits.values():
            fut.cancel()
            rt.client.cancel(rid)
        for gid, _ in grants.values():
            rt.client.cancel(gid)

    loop = asyncio.get_running_loop()
    firsts: dict[str, int] = {}  # key -> the first image with it (a key twice in one request is handled once)
    for i, key in enumerate(keys):
        firsts.setdefault(key, i)

    # Admission happens before decode (a full engine answers 429 before any pixels exist), except on an
    # idle API process: a request that finds no other request here decodes while its claims travel, so
    # a lone image does not pay the claim's round trip before its decode. Under load nothing is decoded
    # ahead of its grant. A speculative decode whose claim is not a grant frees its cell when it ends.
    early: dict[str, asyncio.Future] = {}
    if rt.requests_in_flight == 0:
        early = {key: loop.run_in_executor(rt.decoders, _prepare_into_arena, rt, inputs[i].data)
                 for key, i in firsts.items()}
    rt.requests_in_flight += 1

    def free_when_done(f: asyncio.Future) -> None:
        if not f.cancelled() and f.exception() is None:  # (a failed decode allocated no cell)
            prep, off = f.result()
            rt.free_cell(off, prep.pixels.nbytes)

    def drop_early(keep: set[str]) -> None:
        for key in [k for k in early if k not in keep]:
            early.pop(key).add_done_callback(free_when_done)

    async def decode_and_submit(key: str, gid: int, i: int) -> None:
        try:
            decoded = early.pop(key, None) or loop.run_in_executor(rt.decoders, _prepare_into_arena, rt,
                                                                   inputs[i].data)
            prep, off = await decoded
        except Exception as p:
            raise _decode_failure(inputs, i, p)
        h, w = prep.pixels.shape[:2]
        try:
            rid, fut = await rt.client.submit(gid, key, shas[i], rt.arena.name, off, prep.pixels.nbytes, h, w,
                                              prep.grid_thw, prep.num_tokens)
        except KeyConflict as e:
            raise conflict(i, e.message) from None
        except Unavailable:
            if not rt.client.route(key).connected:  # never reached its engine: nothing else will free the cell
                rt.free_cell(off, prep.pixels.nbytes)
            raise
        finally:
            del grants[key]  # a submit uses its grant up, answered or not
        waits[key] = (rid, fut, False)

    def first_error(outcomes: list) -> BaseException | None:
        return next((o for o in outcomes if isinstance(o, BaseException)), None)

    try:
        # One claim per distinct key, all in flight at once (a round trip each, not one after another);
        # each names the image's tokens by its header: the engine admits by images and tokens.
        claims = await asyncio.gather(*(rt.client.claim(k, shas[i], tokens[i]) for k, i in firsts.items()),
                                      return_exceptions=True)
        for j, ((key, i), c) in enumerate(zip(firsts.items(), claims)):
            if isinstance(c, KeyConflict):
                claims[j] = conflict(i, c.message)
            elif isinstance(c, BaseException):
                continue
            else:
                kind, val = c
                if kind == "hit":
                    answers[key] = Answer(val, cached=True)
                    rt.metrics.images.labels(outcome="cached").inc()
                elif kind == "joined":
                    waits[key] = (*val, True)
                else:
                    grants[key] = (val, i)
        if (err := first_error(claims)) is not None:
            raise err
        phases.mark("admit")
        drop_early(keep=set(grants))
        # Each image is submitted as soon as it is decoded.
        done = await asyncio.gather(*(decode_and_submit(k, gid, i) for k, (gid, i) in list(grants.items())),
                                    return_exceptions=True)
        if (err := first_error(done)) is not None:
            raise err
        phases.mark("decode")
    except BaseException:
        drop_early(keep=set())  # those not submitted (a submitted one has left `early`)
        give_back()  # the request is answered with its error as a whole: nothing of it stays queued
        raise
    finally:
        rt.requests_in_flight -= 1
    futures = [fut for _, fut, _ in waits.values()]
    if not await _wait_or_disconnect(client_gone, futures):
        give_back()
        return None
    phases.mark("encode")
    for key, (_, fut, coalesced) in waits.items():
        answers[key] = Answer(fut.result(), cached=False)
        rt.metrics.images.labels(outcome="coalesced" if coalesced else "encoded").inc()
    return [answers[key] for key in keys]


def _warmup_png() -> bytes:
    """A synthetic image of Qwen3-VL's minimum size (256x256 = 65536 pixels)."""
    import io

    from PIL import Image

    rng = np.random.default_rng(0)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (256, 256, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def warmup_image(model: LoadedModel) -> PreparedImage:
    return prepare_image(_warmup_png(), model.params, ImageLimits())


def _digests(rt: Runtime, data: bytes) -> tuple[str, str]:
    """(SHA-256 of the image bytes, the content key): the key also covers the model and preprocessing,
    so the same bytes under another model are another key; its prefix keeps it out of uuid space."""
    content = hashlib.sha256(data).hexdigest()
    h = hashlib.sha256(rt.key_salt)
    h.update(b"\0")
    h.update(data)
    return content, CONTENT_KEY_PREFIX + h.hexdigest()


async def _wait_or_disconnect(client_gone: ClientGone, futures: list[asyncio.Future]) -> bool:
    """Wait for all futures; False if the client went away first."""
    gathered = asyncio.gather(*futures)

    async def watch():
        while not await client_gone():
            await asyncio.sleep(0.05)

    watcher = asyncio.create_task(watch())
    try:
        done, _ = await asyncio.wait({gathered, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if gathered in done:
        gathered.result()  # re-raise a step failure
        return True
    gathered.cancel()
    return False


async def _keys_for(rt, inputs: list[Input], params) -> tuple[list[str], list[str], list[int]]:
    """Each image's store key (its uuid, or its content key), the SHA-256 of its bytes and its output
    tokens by its header (what admission counts before decode); 409 when one uuid is given to different
    images in one request."""
    for i, inp in enumerate(inputs):
        if not inp.data:
            raise at_index(EmptyImage(f"images[{i}] is empty (0 bytes); send the encoded image file"), i)
        if inp.uuid is not None:
            validate_key(inp.uuid, content_keys=False)  # a client cannot take a content key
    # (sha256 of bytes, content key, header tokens) of every image in one thread hop: a hop each cost an
    # 8-image request 8 event-loop round trips through the executor, and a lone image one more for its
    # tokens (~0.1-0.2 ms of its latency on an idle server).
    limits = rt.settings.image_limits
    digests = await asyncio.to_thread(lambda: [(*_digests(rt, inp.data), header_tokens(inp.data, params, limits))
                                               for inp in inputs])
    keys = [inp.uuid if inp.uuid is not None else key for inp, (_, key, _) in zip(inputs, digests)]
    shas = [sha for sha, _, _ in digests]
    bound: dict[str, str] = {}  # key -> the image bytes' sha256 it names in this request
    for i, (key, sha) in enumerate(zip(keys, shas)):
        if bound.setdefault(key, sha) != sha:
            raise at_index(KeyConflict(f"images[{i}]: uuid {key!r} is also given to other image bytes earlier in this "
                                       "request; one uuid names one image"), i)
    return keys, shas, [tokens for _, _, tokens in digests]


def _decode_failure(inputs: list[Input], i: int, p: BaseException) -> ServiceError:
    """The error to answer for image i whose decode raised `p` (raise it as it is: its cause is set)."""
    if isinstance(p, ImageError):
        if inputs[i].source is not None:  # never echo fetched content (an SSRF read primitive)
            p.message = (f"the content fetched from {inputs[i].source} is not a usable image "
                         f"({p.code}); check the URL")
        p.message = f"images[{i}]: {p.message}"
        return at_index(p, i)
    if isinstance(p, ServiceError):
        return p
    err = BackendError(f"decoding images[{i}] failed: {type(p).__name__}: {p}")
    err.__cause__ = p
    return err


async def _encode_local(rt: Runtime, inputs: list[Input], client_gone: ClientGone,
                        phases: Phases) -> list[Answer] | None:
    """`encode` in a single process: the store, the batcher and the decode pool are this process's."""
    from service.engine.core import EncodeJob  # (imported already by Runtime; not at the top: API processes never need it)

    keys, shas, tokens = await _keys_for(rt, inputs, rt.model.params)
    phases.mark("keys")

    answers: dict[str, Answer] = {}  # key -> answer; a key twice in one request is handled once
    tickets: dict[str, Ticket] = {}  # key -> this request's claim on an encode (queued or running)
    todo: dict[str, int] = {}  # key -> index of the image to decode for it

    def conflict(i: int, where: str) -> KeyConflict:
        return at_index(KeyConflict(f"images[{i}]: uuid {keys[i]!r} is already bound to other image bytes ({where}); "
                                    "a uuid must name one image: choose another uuid, or leave it out"), i)

    def cache_hit(i: int) -> bool:
        hit = rt.store.lookup(keys[i])
        if hit is None or hit.content_sha256 is None:  # an entry without a recorded hash: encode again
            return False
        if hit.content_sha256 != shas[i]:
            raise conflict(i, "in the store")
        answers[keys[i]] = Answer(hit, cached=True)
        rt.metrics.cache_hits.inc()
        rt.metrics.images.labels(outcome="cached").inc()
        return True

    def claim(i: int, ticket: Ticket) -> None:
        tickets[keys[i]] = ticket
        if ticket.coalesced and ticket.payload.content_sha256 != shas[i]:
            raise conflict(i, "being encoded for another request")

    def give_back() -> None:
        for t in tickets.values():
            t.cancel()

    places: dict[str, QueuePlace] = {}  # key -> its queue place while the image is decoded
    try:
        for i, key in enumerate(keys):
            if key in answers or key in tickets or key in todo or cache_hit(i):
                continue
            joined = rt.batcher.join(key)  # an identical image already queued or running: no decode
            if joined is not None:
                claim(i, joined)
            else:
                todo[key] = i

        # Admission before decode: each image to decode takes its queue place (its tokens read from its
        # header) now, so a full queue answers 429 before any pixels exist; an admitted image is queued
        # once decoded, whatever the queue holds by then.
        for key, i in todo.items():
            places[key] = rt.batcher.reserve(tokens[i])
        phases.mark("admit")

        prepared = await asyncio.gather(*(rt.decode(inputs[i].data) for i in todo.values()), return_exceptions=True)
        for i, p in zip(todo.values(), prepared):
            if isinstance(p, BaseException):
                raise _decode_failure(inputs, i, p)

        for (key, i), prep in zip(todo.items(), prepared):
            if not cache_hit(i):  # it may have landed while we decoded
                claim(i, rt.batcher.submit(key, EncodeJob(key, prep, shas[i]), tokens=prep.num_tokens,
                                           place=places[key]))
        phases.mark("decode")
    except ServiceError:
        give_back()  # the request is answered with its error as a whole: nothing of it stays queued
        raise
    finally:
        for place in places.values():
            place.release()  # those not used by a submit (a no-op for the others)
    rt.metrics.coalesced.inc(sum(t.coalesced for t in tickets.values()))
    futures = [asyncio.wrap_future(t.future) for t in tickets.values()]
    if not await _wait_or_disconnect(client_gone, futures):
        give_back()
        return None
    phases.mark("encode")
    for (key, t), fut in zip(tickets.items(), futures):
        answers[key] = Answer(fut.result(), cached=False)
        rt.metrics.images.labels(outcome="coalesced" if t.coalesced else "encoded").inc()
    return [answers[key] for key in keys]
