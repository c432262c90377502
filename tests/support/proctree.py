"""The process tree from /proc: what the process tests and the watchdog plugin (tests/support/watchdog.py) share.
No imports beyond the standard library: the watchdog loads before every test run."""

import os
from pathlib import Path


def descendants(pid: int) -> set[int]:
    """Every live process below `pid` (from /proc)."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, pp in parents.items() if pp in frontier} - found
        found |= frontier
    return found


def state(pid: int) -> str | None:
    """The process's state letter from /proc (R, S, D, Z, ...), or None once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[0]


def alive(pid: int) -> bool:
    """Running and not a zombie."""
    return state(pid) not in (None, "Z")
