"""An API process of a supervised service: the app (api/app.py) on the shared socket, decoding in threads
into its shared-memory arena (procs/decoders.py's ArenaDecoder), the engines reached over their Unix
sockets (procs/ipc.py). No model and no torch here."""

from __future__ import annotations

import os
import socket
import sys

from service.config import MULTIPROC_ENV, Settings
from service.procs.child import RunDirLease, child_setup, settle_heap


def api_main(settings: Settings, sock: socket.socket, index: int, arena_name: str, engine_sockets: list[str],
             metrics_dir: str, log_level: str, parent_pid: int) -> None:
    """Entry point of an API process (spawned by the supervisor)."""
    child_setup(parent_pid, log_level, f"api{index}")
    rundir = RunDirLease(os.path.dirname(metrics_dir), parent_pid)
    # One /metrics for every API process (metrics.py): prometheus_client picks its multiprocess mode
    # from this variable when it is first imported, which must be after this line.
    assert "prometheus_client" not in sys.modules, "prometheus_client imported before its multiprocess set-up"
    os.environ[MULTIPROC_ENV] = metrics_dir
    # NOTE: imported only now, for the line above: the app's modules import prometheus_client.
    import uvicorn

    from service import tracing
    from service.api.app import create_app
    from service.api.runtime import Runtime
    from service.api.server import Server, server_options
    from service.engine.client import EngineRouter
    from service.metrics import Metrics
    from service.procs.arena import Arena
    from service.procs.decoders import ArenaDecoder
    from service.procs.ipc import SocketTransport
    from service.procs.peers import UnixPeers

    sys.setswitchinterval(0.001)
    tracing.setup("qwen3vl-encoder", settings.otlp_endpoint)

    async def make_runtime() -> Runtime:
        metrics = Metrics()
        decoder = ArenaDecoder(Arena(arena_name, settings.arena_bytes), settings.decode_worker_count(),
                               settings.image_limits, metrics, video_limits=settings.video_limits,
                               video_slots=settings.video_decode_slots(), aging_s=settings.priority_aging_s)
        engines = EngineRouter([SocketTransport(path) for path in engine_sockets], decoder.cell_free)
        peers = (UnixPeers(os.path.dirname(metrics_dir), index, settings.api_process_count())
                 if settings.sglang_version else None)
        runtime = Runtime(settings, decoder, engines, metrics, peers)
        settle_heap()  # (procs/child.py: this process's start-up objects out of the collector's way)
        return runtime

    app = create_app(settings, make_runtime)
    # httptools (server_options gives its protocol the head timeout) and uvloop (both dependencies): a request
    # costs ~0.3 ms of CPU instead of ~0.5 with h11 and asyncio's loop.
    config = uvicorn.Config(app, log_level=log_level, **server_options(settings))
    def stopping() -> None:  # the graceful stop begins: URL fetches must not hold it (api/runtime.py)
        rt = getattr(app.state, "rt", None)
        if rt is not None:
            rt.stop_fetches()

    Server(config, ignore_sigint=True, on_stopped=rundir.leave, on_stopping=stopping).run(sockets=[sock])
