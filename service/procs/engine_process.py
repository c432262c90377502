"""An engine process of a supervised service: one device's engine host (engine/host.py: the model, the
batcher, the step loop and the store writer; with several --devices, of one store shard: the keys with
store.format.shard_of(key, n) == i), answering the API processes over a Unix socket (procs/ipc.py).
Pixels arrive in the API processes' shared-memory arenas and are read in place when a step is staged.

    API process --Claim/Submit--> EngineServer (ipc thread) --> EngineHost --> Batcher --> step loop
                <--Hit/Result/CellFree--  (the writer's answers, posted back to the ipc thread)
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from pathlib import Path

from service import tracing
from service.config import FaultInjection, Settings
from service.engine.host import build_host
from service.engine.loader import load_model
from service.procs.child import RunDirLease, child_setup, settle_heap
from service.procs.ipc import EngineServer

log = logging.getLogger(__name__)


def engine_main(settings: Settings, socket_path: str, log_level: str, parent_pid: int,
                shard: tuple[int, int] = (0, 1)) -> None:
    """Entry point of an engine process (spawned by the supervisor): shard (i, n) of n, on settings.device."""
    child_setup(parent_pid, log_level, "engine" if shard[1] == 1 else f"engine{shard[0]}")
    rundir = RunDirLease(Path(socket_path).parent, parent_pid)
    # As in a single-process service (see __main__): the ipc thread, the step loop and the store writers
    # share the GIL; a 1 ms switch interval keeps each hand-off short.
    sys.setswitchinterval(0.001)
    tracing.setup("qwen3vl-encoder-engine", settings.otlp_endpoint)
    faults = FaultInjection.from_env(os.environ)  # test-only (the soak's fence-off control)
    host = build_host(load_model(settings), settings.engine_options(faults), shard)
    server = EngineServer(socket_path, host)
    server.start()  # the API processes connect now; /ready says 503 until the warm-up below is done
    stop = threading.Event()
    # SIGTERM (from the supervisor, once the API processes have stopped) drains; SIGINT stays ignored
    # (child_setup): a terminal's Ctrl-C reaches this process too, before the API processes are done.
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    # start-up's objects out of the collector's way, and its pauses from then on measured
    host.warm_up(before_ready=lambda: settle_heap(host.metrics))
    while not stop.wait(0.5):
        if host.ready.is_set() and not host.engine.alive():
            log.error("the step loop died; the engine exits")
            os._exit(1)
    host.stop()  # no new work, the queued steps finish and are written, then the store is released
    server.stop()
    tracing.shutdown()
    rundir.leave()
    log.info("engine stopped")
