"""Where a part's message goes on SGLang's `zmq_to_scheduler` path: the URLs its tensor-parallel ranks
register (`/scheduler_receive_url`), before or after the part's `/encode` arrives, each on a connection of
its own, so, with several API processes on one socket, often in another process than the part's.

Each part has a registrar, the API process `crc32(req_id) % processes`: a registration goes to it (from the
process that took it), and the process serving the part's /encode asks it for the part's URLs (`Watch`):
it passes on those it holds and each that comes later, until the part is done (`Unwatch`). With one
process every message is a call. The messages are msgspec structs over datagrams between the API processes
(procs/peers.py); a registration never claimed (its part sent elsewhere, or never encoded) is forgotten
after `keep_s`.
"""

from __future__ import annotations

import asyncio
import logging
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import msgspec

log = logging.getLogger(__name__)


class Register(msgspec.Struct, tag=True):
    req_id: str
    count: int  # the ranks that will register for the part
    url: str


class Watch(msgspec.Struct, tag=True):
    req_id: str
    process: int  # where its URLs go


class Registered(msgspec.Struct, tag=True):
    req_id: str
    count: int
    url: str


class Unwatch(msgspec.Struct, tag=True):
    req_id: str


Message = Register | Watch | Registered | Unwatch
_ENCODER, _DECODER = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(Message)


class PeerLink(Protocol):
    """This API process among its siblings (procs/peers.py): datagrams to any of them, by index."""

    index: int
    count: int

    def send(self, to: int, payload: bytes) -> None: ...

    def listen(self, deliver: Callable[[bytes], None]) -> None: ...


@dataclass
class _Held:
    count: int | None  # None until a rank registers (the part's /encode may come first)
    since: float
    urls: list[str] = field(default_factory=list)
    watcher: int | None = None


@dataclass
class _Waiting:
    urls: list[str] = field(default_factory=list)
    event: asyncio.Event = field(default_factory=asyncio.Event)


class Registrations:
    def __init__(self, link: PeerLink | None, keep_s: float):
        self.link, self.keep_s = link, keep_s
        self.index, self.processes = (link.index, link.count) if link is not None else (0, 1)
        self._held: dict[str, _Held] = {}  # the parts this process is registrar of
        self._waiting: dict[str, _Waiting] = {}  # the parts this process serves that wait for their URLs
        self._swept = time.monotonic()
        if link is not None:
            link.listen(self._receive)

    def register(self, req_id: str, count: int, url: str) -> None:
        self._send(self._registrar(req_id), Register(req_id, count, url))

    async def urls(self, req_id: str, deadline: float) -> tuple[list[str], bool]:
        """The part's registered URLs once all its ranks have registered, by the loop's time `deadline`:
        (urls, True); at the deadline, (those registered by then, False)."""
        waiting = self._waiting[req_id] = _Waiting()
        registrar = self._registrar(req_id)
        self._send(registrar, Watch(req_id, self.index))
        try:
            left = deadline - asyncio.get_running_loop().time()
            try:
                await asyncio.wait_for(waiting.event.wait(), max(left, 0.0))
            except (asyncio.TimeoutError, TimeoutError):
                return list(waiting.urls), False
            return list(waiting.urls), True
        finally:
            del self._waiting[req_id]
            self._send(registrar, Unwatch(req_id))

    def _registrar(self, req_id: str) -> int:
        return zlib.crc32(req_id.encode()) % self.processes

    def _send(self, to: int, msg: Message) -> None:
        if to == self.index:
            self._handle(msg)
        else:
            self.link.send(to, _ENCODER.encode(msg))

    def _receive(self, payload: bytes) -> None:
        try:
            msg = _DECODER.decode(payload)
        except msgspec.ValidationError as e:  # (only sibling processes can reach the socket: a bug)
            log.error("a message between API processes does not decode: %s", e)
            return
        self._handle(msg)

    def _handle(self, msg: Message) -> None:
        if isinstance(msg, Registered):
            waiting = self._waiting.get(msg.req_id)
            if waiting is not None and msg.url not in waiting.urls:
                waiting.urls.append(msg.url)
                if len(waiting.urls) >= msg.count:
                    waiting.event.set()
            return
        if isinstance(msg, Unwatch):
            self._held.pop(msg.req_id, None)
            return
        self._sweep()
        if isinstance(msg, Register):
            held = self._held.setdefault(msg.req_id, _Held(None, time.monotonic()))
            if held.count is None:
                held.count = msg.count
            if msg.count != held.count:  # (SGLang's own encoder refuses it; its ranks never send one)
                log.warning("a rank of %s registered for %d receivers, another for %d: ignored", msg.req_id,
                            msg.count, held.count)
                return
            if msg.url not in held.urls:
                held.urls.append(msg.url)
                if held.watcher is not None:
                    self._send(held.watcher, Registered(msg.req_id, held.count, msg.url))
        elif isinstance(msg, Watch):
            held = self._held.get(msg.req_id)
            if held is None:
                held = self._held[msg.req_id] = _Held(None, time.monotonic())
            held.watcher = msg.process
            for url in held.urls:
                self._send(msg.process, Registered(msg.req_id, held.count, url))

    def _sweep(self) -> None:
        now = time.monotonic()
        if now - self._swept < 1.0:
            return
        self._swept = now
        for req_id in [r for r, h in self._held.items() if now - h.since > self.keep_s]:
            del self._held[req_id]
