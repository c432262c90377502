"""`serve --api-processes N` (N >= 1) or `serve --devices D0,D1,...`: the supervisor. It binds the port
once, starts one engine process (procs/engine_process.py) per device and N API processes serving the FastAPI app on
the shared socket, and watches them.

    supervisor ──spawn──> engine process 0..E-1 (one per device: model, batcher, step loop, the writer
              │                                  of store shard i of E; Unix socket engine<i>.sock)
              └─spawn──> API process 0..N-1     (HTTP, decode threads, a shared-memory pixel arena each;
                                                 a key goes to the engine of its shard, store.shard_of)

With several engines the supervisor holds the store root's lock itself (a second service on the root
is refused as with one engine) and each engine locks only its shard (see store/directory.py).

What happens when a process dies:
  * an API process: its requests fail (their clients see the connection close), its arena segment is
    unlinked, and it is started again; the other API processes go on.
  * an engine (any one of them): every API process answers /health 503 and new encodes 503 at once;
    the supervisor then stops the other processes and exits with status 1 (a process manager or
    container restart policy starts the service again; the store's entries survive a restart).
  * the supervisor, even by SIGKILL: every child gets SIGTERM from the kernel (PR_SET_PDEATHSIG) and
    drains; the arena segments go with their processes, and the last child out removes the run
    directory (procs/child.RunDirLease).
SIGTERM / SIGINT to the supervisor drains: the API processes finish their open requests first, then
the engine finishes its queued steps and releases the store. The children ignore SIGINT: a terminal's
Ctrl-C reaches the whole process group, and the engine must not stop before the API processes have.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import signal
import socket
import tempfile
import time
from pathlib import Path

from prometheus_client.multiprocess import mark_process_dead

from service.config import Settings
from service.errors import StoreOwnershipError
from service.procs.api_process import api_main
from service.procs.arena import leaked_segments, segment_name, unlink_segment
from service.store import lock_root

log = logging.getLogger(__name__)


def _engine_entry(*args) -> None:
    """An engine process's target. NOTE: procs/engine_process.py (torch, transformers: seconds to import)
    is imported in the engine process only, never in the supervisor, which would wait for it before
    starting anyone."""
    from service.procs.engine_process import engine_main

    engine_main(*args)


class Supervisor:
    def __init__(self, settings: Settings, sock: socket.socket):
        self.settings, self.log_level, self.sock = settings, settings.log_level, sock
        self.n_api = settings.api_process_count()
        self.ctx = multiprocessing.get_context("spawn")
        self.pid = os.getpid()
        self.devices = settings.engine_devices
        self.rundir = tempfile.mkdtemp(prefix="qve-run-")  # 0700: only this user can reach the engines
        self.engine_sockets = [str(Path(self.rundir) / f"engine{i}.sock") for i in range(len(self.devices))]
        self.metrics_dir = str(Path(self.rundir) / "metrics")  # the API processes' counters (api_main)
        os.mkdir(self.metrics_dir, 0o700)
        self.generation = [0] * self.n_api
        self.apis: list[multiprocessing.Process | None] = [None] * self.n_api
        self.engines: list[multiprocessing.Process] = []
        self.root_lock = None  # with several engines: the store root's lock (store.lock_root)
        self.stopping = False
        self.stop_signal: int | None = None

    def _start_api(self, i: int) -> None:
        self.generation[i] += 1
        name = segment_name(self.pid, i, self.generation[i])
        p = self.ctx.Process(target=api_main, name=f"qve-api{i}",
                             args=(self.settings, self.sock, i, name, self.engine_sockets, self.metrics_dir,
                                   self.log_level, self.pid))
        p.start()
        self.apis[i] = p

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        n = len(self.devices)
        if not self.settings.api_processes:
            log.info("--api-processes %s%s: starting %d, the default for this machine (a quarter of its cores, 1-8)",
                     "unset" if self.settings.api_processes is None else "0", f" with {n} devices" if n > 1 else "",
                     self.n_api)
        log.info("supervisor %d: http://%s:%d, %d API processes + %d engine(s) (%s)", self.pid, self.settings.host,
                 self.sock.getsockname()[1], self.n_api, n, ",".join(self.devices))
        if n > 1 and not self.settings.store_is_mooncake:
            # One lock for the whole service, as a one-engine service holds (preflight checked it is free);
            # the engines lock their shards.
            try:
                self.root_lock = lock_root(self.settings.store, self.settings.store_group)
            except StoreOwnershipError as e:  # another service took the root since preflight
                log.error("cannot start: %s", e)
                self._stop()
                return 2
        for i, device in enumerate(self.devices):
            p = self.ctx.Process(target=_engine_entry, name=f"qve-engine{i}",
                                 args=(self.settings.model_copy(update={"device": device}), self.engine_sockets[i],
                                       self.log_level, self.pid, (i, n)))
            p.start()
            self.engines.append(p)
        for i in range(self.n_api):
            self._start_api(i)
        code = 0
        while not self.stopping:
            time.sleep(0.1)
            if self.stopping:  # a signal during the sleep: children it reached too may be exiting
                break
            dead = next((i for i, p in enumerate(self.engines) if not p.is_alive()), None)
            if dead is not None:
                log.error("the engine process exited (engine %d of %d, %s, status %s): the API processes answer 503; "
                          "stopping the service with status 1", dead, n, self.devices[dead], self.engines[dead].exitcode)
                time.sleep(self.settings.engine_exit_grace_s)  # /health says 503 meanwhile
                code = 1
                break
            for i, p in enumerate(self.apis):
                if p is not None and not p.is_alive() and not self.stopping:
                    log.error("API process %d exited (status %s); starting it again", i, p.exitcode)
                    self._unlink_segment(i)
                    self._forget_gauges(p.pid)
                    self._start_api(i)
        self._stop()
        return 130 if code == 0 and self.stop_signal == signal.SIGINT else code  # a shell's "interrupted"

    def _on_signal(self, signum, frame) -> None:
        if not self.stopping:
            log.info("%s: stopping; the API processes finish their open requests, then the engine its queue",
                     signal.Signals(signum).name)
        self.stopping = True
        self.stop_signal = self.stop_signal or signum

    def _forget_gauges(self, pid: int) -> None:
        """A dead API process's gauges (its arena bytes) leave the sum; its counters stay in it."""
        mark_process_dead(pid, self.metrics_dir)

    def _unlink_segment(self, i: int) -> None:
        unlink_segment(segment_name(self.pid, i, self.generation[i]))

    def _stop(self) -> None:
        """Drain: API processes first (they finish their open requests), then the engines."""
        for p in self.apis:
            if p is not None and p.is_alive():
                p.terminate()
        for p in self.apis:
            if p is not None:
                p.join(70)
                if p.is_alive():
                    p.kill()
        for p in self.engines:  # all at once: each drains its own queue
            if p.is_alive():
                p.terminate()
        for p in self.engines:
            p.join(90)
            if p.is_alive():
                p.kill()
        if self.root_lock is not None:  # the engines are gone: a later service may take the root
            self.root_lock.close()
        for i in range(self.n_api):
            self._unlink_segment(i)
        for name in leaked_segments(self.pid):
            log.warning("removing leftover shared-memory segment %s", name)
            unlink_segment(name)
        shutil.rmtree(self.rundir, ignore_errors=True)  # the engine sockets, the metrics files, the children's lease
        self.sock.close()


def serve_supervised(settings: Settings, sock: socket.socket) -> int:
    """Run the supervisor on `sock` (bound by preflight) until a stop signal; the exit status."""
    return Supervisor(settings, sock).run()
