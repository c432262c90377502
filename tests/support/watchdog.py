"""A watchdog over each test, loaded as a plugin (pyproject.toml's addopts: -p tests.support.watchdog).

pytest-timeout (pyproject.toml: timeout = 600) ends a test by a signal that its main thread handles. A main
thread blocked where that cannot happen (a C call that holds the GIL, a wait on a process stuck in the kernel,
SIGALRM blocked) holds the whole run until CI's own limit, with nothing printed to say where: a CI run once
stopped so, mid-suite. The watchdog turns that into a report and a failure: once a test has run its timeout
plus GRACE_S, it prints every thread's stack, the processes below the test process (state, kernel wait
channel, command) and the tails of the test's logs, then kills those processes (a wait on one of them then
ends, and the test fails); if the test still has not ended GRACE_S later, it ends the run with status 70.
QVE_WATCHDOG_GRACE_S sets GRACE_S (its own test uses 2 s)."""

from __future__ import annotations

import faulthandler
import os
import signal
import threading
from pathlib import Path

import pytest

from tests.support.proctree import descendants, state

GRACE_S = float(os.environ.get("QVE_WATCHDOG_GRACE_S", "60"))
_real_stderr: int | None = None
_policy: tuple[int, int] = (os.SCHED_OTHER, 0)  # the test process's scheduling policy and priority at start


def pytest_configure(config):
    global _real_stderr, _policy
    _real_stderr = os.dup(2)  # while output is not captured: the run's own standard error
    _policy = (os.sched_getscheduler(0), os.sched_getparam(0).sched_priority)


@pytest.fixture(autouse=True)
def _scheduling_policy_kept():
    """A test that leaves the test process under another scheduling policy fails, and the policy is put back.
    Why: SVT-AV1's encoder, run as root, put the process under SCHED_FIFO 99 (tests/support/videodata.py's clip); the
    servers later tests started inherited it, and two busy ones on a 2-core CI machine starved everything,
    this watchdog included, until CI's own limit, with nothing printed."""
    yield
    policy, priority = os.sched_getscheduler(0), os.sched_getparam(0).sched_priority
    if (policy, priority) != _policy:
        os.sched_setscheduler(0, _policy[0], os.sched_param(_policy[1]))
        pytest.fail(f"the test left the test process under scheduling policy {policy} (priority {priority}), "
                    f"not {_policy[0]} ({_policy[1]}) as it started: put back; the processes it starts inherit it")


def _timeout_of(item) -> float:
    marker = item.get_closest_marker("timeout")
    if marker is not None and marker.args:
        return float(marker.args[0])
    try:
        return float(item.config.getini("timeout") or 600)
    except ValueError:  # pytest-timeout not installed (the GPU machine's pytest): its ini key is unknown
        return 600.0


def _processes() -> list[str]:
    """pid, state, kernel wait channel and command of every process below this one."""
    rows = []
    for pid in sorted(descendants(os.getpid())):
        try:
            wchan = Path(f"/proc/{pid}/wchan").read_text() or "-"
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        rows.append(f"{pid} {state(pid)} {wchan} {cmd[:200]}")
    return rows


def _report(item, what: str) -> None:
    with os.fdopen(os.dup(_real_stderr), "w") as out:
        out.write(f"\n==== watchdog: {item.nodeid} {what}\n==== the stacks of the test process\n")
        out.flush()
        faulthandler.dump_traceback(file=out, all_threads=True)
        out.write("==== the processes below it\n" + "\n".join(_processes()) + "\n")
        tmp = getattr(item, "funcargs", {}).get("tmp_path")
        for log in sorted(Path(tmp).rglob("*.log")) if tmp else []:
            tail = log.read_text(errors="replace").splitlines()[-30:]
            out.write(f"==== the last lines of {log}\n" + "\n".join(tail) + "\n")


def _watch(item, limit: float, done: threading.Event) -> None:
    if done.wait(limit):
        return
    _report(item, f"is still running {limit:.0f} s after it started: killing the processes below the test process")
    for pid in descendants(os.getpid()):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    if done.wait(GRACE_S):
        return
    _report(item, f"has not ended {GRACE_S:.0f} s after its processes were killed: ending the run")
    os._exit(70)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    done = threading.Event()
    threading.Thread(target=_watch, args=(item, _timeout_of(item) + GRACE_S, done), daemon=True,
                     name=f"watchdog {item.name}").start()
    try:
        yield
    finally:
        done.set()
