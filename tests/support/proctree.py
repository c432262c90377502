"""The process tree from /proc: what the process tests and the watchdog plugin (tests/support/watchdog.py) share.
Nothing heavy is imported (the watchdog loads before every test run): `descendants` is the soak's own walk of
the tree (service/loadtest/resources.py, the standard library alone)."""

from pathlib import Path

from service.loadtest.resources import descendants

__all__ = ["alive", "descendants", "state"]


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
