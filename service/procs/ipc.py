"""API process <-> engine process: small control messages over a Unix socket; pixels stay in the arena.

Frames: a 4-byte little-endian length, then a msgpack list whose first element names the message.

    API -> engine                                   engine -> API
    ["claim", id, key, sha256, tokens]              ["hit", id, item] | ["joined", id] | ["decode", id]
                                                    | ["error", id, code, message, retry_after]
    ["submit", id, grant, key, sha256, segment,     ["queued", id] | ["error", ...], later
      offset, nbytes, h, w, grid_thw, tokens]         ["result", id, item] | ["error", ...]
    ["cancel", id]  (a claim's grant or a wait)     (nothing; the waiter has gone)
    ["status", id]                                  ["status", id, {...}]
    ["metrics", id]                                 ["metrics", id, prometheus text]
                                                    ["cell_free", segment, offset, nbytes]

A claim is admission before decode: "decode" is a grant of one queue place (and of the image's
`tokens`, read from its header), held until the submit (or a cancel, or the connection closing). A joined claim or a queued submit gets its "result" later.
Cells: the engine sends exactly one "cell_free" per submit, once nothing will read the cell again
(its item was staged into a pinned slot, dropped, or was never queued), and the API process reuses
the cell only then.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import struct
import threading
from collections.abc import Callable, Iterator

import msgspec

from service import errors
from service.store.directory import StoredItem, shard_of

log = logging.getLogger(__name__)

_LEN = struct.Struct("<I")
MAX_FRAME = 1 << 20  # control messages are small; anything bigger is a bug or an attack
_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder().decode


def item_to_wire(item: StoredItem) -> dict:
    return {"key": item.key, "path": item.path, "num_tokens": item.num_tokens, "grid_thw": list(item.grid_thw),
            "shape": list(item.shape), "dtype": item.dtype, "nbytes": item.nbytes,
            "content_sha256": item.content_sha256}


def item_from_wire(d: dict) -> StoredItem:
    return StoredItem(key=d["key"], path=d["path"], num_tokens=d["num_tokens"], grid_thw=tuple(d["grid_thw"]),
                      shape=tuple(d["shape"]), dtype=d["dtype"], nbytes=d["nbytes"], content_sha256=d["content_sha256"])


def error_to_wire(e: BaseException) -> tuple[str, str, int | None]:
    if isinstance(e, errors.ServiceError):
        return e.code, e.message, getattr(e, "retry_after_s", None)
    return errors.BackendError.code, f"{type(e).__name__}: {e}", None


def error_from_wire(code: str, message: str, retry_after: int | None) -> errors.ServiceError:
    """The ServiceError class with this code (so the API process answers the engine's status)."""
    for cls in _all_subclasses(errors.ServiceError):
        if getattr(cls, "code", None) == code and "code" in cls.__dict__:
            e = cls.__new__(cls)
            errors.ServiceError.__init__(e, message)
            if retry_after is not None or hasattr(cls, "retry_after_s"):
                e.retry_after_s = retry_after
            return e
    return errors.BackendError(message)


def _all_subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from _all_subclasses(sub)


async def read_frame(reader: asyncio.StreamReader) -> list | None:
    try:
        head = await reader.readexactly(4)
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    (n,) = _LEN.unpack(head)
    if n > MAX_FRAME:
        raise ValueError(f"control frame of {n} bytes")
    return _decode(await reader.readexactly(n))


def frame(msg: list) -> bytes:
    body = _encode(msg)
    return _LEN.pack(len(body)) + body


class EngineClient:
    """The API process's side: one connection to the engine, shared by every request of the process.

    `on_cell_free(segment, offset, nbytes)` is called (on the event loop) for every "cell_free".
    `ids`: this connection's request ids (EngineRouter gives each engine's client its own residue class).
    """

    def __init__(self, path: str, on_cell_free: Callable[[str, int, int], None],
                 ids: Iterator[int] | None = None):
        self.path, self.on_cell_free = path, on_cell_free
        self._ids = ids or itertools.count(1)
        self._replies: dict[int, asyncio.Future] = {}  # first answer to a claim / submit / status
        self._results: dict[int, asyncio.Future] = {}  # the later result of a joined claim or a queued submit
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task | None = None
        self.connected = False

    async def connect(self, timeout: float = 600.0, interval: float = 0.05) -> None:
        """Connect, retrying while the engine process starts (it binds once its model is loaded)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            try:
                reader, self._writer = await asyncio.open_unix_connection(self.path)
                break
            except (FileNotFoundError, ConnectionRefusedError):
                if loop.time() > deadline:
                    raise
                await asyncio.sleep(interval)
        self.connected = True
        self._reader_task = asyncio.create_task(self._read(reader))

    async def _read(self, reader: asyncio.StreamReader) -> None:
        try:
            while (msg := await read_frame(reader)) is not None:
                kind = msg[0]
                if kind == "cell_free":
                    self.on_cell_free(msg[1], msg[2], msg[3])
                    continue
                rid = msg[1]
                if kind in ("result", "error") and rid in self._results and rid not in self._replies:
                    fut = self._results.pop(rid)
                else:
                    fut = self._replies.pop(rid, None)
                if fut is not None and not fut.done():
                    fut.set_result(msg)
        except Exception:
            log.exception("engine connection: bad frame")
        finally:
            self.connected = False
            gone = errors.Unavailable("the engine process is not running; retry shortly", retry_after_s=1)
            for fut in [*self._replies.values(), *self._results.values()]:
                if not fut.done():
                    fut.set_exception(gone)
            self._replies.clear()
            self._results.clear()

    def _send(self, msg: list) -> None:
        if not self.connected or self._writer is None:
            raise errors.Unavailable("the engine process is not running; retry shortly", retry_after_s=1)
        self._writer.write(frame(msg))

    async def _ask(self, msg: list, rid: int, keep_result: bool) -> tuple[list, asyncio.Future | None]:
        """Send, wait for the first answer; with keep_result also return the future of the later one
        (registered before sending: the later answer may arrive right behind the first)."""
        loop = asyncio.get_running_loop()
        reply = self._replies[rid] = loop.create_future()
        later = None
        if keep_result:
            later = self._results[rid] = loop.create_future()
        try:
            self._send(msg)
            answer = await reply
        except BaseException:
            self._results.pop(rid, None)
            self._replies.pop(rid, None)
            raise
        if answer[0] == "error":
            self._results.pop(rid, None)
            raise error_from_wire(*answer[2:5])
        return answer, later

    async def claim(self, key: str, sha: str, tokens: int) -> tuple[str, object]:
        """("hit", StoredItem) | ("joined", (id, future of a StoredItem)) | ("decode", grant id).
        `tokens`: the image's output tokens by its header, what its queue place counts."""
        rid = next(self._ids)
        answer, later = await self._ask(["claim", rid, key, sha, tokens], rid, keep_result=True)
        if answer[0] == "hit":
            self._results.pop(rid, None)
            return "hit", item_from_wire(answer[2])
        if answer[0] == "joined":
            return "joined", (rid, self._result(later))
        self._results.pop(rid, None)
        return "decode", rid

    async def submit(self, grant: int, key: str, sha: str, segment: str, offset: int, nbytes: int, h: int,
                     w: int, grid: tuple[int, int, int], tokens: int) -> tuple[int, asyncio.Future]:
        """Queue a decoded image (its pixels in the arena cell) under the claim `grant`;
        (id, future of its StoredItem)."""
        rid = next(self._ids)
        _, later = await self._ask(["submit", rid, grant, key, sha, segment, offset, nbytes, h, w, list(grid), tokens],
                                   rid, keep_result=True)
        return rid, self._result(later)

    def _result(self, raw: asyncio.Future) -> asyncio.Future:
        out = asyncio.get_running_loop().create_future()

        def done(f: asyncio.Future) -> None:
            if out.done():
                return
            if f.exception() is not None:
                out.set_exception(f.exception())
            elif f.result()[0] == "error":
                out.set_exception(error_from_wire(*f.result()[2:5]))
            else:
                out.set_result(item_from_wire(f.result()[2]))

        raw.add_done_callback(done)
        return out

    def cancel(self, rid: int) -> None:
        self._results.pop(rid, None)
        if self.connected:
            self._send(["cancel", rid])

    async def status(self) -> dict:
        rid = next(self._ids)
        return (await self._ask(["status", rid], rid, keep_result=False))[0][2]

    async def metrics(self) -> str:
        """The engine's Prometheus text (steps, queue, store)."""
        rid = next(self._ids)
        return (await self._ask(["metrics", rid], rid, keep_result=False))[0][2]

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        if self._reader_task is not None:
            self._reader_task.cancel()


class EngineMismatch(RuntimeError):
    """The engines report different models or preprocessing: a key would depend on which engine hashed it."""


class EngineRouter:
    """EngineClient's interface over one client per engine (--devices): a key's claim and submit go to
    the engine of its store shard (store.shard_of), so each key has one writer and dedupe and coalescing
    stay exact. With one engine, everything passes through to it unchanged.

    Ids: client i issues ids i+1, i+1+n, i+1+2n, ... (no two engines share an id), so `cancel(id)` finds the
    engine that issued the id from the id alone, with no map to keep (and to leak, when a cancel never comes).
    """

    def __init__(self, paths: list[str], on_cell_free: Callable[[str, int, int], None]):
        n = len(paths)
        self.clients = [EngineClient(p, on_cell_free, itertools.count(i + 1, n)) for i, p in enumerate(paths)]

    def route(self, key: str) -> EngineClient:
        return self.clients[shard_of(key, len(self.clients))]

    def _issuer(self, rid: int) -> EngineClient:
        return self.clients[(rid - 1) % len(self.clients)]

    @property
    def connected(self) -> bool:
        """Every engine is reachable: one lost engine is a degraded service (/health 503), and the
        supervisor stops it anyway."""
        return all(c.connected for c in self.clients)

    async def connect(self, timeout: float = 600.0, interval: float = 0.05) -> None:
        await asyncio.gather(*(c.connect(timeout, interval) for c in self.clients))

    async def claim(self, key: str, sha: str, tokens: int) -> tuple[str, object]:
        return await self.route(key).claim(key, sha, tokens)

    async def submit(self, grant: int, key: str, *args) -> tuple[int, asyncio.Future]:
        client = self.route(key)
        assert self._issuer(grant) is client, "a grant is submitted to the engine that gave it: this is a bug"
        return await client.submit(grant, key, *args)

    def cancel(self, rid: int) -> None:
        self._issuer(rid).cancel(rid)

    async def status(self) -> dict:
        """The engines' statuses as one: ready when all are; "engines" lists each engine's device, pid and
        readiness; "store_error" is any shard's. With several engines, the top-level "info" and "pid" are
        engine 0's. Raises EngineMismatch if the engines do not key and preprocess images alike."""
        states = await asyncio.gather(*(c.status() for c in self.clients))
        first = states[0]
        for i, st in enumerate(states[1:], 1):
            if (st["key_salt"], st["params"]) != (first["key_salt"], first["params"]):
                raise EngineMismatch(f"engine {i} keys or preprocesses images differently from engine 0 "
                                     f"({st['key_salt']!r} vs {first['key_salt']!r}): every engine must load the "
                                     "same model in the same dtype")
        errs = [f"engine {i}: {st['store_error']}" if len(states) > 1 else st["store_error"]
                for i, st in enumerate(states) if st["store_error"]]
        return {**first, "info": {**first["info"], "ready": all(st["info"]["ready"] for st in states)},
                "store_error": "; ".join(errs) or None,
                "engines": [{"device": st["info"]["device"], "engine_pid": st["pid"], "ready": st["info"]["ready"]}
                            for st in states]}

    async def metrics(self) -> str:
        """Every reachable engine's Prometheus text; with several, each series labelled engine="<i>"."""
        texts = await asyncio.gather(*(c.metrics() for c in self.clients), return_exceptions=True)
        if len(texts) == 1:
            if isinstance(texts[0], BaseException):
                raise texts[0]
            return texts[0]
        from service.metrics import label_engines

        # NOTE: a lost engine's text is left out, and the others keep their labels (their position).
        return label_engines([t if isinstance(t, str) else "" for t in texts])

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self.clients))


class EngineServer:
    """The engine process's side: answers every API process's connection from one asyncio thread.

    `handler` implements the engine's part of each message (see enginep.EngineHost); it runs on the
    server's loop and must not block. Results produced on other threads come back through `post`.
    """

    def __init__(self, path: str, handler):
        self.path, self.handler = path, handler
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="ipc-server", daemon=True)
        self._started = threading.Event()
        self._server: asyncio.AbstractServer | None = None

    def start(self) -> None:
        self._thread.start()
        self._started.wait()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)

        async def main():
            self._server = await asyncio.start_unix_server(self._serve, self.path)
            self._started.set()
            await self._server.serve_forever()

        try:
            self.loop.run_until_complete(main())
        except asyncio.CancelledError:
            pass

    def post(self, fn, *args) -> None:
        """Run fn(*args) on the server's loop (from any thread)."""
        self.loop.call_soon_threadsafe(fn, *args)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = self.handler.connected(lambda msg: writer.write(frame(msg)) if not writer.is_closing() else None)
        try:
            while (msg := await read_frame(reader)) is not None:
                self.handler.handle(conn, msg)
        except asyncio.CancelledError:
            # NOTE: stop() cancels this task, and only it does; ending normally instead of re-raising
            # spares the log a traceback (asyncio's stream callback calls exception() on a cancelled task).
            pass
        except Exception:
            log.exception("API connection: bad frame; closing it")
        finally:
            self.handler.disconnected(conn)
            writer.close()

    def stop(self) -> None:
        def _close():
            if self._server is not None:
                self._server.close()
            for task in asyncio.all_tasks(self.loop):
                task.cancel()

        self.loop.call_soon_threadsafe(_close)
        self._thread.join(5)
