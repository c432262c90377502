"""API process <-> engine process: engine/messages.py's messages over a Unix socket; pixels stay in the
API processes' shared-memory arenas (procs/arena.py).

Frames: a 4-byte little-endian length, then the msgpack of one tagged message (msgspec). The socket is
in the supervisor's run directory (0700): only this user reaches it.

    SocketTransport (API process, engine/client.py's transport)  ->  EngineServer (engine process: one
    asyncio thread answering every API process's connection with engine/host.py's EngineHost)

A Submit names an arena cell; the server maps it read-only (ArenaReader) and hands the host a view,
which the step loop reads in place while staging; the host's release sends the cell's CellFree.
"""

from __future__ import annotations

import asyncio
import logging
import struct
import threading
from collections.abc import Callable

import msgspec

from service.engine.messages import Cancel, CellFree, Failed, FromEngine, Submit, ToEngine
from service.errors import BackendError
from service.procs.arena import ArenaReader

log = logging.getLogger(__name__)

_LEN = struct.Struct("<I")
MAX_FRAME = 1 << 20  # control messages are small; anything bigger is a bug or an attack


class Frames:
    """Length-prefixed msgpack frames of one direction's message union."""

    def __init__(self, incoming: type):
        self._encode = msgspec.msgpack.Encoder().encode
        self._decode = msgspec.msgpack.Decoder(incoming).decode

    def frame(self, msg) -> bytes:
        body = self._encode(msg)
        return _LEN.pack(len(body)) + body

    async def read(self, reader: asyncio.StreamReader):
        """The next message, or None at the end of the stream. Raises ValueError for a malformed frame."""
        try:
            head = await reader.readexactly(4)
        except (asyncio.IncompleteReadError, ConnectionError):
            return None
        (n,) = _LEN.unpack(head)
        if n > MAX_FRAME:
            raise ValueError(f"control frame of {n} bytes")
        try:
            return self._decode(await reader.readexactly(n))
        except msgspec.DecodeError as e:
            raise ValueError(f"malformed control frame: {e}") from None


TO_ENGINE = Frames(ToEngine)
FROM_ENGINE = Frames(FromEngine)


class SocketTransport:
    """An API process's connection to one engine process (engine/client.py's Transport)."""

    travels = True  # a claim is a round trip: an idle API process decodes while it travels

    def __init__(self, path: str, timeout: float = 600.0, interval: float = 0.05):
        self.path, self.timeout, self.interval = path, timeout, interval
        self.connected = False
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task | None = None

    async def connect(self, deliver: Callable[[FromEngine], None], lost: Callable[[], None]) -> None:
        """Connect, retrying while the engine process starts (it binds once its model is loaded)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        while True:
            try:
                reader, self._writer = await asyncio.open_unix_connection(self.path)
                break
            except (FileNotFoundError, ConnectionRefusedError):
                if loop.time() > deadline:
                    raise
                await asyncio.sleep(self.interval)
        self.connected = True
        self._reader_task = asyncio.create_task(self._read(reader, deliver, lost))

    async def _read(self, reader: asyncio.StreamReader, deliver: Callable[[FromEngine], None],
                    lost: Callable[[], None]) -> None:
        try:
            while (msg := await FROM_ENGINE.read(reader)) is not None:
                deliver(msg)
        except Exception:
            log.exception("engine connection: bad frame")
        finally:
            self.connected = False
            lost()

    def send(self, msg: ToEngine, pixels=None) -> None:
        assert pixels is None and not (isinstance(msg, Submit) and msg.cell is None), \
            "pixels cross to an engine process only in an arena cell: this is a bug"
        self._writer.write(TO_ENGINE.frame(msg))

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        if self._reader_task is not None:
            self._reader_task.cancel()


class EngineServer:
    """The engine process's side: answers every API process's connection from one asyncio thread, the
    host's thread (its answers from other threads come back through `post`)."""

    def __init__(self, path: str, host):
        self.path, self.host = path, host  # host: engine/host.py's EngineHost
        self.reader = ArenaReader()
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

    def post(self, fn: Callable[[], None]) -> None:
        """Run fn() on the server's loop (from any thread)."""
        self.loop.call_soon_threadsafe(fn)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        def send(msg: FromEngine) -> None:
            if not writer.is_closing():
                writer.write(FROM_ENGINE.frame(msg))

        conn = self.host.connect(send, self.post)
        segments: set[str] = set()  # the arenas this connection's submits named (its API process's)
        try:
            while (msg := await TO_ENGINE.read(reader)) is not None:
                if isinstance(msg, Submit) and msg.cell is not None:
                    segments.add(msg.cell.segment)
                    self._submit(conn, msg, send)
                else:
                    self.host.handle(conn, msg)
        except asyncio.CancelledError:
            # NOTE: stop() cancels this task, and only it does; ending normally instead of re-raising
            # spares the log a traceback (asyncio's stream callback calls exception() on a cancelled task).
            pass
        except Exception:
            log.exception("API connection: bad frame; closing it")
        finally:
            self.host.disconnect(conn)
            writer.close()
            for name in segments:  # (cells still queued keep their views, and so the mapping, until released)
                self.reader.forget(name)

    def _submit(self, conn, msg: Submit, send: Callable[[FromEngine], None]) -> None:
        cell = msg.cell
        try:
            pixels = self.reader.view(cell.segment, cell.offset, cell.nbytes)
        except (OSError, ValueError) as e:  # not an arena of this service, or outside it: a bug on the other side
            log.error("submit %d names an unusable cell %s: %s", msg.id, cell, e)
            send(CellFree(cell))
            self.host.handle(conn, Cancel(msg.grant))  # its queue place goes back
            send(Failed(msg.id, BackendError.code, f"the engine cannot read the submitted pixels: {e}"))
            return
        self.host.handle(conn, msg, pixels, release=lambda: send(CellFree(cell)))

    def stop(self) -> None:
        def _close():
            if self._server is not None:
                self._server.close()
            for task in asyncio.all_tasks(self.loop):
                task.cancel()

        self.loop.call_soon_threadsafe(_close)
        self._thread.join(5)
