"""The engine process: the model, the batcher, the step loop and the store writer of one device
(with several --devices, of one store shard: the keys with store.shard_of(key, n) == i),
answering the API processes over a Unix socket (ipc.py). Pixels arrive in the API processes'
shared-memory arenas (arena.py) and are read in place when a step is staged.

    API process --claim/submit--> EngineHost.handle (ipc thread) --> Batcher --> Engine step loop
                 <--hit/result/cell_free--  (futures' callbacks, posted back to the ipc thread)
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from dataclasses import astuple

from service.procs.arena import ArenaReader
from service.engine.batcher import Batcher, QueuePlace, Ticket
from service.config import FaultInjection, Settings, StoreOptions
from service.engine.core import EncodeJob, Engine
from service.errors import KeyConflict, ServiceError
from service.media.images import PreparedImage
from service.procs.ipc import EngineServer, error_to_wire, item_to_wire
from service.engine.loader import LoadedModel, load_model
from service.engine.runner import use_compile_cache
from service.metrics import Metrics
from service.store.directory import EmbeddingStore
from service.store.format import validate_key

log = logging.getLogger(__name__)


def build_store(options: StoreOptions, model: LoadedModel, shard: tuple[int, int] = (0, 1)) -> EmbeddingStore:
    """The store of one engine; shard (i, n) of n engines gets 1/n of --store-capacity-bytes."""
    return EmbeddingStore(
        options.root, options.capacity_bytes // shard[1], model_id=model.model_id,
        out_hidden_size=model.spec.out_hidden_size, deepstack_levels=model.spec.deepstack_levels,
        dtype=str(model.dtype).replace("torch.", ""), min_residency_s=options.min_residency_s,
        exclusive=True, group=options.group, shard=shard,
    )


def build_batcher(settings: Settings) -> Batcher[EncodeJob]:
    return Batcher(settings.batch_limits())


def key_salt(model: LoadedModel) -> str:
    """Part of every content-hash key: the same bytes under another model or preprocessing are another key."""
    return f"{model.model_id}|{model.params}|{model.dtype}"


def model_info(model: LoadedModel, engine: Engine, startup: dict, ready: bool) -> dict:
    """What /ready answers about the model and its engine (single process and engine process alike)."""
    m = model
    return {"ready": ready, "model": m.model_id, "device": str(m.device), "dtype": str(m.dtype).replace("torch.", ""),
            "random_weights": m.random_weights, "out_hidden_size": m.spec.out_hidden_size,
            "deepstack_levels": m.spec.deepstack_levels, "compiled": m.tower.compiled,
            "cuda_graphs": len(engine.runner.graphs) if engine.runner.graphs else 0, "startup_s": startup,
            # The preprocessing bounds in force (--min-pixels / --max-pixels or the checkpoint's): a client
            # that recomputes embeddings (the load tool's --verify) must resize the same way.
            "min_pixels": m.params.min_pixels, "max_pixels": m.params.max_pixels,
            "store": str(engine.store.root)}  # where a consumer on this machine reads the answered `path`s


class _Conn:
    def __init__(self, send):
        self.send = send
        self.tickets: dict[int, Ticket] = {}
        self.grants: dict[int, QueuePlace] = {}  # claim id -> the queue place it was granted
        self.open = True


class EngineHost:
    """What the engine does for each message (ipc.py lists them). Runs on the ipc thread; never blocks."""

    def __init__(self, settings: Settings, model: LoadedModel, store: EmbeddingStore, batcher: Batcher,
                 engine: Engine, metrics: Metrics):
        self.settings, self.model, self.store, self.batcher, self.engine, self.metrics = (
            settings, model, store, batcher, engine, metrics)
        self.reader = ArenaReader()
        self.server: EngineServer | None = None
        self.ready = threading.Event()
        self.startup: dict[str, float] = {}

    # ---- connections ---------------------------------------------------------------------------
    def connected(self, send) -> _Conn:
        return _Conn(send)

    def disconnected(self, conn: _Conn) -> None:
        """The API process closed (or died): its waiters are gone, its grants given back."""
        conn.open = False
        for t in conn.tickets.values():
            t.cancel()
        conn.tickets.clear()
        for place in conn.grants.values():
            place.release()
        conn.grants.clear()

    def _post(self, conn: _Conn, msg: list) -> None:
        """Send from any thread (the writer resolves futures): hop onto the ipc loop first."""
        self.server.post(lambda: conn.send(msg) if conn.open else None)

    # ---- messages ------------------------------------------------------------------------------
    def handle(self, conn: _Conn, msg: list) -> None:
        kind, rid = msg[0], msg[1]
        try:
            if kind == "claim":
                self._claim(conn, rid, msg[2], msg[3], msg[4])
            elif kind == "submit":
                self._submit(conn, rid, *msg[2:])
            elif kind == "cancel":
                t = conn.tickets.pop(rid, None)
                if t is not None:
                    t.cancel()
                place = conn.grants.pop(rid, None)
                if place is not None:
                    place.release()
            elif kind == "status":
                conn.send(["status", rid, self.status()])
            elif kind == "metrics":
                self.metrics.update_gauges(self.batcher, self.store)
                conn.send(["metrics", rid, self.metrics.exposition(api_side=False).decode()])
            else:
                raise ValueError(f"unknown message {kind!r}")
        except ServiceError as e:
            conn.send(["error", rid, *error_to_wire(e)])
        except Exception as e:  # a bug or a malformed message: fail that request, keep the connection
            log.exception("engine: %s message %s failed", kind, rid)
            conn.send(["error", rid, *error_to_wire(e)])

    def _claim(self, conn: _Conn, rid: int, key: str, sha: str, tokens: int) -> None:
        validate_key(key)
        hit = self.store.lookup(key)
        if hit is not None and hit.content_sha256 is not None:  # an entry without a recorded hash: encode again
            if hit.content_sha256 != sha:
                raise KeyConflict("in the store")
            self.metrics.cache_hits.inc()
            conn.send(["hit", rid, item_to_wire(hit)])
            return
        joined = self.batcher.join(key)  # an identical image already queued or running: no decode
        if joined is not None:
            if joined.payload.content_sha256 != sha:
                joined.cancel()
                raise KeyConflict("being encoded for another request")
            self._wait(conn, rid, joined)
            conn.send(["joined", rid])
            return
        # Admission before decode: a grant holds a queue place (with the image's tokens by its header) until
        # its submit; a full queue is Overloaded (the API process that answers 429 counts it as rejected).
        conn.grants[rid] = self.batcher.reserve(int(tokens))
        conn.send(["decode", rid])

    def _submit(self, conn: _Conn, rid: int, grant: int, key: str, sha: str, segment: str, offset: int,
                nbytes: int, h: int, w: int, grid: list[int], tokens: int) -> None:
        place = conn.grants.pop(grant, None)  # used up by this submit, whatever its outcome
        cell = ["cell_free", segment, offset, nbytes]
        try:
            validate_key(key)
            # Stored meanwhile: two claims of one key can both miss (the first image not yet submitted), and
            # the first's encode can finish before this submit, when there is no queued item to join.
            hit = self.store.lookup(key)
            if hit is not None and hit.content_sha256 is not None:
                if hit.content_sha256 != sha:
                    raise KeyConflict("in the store")
                if place is not None:
                    place.release()
                conn.send(cell)
                self.metrics.cache_hits.inc()
                conn.send(["queued", rid])
                conn.send(["result", rid, item_to_wire(hit)])
                return
            t_, gh, gw = grid
            if nbytes != h * w * 3 or h <= 0 or w <= 0 or tokens * self.model.spec.merge_size**2 != t_ * gh * gw:
                raise ValueError(f"submit of {key}: inconsistent geometry {h}x{w}, {nbytes} bytes, grid {grid}")
            pixels = self.reader.view(segment, offset, nbytes).reshape(h, w, 3)
            image = PreparedImage(pixels=pixels, grid_thw=(t_, gh, gw), num_patches=t_ * gh * gw, num_tokens=tokens,
                                  orig_size=(w, h))
            ticket = self.batcher.submit(key, EncodeJob(key, image, sha), tokens=tokens, place=place)
        except Exception:
            if place is not None:
                place.release()
            conn.send(cell)
            raise
        if ticket.coalesced:  # joined an item queued meanwhile: our pixels are not needed
            conn.send(cell)
            if ticket.payload.content_sha256 != sha:
                ticket.cancel()
                raise KeyConflict("being encoded for another request")
        else:
            # The cell is read when its step is staged; the item's own future is done only after that
            # (finished) or when it was dropped unstaged. Either way nothing reads the cell again.
            ticket.work_future.add_done_callback(lambda _f: self._post(conn, cell))
        self._wait(conn, rid, ticket)
        conn.send(["queued", rid])

    def _wait(self, conn: _Conn, rid: int, ticket: Ticket) -> None:
        conn.tickets[rid] = ticket

        def done(f):
            def answer():
                if conn.tickets.pop(rid, None) is None or not conn.open or f.cancelled():
                    return
                exc = f.exception()
                conn.send(["error", rid, *error_to_wire(exc)] if exc is not None else ["result", rid, item_to_wire(f.result())])
            self.server.post(answer)

        ticket.future.add_done_callback(done)

    def status(self) -> dict:
        """/ready's answer ("info"), and what an API process needs to key and preprocess images itself."""
        return {"info": model_info(self.model, self.engine, self.startup, self.ready.is_set()),
                "key_salt": key_salt(self.model), "params": list(astuple(self.model.params)), "pid": os.getpid(),
                "store_error": self.store.unwritable}


def engine_main(settings: Settings, socket_path: str, log_level: str, parent_pid: int,
                shard: tuple[int, int] = (0, 1)) -> None:
    """Entry point of an engine process (spawned by the supervisor): shard (i, n) of n, on settings.device."""
    from service.procs.supervisor import child_setup

    child_setup(parent_pid, log_level, "engine" if shard[1] == 1 else f"engine{shard[0]}")
    # As in a single-process service (see __main__): the ipc thread, the step loop and the store writers
    # share the GIL; a 1 ms switch interval keeps each hand-off short.
    sys.setswitchinterval(0.001)
    t0 = time.perf_counter()
    model = load_model(settings)
    metrics = Metrics()
    store_options, runner_options = settings.store_options(), settings.runner_options(FaultInjection.from_env(os.environ))
    store = build_store(store_options, model, shard)
    batcher = build_batcher(settings)
    use_compile_cache(model, runner_options)
    engine = Engine(model, store, batcher, runner_options, metrics, store_writers=store_options.writers)
    host = EngineHost(settings, model, store, batcher, engine, metrics)
    host.startup = {"load_s": model.load_s, **engine.runner.startup}
    host.server = server = EngineServer(socket_path, host)
    server.start()  # the API processes connect now; /ready says 503 until the warm-up below is done
    stop = threading.Event()
    # SIGTERM (from the supervisor, once the API processes have stopped) drains; SIGINT stays ignored
    # (child_setup): a terminal's Ctrl-C reaches this process too, before the API processes are done.
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    if settings.warmup:
        from service.api.encode import warmup_image

        engine.encode_sync([warmup_image(model)])
    engine.start()
    host.startup["total_s"] = round(time.perf_counter() - t0 + model.load_s, 2)
    host.ready.set()
    log.info("engine ready: %s on %s (%s); start-up %s", model.model_id, model.device, model.dtype,
             ", ".join(f"{k} {v}" for k, v in host.startup.items()))
    while not stop.wait(0.5):
        if not engine.alive():
            log.error("the step loop died; the engine exits")
            os._exit(1)
    # Drain: no new work, the queued steps finish and are written, then the store is released.
    batcher.close()
    engine.join(60)
    server.stop()
    store.close()
    log.info("engine stopped")
