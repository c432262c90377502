"""What every child process of the service does first: die with its parent, ignore a terminal's Ctrl-C,
log like the rest, name its threads for the OS. Used by the supervisor's children and by decode-pool
workers."""

from __future__ import annotations

import ctypes
import fcntl
import gc
import logging
import os
import select
import shutil
import signal
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (not imported here: an API process imports prometheus_client only after its set-up)
    from service.metrics import Metrics

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15
_RUNDIR_LEASE = ".children"  # the file in the supervisor's run dir that its children hold a shared lock on


def _set_os_thread_name(name: str) -> None:
    """This thread's name as the kernel shows it (/proc/<pid>/task/<tid>/comm, top -H, py-spy): at most
    15 bytes."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)


def name_os_threads(role: str) -> None:
    """Name this process's main thread `qve-<role>` and every thread started from now on by its Python
    name (the step loop's "step-loop", the writer's "store-writer", ...).

    NOTE: Python before 3.14 leaves every thread named after the executable, so per-thread CPU (the
    engine's under load: bench_frontend's `cpu`) cannot say which thread is busy. Threading's bootstrap
    is wrapped once, in this process only."""
    _set_os_thread_name(f"qve-{role}")
    if getattr(threading.Thread, "_qve_named", False):
        return
    bootstrap = threading.Thread._bootstrap_inner

    def named_bootstrap(self):
        _set_os_thread_name(self.name)
        bootstrap(self)

    threading.Thread._bootstrap_inner = named_bootstrap
    threading.Thread._qve_named = True


def die_with_parent(parent_pid: int | None, sig: int = signal.SIGTERM) -> None:
    """Have the kernel send `sig` to this process when its parent exits, SIGKILL of the parent included
    (Linux). Exits now if the parent is already gone (`parent_pid` None: any parent but init)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, sig)
    if os.getppid() == 1 or (parent_pid is not None and os.getppid() != parent_pid):
        os._exit(1)


def exit_with(pid: int) -> None:
    """In a pool worker: exit as soon as process `pid` does (SIGKILL included). For workers forked by
    multiprocessing's forkserver, whose parent (the forkserver) outlives a killed service: they hold
    its liveness pipe, so it never sees the service go, and PR_SET_PDEATHSIG would never fire.
    The worker ignores SIGINT: a terminal's Ctrl-C reaches it too (a KeyboardInterrupt traceback per
    worker), and the service, which may still need it to drain, ends it itself. NOTE: not SIGTERM:
    the pool terminates the survivors of a broken pool with it (a killed worker's replacement)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    def watch():
        try:
            fd = os.pidfd_open(pid)  # readable once the process has exited (Linux >= 5.3)
            select.select([fd], [], [])
        except (AttributeError, OSError):  # no pidfd here, or `pid` already gone: poll
            while True:
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    break
                except PermissionError:
                    pass
                time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name=f"exit-with-{pid}", daemon=True).start()


def settle_heap(metrics: Metrics | None = None) -> tuple[int, float]:
    """Once a serving process has started (modules imported; in an engine, the model loaded, compiled and its
    graphs captured): collect what start-up left, then move every object still alive into Python's permanent
    generation (gc.freeze), which the collector never scans again; with an engine's `metrics`, time its
    collections from now on (Metrics.watch_gc). Returns (objects frozen, seconds taken).

    Why: a full collection scans every object the process holds, and holds the GIL meanwhile, so every thread
    stops: in a process with the 4B preset loaded on the CPU (338k objects, torch and transformers
    imported), 167-174 ms on the 2-core machine, 0.0 ms after the freeze. A serving engine keeps making
    long-lived objects (store entries), so full collections recur under load, each stalling the step loop,
    the store's writers and the IPC thread at once: 200,000 new entries there brought 4 of them, 890 ms in
    all, and 224 ms after the freeze (a probe now in git history). Objects made at start-up that
    later become cyclic garbage are not collected (a few, once)."""
    t0 = time.perf_counter()
    gc.collect()
    gc.freeze()
    frozen, seconds = gc.get_freeze_count(), time.perf_counter() - t0
    if metrics is not None:
        metrics.watch_gc()
    logging.getLogger(__name__).info("start-up's %d objects frozen (gc.freeze, %.2f s)", frozen, seconds)
    return frozen, seconds


def child_setup(parent_pid: int, log_level: str, role: str) -> None:
    """In every child: ignore SIGINT (see the module's docstring), die with the supervisor (SIGKILL of
    it included), log like it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=log_level.upper(), format=f"%(asctime)s %(levelname)s [{role}] %(name)s: %(message)s")
    die_with_parent(parent_pid)
    name_os_threads(role)


class RunDirLease:
    """A supervisor's child's hold on the supervisor's run directory (engine sockets, the API processes'
    metrics files). The supervisor removes it when it stops; a SIGKILLed supervisor cannot, so then the
    last of its children to exit does: each holds a shared flock on one file there from its start, and
    at its exit, with the supervisor gone, the child that can take the lock exclusively is the last."""

    def __init__(self, rundir: str | os.PathLike, supervisor_pid: int):
        self.rundir, self.supervisor_pid = Path(rundir), supervisor_pid
        self._fd = os.open(self.rundir / _RUNDIR_LEASE, os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
        fcntl.flock(self._fd, fcntl.LOCK_SH)

    def leave(self) -> None:
        """At this child's exit. NOTE: the lock is given up before the exclusive try, so of two children
        leaving at once one always sees the other's gone (the kernel drops a dead child's lock too)."""
        try:
            if os.getppid() == self.supervisor_pid:
                return  # the supervisor is alive: it removes the directory after its children have gone
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return  # a sibling still runs: the last one removes it
            shutil.rmtree(self.rundir, ignore_errors=True)
            logging.getLogger(__name__).info("the supervisor is gone: removed its run directory %s", self.rundir)
        finally:
            os.close(self._fd)
