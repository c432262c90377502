"""What every child process of the service does first: die with its parent, ignore a terminal's Ctrl-C,
log like the rest. Used by the supervisor's children and by decode-pool workers."""

from __future__ import annotations

import ctypes
import logging
import os
import select
import signal
import sys
import threading
import time

_PR_SET_PDEATHSIG = 1


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


def child_setup(parent_pid: int, log_level: str, role: str) -> None:
    """In every child: ignore SIGINT (see the module's docstring), die with the supervisor (SIGKILL of
    it included), log like it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=log_level.upper(), format=f"%(asctime)s %(levelname)s [{role}] %(name)s: %(message)s")
    die_with_parent(parent_pid)
