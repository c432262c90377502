"""The engine side of a single-process service: its Runtime holds decode processes and an engine host
in this process, reached through engine/host.py's LocalTransport (no socket, no pixel copy)."""

from __future__ import annotations

import asyncio
import os
import threading

from service.api.app import create_app
from service.api.runtime import Runtime
from service.config import FaultInjection, Settings
from service.engine.client import EngineRouter
from service.engine.host import LocalTransport, build_host
from service.engine.loader import LoadedModel, load_model
from service.metrics import Metrics
from service.procs.child import settle_heap
from service.procs.decoders import PoolDecoder


async def local_runtime(settings: Settings, model: LoadedModel, settle: bool = False) -> Runtime:
    """The Runtime of a single-process service for `model`: the engine host is built in a thread (on
    cuda the Engine compiles and captures graphs, seconds, and meanwhile the loop keeps answering) and
    warms up in another; /ready says when it is done. The host is drained when the Runtime shuts down.
    `settle`: the process is the service's own (procs/single.py), not a test's or a library user's: freeze its
    start-up objects before it says ready and time its collections (as an engine process does)."""
    faults = FaultInjection.from_env(os.environ)  # test-only (the soak's fence-off control)
    host = await asyncio.to_thread(build_host, model, settings.engine_options(faults))
    threading.Thread(target=host.warm_up, args=((lambda: settle_heap(host.metrics)) if settle else None,),
                     name="warmup", daemon=True).start()
    decoder = PoolDecoder(settings.decode_worker_count(), settings.image_limits, stall_s=settings.decode_stall_s,
                          video_limits=settings.video_limits, video_slots=settings.video_decode_slots(),
                          aging_s=settings.priority_aging_s)
    return Runtime(settings, decoder, EngineRouter([LocalTransport(host, owner=True)]), Metrics())


def local_app(settings: Settings, model: LoadedModel | None = None, settle: bool = False):
    """The real app of a single-process service (tests serve it in process); `model` loaded if None;
    `settle`: see local_runtime."""
    async def make_runtime() -> Runtime:
        loaded = model or await asyncio.to_thread(load_model, settings)
        return await local_runtime(settings, loaded, settle)

    return create_app(settings, make_runtime)
