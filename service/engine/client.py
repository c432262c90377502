"""The API side's handle on engine hosts: claim, submit, cancel, status, metrics, over a transport.

One client per engine host, whatever carries the messages (engine/messages.py): `LocalTransport`
(engine/host.py) calls a host in this process; `SocketTransport` (procs/ipc.py) reaches an engine
process over its Unix socket. The bookkeeping (which answer belongs to which request, the later
Result of a wait, failing everything when the host goes away) is written once, here. `EngineRouter`
puts one client per engine (--devices) behind the same interface, sending each key to the engine of
its store shard.

Imports no torch and no numpy: API processes use it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from service import errors, tracing
from service.errors import Unavailable
from service.engine.messages import (
    Cancel,
    Cell,
    CellFree,
    Claim,
    EngineStatus,
    Failed,
    FromEngine,
    Geometry,
    Grant,
    Hit,
    Joined,
    MetricsQuery,
    MetricsText,
    Queued,
    Result,
    Status,
    StatusQuery,
    Submit,
    ToEngine,
)
from service.metrics import label_engines
from service.priority import Urgency
from service.store.keys import shard_of

if TYPE_CHECKING:
    import numpy as np

log = logging.getLogger(__name__)

# The engine host is gone (its process exited, or it is shutting down): every wait fails with this.
ENGINE_GONE = "the engine process is not running; retry shortly"


class Transport(Protocol):
    """How an EngineClient reaches its host. `deliver` is called on the client's event loop."""

    travels: bool  # messages cross a process boundary (a round trip worth hiding a decode behind)
    connected: bool

    async def connect(self, deliver: Callable[[FromEngine], None], lost: Callable[[], None]) -> None:
        """Open the link; `lost()` once it ends (the host went away, or `close`)."""

    def send(self, msg: ToEngine, pixels: np.ndarray | None = None) -> None: ...

    async def close(self) -> None: ...


@dataclass
class Pending:
    """A wait for one image's entry: a joined claim, or a queued submit. `cancel(id)` gives it up."""

    id: int
    result: asyncio.Future  # -> store.format.StoredItem, or the image's ServiceError
    coalesced: bool  # joined an identical image already queued or running


Claimed = Hit | Grant | Pending


class EngineClient:
    """One engine host's client, shared by every request of this process (one event loop).

    `on_cell_free(cell)` is called for every CellFree: the arena cell may be reused.
    `ids`: this client's request ids (EngineRouter gives each engine's client its own residue class).
    """

    def __init__(self, transport: Transport, on_cell_free: Callable[[Cell], None] = lambda cell: None,
                 ids: Iterator[int] | None = None):
        self.transport = transport
        self.on_cell_free = on_cell_free
        self._ids = ids or itertools.count(1)
        self._replies: dict[int, asyncio.Future] = {}  # first answer to a claim / submit / query
        self._results: dict[int, asyncio.Future] = {}  # the later Result of a joined claim or a queued submit

    @property
    def connected(self) -> bool:
        return self.transport.connected

    @property
    def travels(self) -> bool:
        return self.transport.travels

    async def connect(self) -> None:
        await self.transport.connect(self._deliver, self._lost)

    def _lost(self) -> None:
        """The transport's link ended: fail every request still waiting."""
        gone = errors.Unavailable(ENGINE_GONE, retry_after_s=1)
        for fut in [*self._replies.values(), *self._results.values()]:
            if not fut.done():
                fut.set_exception(gone)
        self._replies.clear()
        self._results.clear()

    def _deliver(self, msg: FromEngine) -> None:
        if isinstance(msg, CellFree):
            self.on_cell_free(msg.cell)
            return
        rid = msg.id
        if isinstance(msg, (Result, Failed)) and rid in self._results and rid not in self._replies:
            fut = self._results.pop(rid)
        else:
            fut = self._replies.pop(rid, None)
        if fut is not None and not fut.done():
            fut.set_result(msg)

    def _send(self, msg: ToEngine, pixels: np.ndarray | None = None) -> None:
        if not self.transport.connected:
            raise errors.Unavailable(ENGINE_GONE, retry_after_s=1)
        self.transport.send(msg, pixels)

    async def _ask(self, msg: ToEngine, keep_result: bool, pixels: np.ndarray | None = None
                   ) -> tuple[FromEngine, asyncio.Future | None]:
        """Send, wait for the first answer; with keep_result also return the future of the later one
        (registered before sending: the later answer may arrive right behind the first, or, in process,
        before `send` returns)."""
        loop = asyncio.get_running_loop()
        reply = self._replies[msg.id] = loop.create_future()
        later = None
        if keep_result:
            later = self._results[msg.id] = loop.create_future()
        try:
            self._send(msg, pixels)
            answer = await reply
        except BaseException:
            self._results.pop(msg.id, None)
            self._replies.pop(msg.id, None)
            raise
        if isinstance(answer, Failed):
            self._results.pop(msg.id, None)
            raise errors.from_code(answer.code, answer.message, answer.retry_after_s)
        return answer, later

    async def claim(self, key: str, sha256: str, tokens: int, video: bool = False,
                    urgency: Urgency = Urgency()) -> Claimed:
        """Hit (stored already) | Pending (joined an identical image in flight) | Grant (decode it, then
        `submit` under this grant). `tokens`: the image's output tokens by its header; `video`: a video part;
        `urgency`: its request's priority and deadline."""
        msg = Claim(next(self._ids), key, sha256, tokens, video, urgency.priority, urgency.deadline)
        answer, later = await self._ask(msg, keep_result=True)
        if isinstance(answer, Joined):
            return Pending(msg.id, self._item(later), coalesced=True)
        self._results.pop(msg.id, None)
        assert isinstance(answer, (Hit, Grant)), f"a claim answered {answer!r}: this is a bug"
        return answer

    async def submit(self, grant: int, key: str, sha256: str, geometry: Geometry,
                     pixels: Cell | np.ndarray, urgency: Urgency = Urgency()) -> Hit | Pending:
        """Queue a decoded image under the claim `grant`: its pixels in an arena cell (over a socket) or
        an array (in process). The wait for its entry, or Hit when it was stored meanwhile."""
        in_cell = isinstance(pixels, Cell)
        msg = Submit(next(self._ids), grant, key, sha256, geometry, cell=pixels if in_cell else None,
                     traceparent=tracing.traceparent(), priority=urgency.priority, deadline=urgency.deadline)
        answer, later = await self._ask(msg, keep_result=True, pixels=None if in_cell else pixels)
        if isinstance(answer, Hit):
            self._results.pop(msg.id, None)
            return answer
        assert isinstance(answer, Queued), f"a submit answered {answer!r}: this is a bug"
        return Pending(msg.id, self._item(later), coalesced=answer.coalesced)

    def _item(self, raw: asyncio.Future) -> asyncio.Future:
        """The StoredItem (or ServiceError) of a later Result / Failed."""
        out = asyncio.get_running_loop().create_future()

        def done(f: asyncio.Future) -> None:
            if out.done():
                return
            if f.exception() is not None:
                out.set_exception(f.exception())
            elif isinstance(answer := f.result(), Failed):
                out.set_exception(errors.from_code(answer.code, answer.message, answer.retry_after_s))
            else:
                out.set_result(answer.item)

        raw.add_done_callback(done)
        return out

    def cancel(self, rid: int) -> None:
        self._results.pop(rid, None)
        if self.transport.connected:
            self.transport.send(Cancel(rid))

    async def status(self) -> EngineStatus:
        answer, _ = await self._ask(StatusQuery(next(self._ids)), keep_result=False)
        assert isinstance(answer, Status), f"a status query answered {answer!r}: this is a bug"
        return answer.status

    async def metrics(self) -> str:
        """The engine's Prometheus text (steps, queue, store)."""
        answer, _ = await self._ask(MetricsQuery(next(self._ids)), keep_result=False)
        assert isinstance(answer, MetricsText), f"a metrics query answered {answer!r}: this is a bug"
        return answer.text

    async def close(self) -> None:
        await self.transport.close()


@dataclass(frozen=True)
class EnginesStatus:
    """Every engine's status as one (EngineRouter.status)."""

    first: EngineStatus  # engine 0's: its info is what /ready shows at the top level
    engines: list[EngineStatus]

    @property
    def ready(self) -> bool:
        return all(s.ready for s in self.engines)

    @property
    def failed(self) -> str | None:
        return self._joined("failed")

    @property
    def store_error(self) -> str | None:
        return self._joined("store_error")

    def _joined(self, field: str) -> str | None:
        many = len(self.engines) > 1
        texts = [f"engine {i}: {v}" if many else v for i, s in enumerate(self.engines) if (v := getattr(s, field))]
        return "; ".join(texts) or None


class EngineRouter:
    """EngineClient's interface over one client per engine (--devices): a key's claim and submit go to
    the engine of its store shard (store.format.shard_of), so each key has one writer and dedupe and
    coalescing stay exact. With one engine everything passes through to it.

    Ids: client i issues ids i+1, i+1+n, i+1+2n, ... (no two engines share an id), so `cancel(id)` finds
    the engine that issued the id from the id alone, with no map to keep (and to leak, when a cancel
    never comes).
    """

    def __init__(self, transports: list[Transport], on_cell_free: Callable[[Cell], None] = lambda cell: None):
        n = len(transports)
        assert n >= 1, "a router needs at least one engine: this is a bug"
        self.clients = [EngineClient(t, on_cell_free, itertools.count(i + 1, n)) for i, t in enumerate(transports)]

    def route(self, key: str) -> EngineClient:
        return self.clients[shard_of(key, len(self.clients))]

    def _issuer(self, rid: int) -> EngineClient:
        return self.clients[(rid - 1) % len(self.clients)]

    @property
    def connected(self) -> bool:
        """Every engine is reachable: one lost engine is a degraded service (/health 503), and the
        supervisor stops it anyway."""
        return all(c.connected for c in self.clients)

    @property
    def travels(self) -> bool:
        return self.clients[0].travels

    async def connect(self) -> None:
        await asyncio.gather(*(c.connect() for c in self.clients))

    async def claim(self, key: str, sha256: str, tokens: int, video: bool = False,
                    urgency: Urgency = Urgency()) -> Claimed:
        return await self.route(key).claim(key, sha256, tokens, video, urgency)

    async def submit(self, grant: int, key: str, sha256: str, geometry: Geometry,
                     pixels: Cell | np.ndarray, urgency: Urgency = Urgency()) -> Hit | Pending:
        client = self.route(key)
        assert self._issuer(grant) is client, "a grant is submitted to the engine that gave it: this is a bug"
        return await client.submit(grant, key, sha256, geometry, pixels, urgency)

    def cancel(self, rid: int) -> None:
        self._issuer(rid).cancel(rid)

    async def status(self) -> EnginesStatus:
        """Raises `engine_mismatch` if the engines do not key and preprocess images alike."""
        states = list(await asyncio.gather(*(c.status() for c in self.clients)))
        first = states[0]
        for i, st in enumerate(states[1:], 1):
            if (st.key_salt, st.params, st.video) != (first.key_salt, first.params, first.video):
                raise Unavailable(f"engine {i} keys or preprocesses images differently from engine 0 "
                                     f"({st.key_salt!r} vs {first.key_salt!r}): every engine must load the "
                                     "same model in the same dtype", code="engine_mismatch")
        return EnginesStatus(first, states)

    async def metrics(self) -> str:
        """Every reachable engine's Prometheus text; with several, each series labelled engine="<i>"."""
        texts = await asyncio.gather(*(c.metrics() for c in self.clients), return_exceptions=True)
        if len(texts) == 1:
            if isinstance(texts[0], BaseException):
                raise texts[0]
            return texts[0]
        # NOTE: a lost engine's text is left out, and the others keep their labels (their position).
        return label_engines([t if isinstance(t, str) else "" for t in texts])

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self.clients))

