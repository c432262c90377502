"""What an app instance serves with: a decoder and its engines (api/encode.py uses both), and the
service's state as /health, /ready and /metrics report it.

    Runtime(decoder, engines)
      decoder:  procs/decoders.py: decode processes (single process) or threads into an arena (API process)
      engines:  engine/client.py's EngineRouter: in process (LocalTransport) or over Unix sockets

The app never knows which: a single-process service and an API process of a supervised one differ only
in what procs/ hands this class. No tensors here.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import httpx
import msgspec

from service.media.params import PreprocessParams
from service.config import Settings
from service.engine.client import EngineRouter, EnginesStatus
from service.engine.messages import Cell, Geometry
from service.errors import ServiceError, Unavailable
from service.metrics import Metrics
from service.priority import Urgency
from service.store.keys import VllmKeys

if TYPE_CHECKING:
    import numpy as np

    from service.media.images import ImageHeader
    from service.media.video import VideoHeader
    from service.media.params import VideoParams
    from service.api.sglang.rendezvous import PeerLink

log = logging.getLogger(__name__)


@dataclass
class Decoded:
    """One decoded image or video, ready to submit: its geometry and where its pixels are."""

    geometry: Geometry
    # an arena cell (API process) or a [H, W, 3] uint8 array (single process); a video's [frames, H, W, 3]
    pixels: Cell | np.ndarray


class Decoder(Protocol):
    """How an app instance turns image bytes into pixels (procs/decoders.py)."""

    ready: bool  # its workers are up

    async def start(self, params: PreprocessParams, warm_video: bool = False) -> None: ...

    async def decode(self, data: bytes, header: ImageHeader, params: PreprocessParams,
                     urgency: Urgency = Urgency()) -> Decoded:
        """`header`: media.images.read_header's of `data`. Waits for a decoder in `urgency`'s priority order.
        Raises the image's ImageError, DeadlineExceeded when its deadline passes before its decode starts, or
        Overloaded/Unavailable when it cannot take the work."""

    async def decode_video(self, data: bytes, header: VideoHeader, params: VideoParams,
                           urgency: Urgency = Urgency()) -> Decoded:
        """`header`: media.video.read_header's of `data`. Decodes the sampled frames and resizes them (off
        the event loop), waiting as `decode` does. Raises the video's VideoError, DeadlineExceeded, or
        Overloaded/Unavailable."""

    def release(self, decoded: Decoded) -> None:
        """Give back the pixels of an image or video that never reached an engine."""

    def cell_free(self, cell: Cell) -> None:
        """An engine will not read this cell again (engine/messages.py's CellFree)."""

    async def shutdown(self) -> None: ...


class Runtime:
    """The decoder and the engines of one app instance, and what the service says about its state."""

    def __init__(self, settings: Settings, decoder: Decoder, engines: EngineRouter, metrics: Metrics,
                 peers: PeerLink | None = None):
        self.settings, self.decoder, self.engines, self.metrics = settings, decoder, engines, metrics
        self.peers = peers  # this API process's siblings (SGLang's protocol meets its parts' ranks through them)
        self.http = httpx.AsyncClient(timeout=settings.url_timeout_s, follow_redirects=False)
        self.status: EnginesStatus | None = None  # the engines' last answer
        self.params: PreprocessParams | None = None  # how the engines preprocess (known once they answered)
        self.key_salt = b""
        # With --vllm-model-id, an item sent without a uuid is keyed as vLLM's LM keys it (its mm_hash).
        self.vllm_keys = (VllmKeys(settings.vllm_model_id, settings.mm_hasher_algorithm)
                          if settings.vllm_model_id else None)
        self.video: VideoParams | None = None  # how the engines sample and resize videos (likewise)
        self.mismatch: str | None = None  # the engines disagree on keys / preprocessing: never ready
        self.engine_lost = False
        self.requests_in_flight = 0  # requests between their keys and their last submit (an idle process decodes early)
        self.fetches: set[asyncio.Task] = set()  # URL fetches in progress (api/parse.py)
        self.stopping = False  # the server stops taking requests: no fetch starts, none holds the drain
        self._task: asyncio.Task | None = None
        self.started = time.time()  # (/v1/models' `created`)

    async def start(self) -> None:
        """Connect to the engines and follow their start-up (polled every 0.2 s until ready), in the
        background: the app answers /ready 503 meanwhile."""
        self._task = asyncio.create_task(self._follow_startup())

    async def _follow_startup(self) -> None:
        try:
            await self.engines.connect()
            while self.engines.connected:
                st = await self._refresh()
                if self.mismatch or (st is not None and st.failed):
                    return  # never ready: /health and /ready say why
                if st is not None:
                    if self.params is None:
                        self.params, self.key_salt = st.first.params, st.first.key_salt.encode()
                        self.video = st.first.video
                        # NOTE: the video path warmed (PyAV and torch imported) only for a GPU engine:
                        # there a video's decode is what a client waits for, and the imports cost a first
                        # video seconds; beside a CPU tower they would only take the cores from it (and
                        # from the test suite's servers, on a 2-core machine).
                        await self.decoder.start(self.params, warm_video=st.first.info.device.startswith("cuda"))
                    if st.ready:
                        break
                await asyncio.sleep(0.2)
            self.engine_lost = not self.engines.connected
        except Exception:
            log.exception("could not reach the engine")
            self.engine_lost = True

    async def _refresh(self) -> EnginesStatus | None:
        """Ask the engines for their status (None when they cannot answer; a mismatch is remembered)."""
        try:
            self.status = await self.engines.status()
        except ServiceError as e:
            if e.code != "engine_mismatch":
                return None
            if self.mismatch is None:  # never ready: /health and /ready say why, and the log
                log.error("%s", e.message)
            self.mismatch = e.message
            return None
        return self.status

    @property
    def ready(self) -> bool:
        return bool(self.status and self.status.ready and self.engines.connected and self.decoder.ready
                    and self.params is not None)

    async def require_ready(self) -> None:
        """503 until the engines answer ready (the app asks before it reads a request body). This process
        follows their status every 0.2 s while they start; a request in that window asks them itself, so
        that a sibling API process's /ready 200 is never followed by a 503 from this one."""
        if not self.ready and self.status is not None and self.engines.connected and self.mismatch is None:
            await self._refresh()
        if not self.ready:
            raise Unavailable("the encoder is still starting (or its engine is not running); retry shortly",
                              retry_after_s=1)

    def _not_running(self) -> bool:
        return self.engine_lost or (self.status is not None and not self.engines.connected)

    async def health(self) -> tuple[int, dict]:
        """(status code, body): 200 while the engines are alive (or still starting) and the store takes
        writes; 503 with the reason otherwise."""
        if self.mismatch:
            return 503, {"status": self.mismatch}
        if self._not_running():
            return 503, {"status": "the engine process is not running"}
        if self.status is not None:
            if await self._refresh() is None:
                return 503, {"status": self.mismatch or "the engine process is not running"}
            if self.status.failed:
                return 503, {"status": self.status.failed}
            if self.status.store_error:
                return 503, {"status": f"the store cannot be written: {self.status.store_error}"}
        return 200, {"status": "ok"}

    async def readiness(self) -> tuple[int, dict]:
        """(status code, body) of /ready: the model and its engines once ready, else the phase."""
        if not self.ready:
            failed = self.mismatch or (self.status.failed if self.status else None)
            phase = "failed" if failed else "warming" if self.status else "loading"
            return 503, {"ready": False, "phase": phase}
        if await self._refresh() is None:
            return 503, {"ready": False}
        st = self.status
        if st.store_error:  # (a Mooncake master gone, a full filesystem): nothing could be answered now
            return 503, {"ready": False, "phase": "store", "store_error": st.store_error}
        # With several engines (--devices) the top-level fields are engine 0's; "engines" lists each.
        return 200, {"ready": True, **msgspec.structs.asdict(st.first.info), "engine_pid": st.first.pid, "api_pid": os.getpid(),
                     "engines": [{"device": s.info.device, "engine_pid": s.pid, "ready": s.ready} for s in st.engines]}

    async def metrics_text(self) -> str:
        """This side's request counters (every API process's, summed: metrics.py), then the engines'
        (steps, queue, store); the engines' are left out if they cannot answer (/health says so)."""
        text = self.metrics.exposition(api_side=True).decode()
        try:
            text += await self.engines.metrics()
        except ServiceError:
            pass
        return text

    def stop_fetches(self) -> None:
        """The server has begun to stop (its graceful drain): every URL fetch in progress ends now, its request
        answered 503, and none starts: a stop waits for the service's own work, not for another server's pace."""
        self.stopping = True
        for fetch in list(self.fetches):
            fetch.cancel()

    async def shutdown(self) -> None:
        t0 = time.perf_counter()
        if self._task is not None:
            self._task.cancel()
        await self.engines.close()  # in a single process: the engine drains its queue, then the store is released
        t1 = time.perf_counter()
        await self.decoder.shutdown()
        await self.http.aclose()
        log.info("stopped in %.1f s (engines %.1f s, decoders %.1f s)", time.perf_counter() - t0, t1 - t0,
                 time.perf_counter() - t1)

