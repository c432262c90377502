"""Calls bounded by a deadline (service/store/calls.py): a call that hangs costs its caller the deadline,
never more; one that returns in time is its result; with every thread held by hung calls a new call is
refused at once; none of this holds the process's exit."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from service.store.calls import Calls, Overdue


def test_a_hung_call_is_overdue_at_its_deadline_and_a_quick_one_is_its_result():
    calls = Calls(0.3, threads=2)
    release = threading.Event()
    try:
        t0 = time.monotonic()
        with pytest.raises(Overdue, match="lookup did not answer within 0.3 s"):
            calls.run("lookup", release.wait, 30)
        assert 0.25 < time.monotonic() - t0 < 2
        assert calls.run("read", lambda x: x * 2, 21) == 42  # the other thread
        with pytest.raises(ZeroDivisionError):
            calls.run("read", lambda: 1 / 0)
        assert calls.counts() == {"lookup": 1}
    finally:
        release.set()
        calls.close()


def test_with_every_thread_held_a_call_is_refused_at_once_and_served_again_once_one_returns():
    calls = Calls(0.2, threads=2)
    release = threading.Event()
    try:
        for _ in range(2):
            with pytest.raises(Overdue):
                calls.run("read", release.wait, 30)
        t0 = time.monotonic()
        with pytest.raises(Overdue, match="all 2 threads"):
            calls.run("read", lambda: "never run")
        assert time.monotonic() - t0 < 0.1
        release.set()
        deadline = time.monotonic() + 10
        while True:
            try:
                assert calls.run("read", lambda: "ran") == "ran"
                break
            except Overdue:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        assert calls.counts()["read"] >= 3  # (and any retry above that came before a thread was free)
    finally:
        release.set()
        calls.close()


def test_a_call_hung_for_good_does_not_hold_the_process_exit():
    code = ("import threading; from service.store.calls import Calls, Overdue\n"
            "c = Calls(0.1)\n"
            "try:\n    c.run('read', threading.Event().wait)\nexcept Overdue:\n    print('overdue')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0 and done.stdout.strip() == "overdue", done.stderr
