"""The server's resources over a soak: RSS, open file descriptors and processes, summed over its
process tree (from /proc), sampled on a thread; the early and late windows that show growth; a plot."""

from __future__ import annotations

import os
import statistics
import threading
import time
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


def process_tree(pid: int) -> list[int]:
    """`pid` and every live process below it (decode workers, API processes, the engine), from /proc."""
    return sorted({pid} | descendants(pid))


def sample_resources(pid: int) -> tuple[float, int, int]:
    """(RSS in MiB, open file descriptors, processes) summed over the server's process tree."""
    rss_kb, fds, procs = 0, 0, 0
    for p in process_tree(pid):
        try:
            status = Path(f"/proc/{p}/status").read_text()
            n_fds = len(os.listdir(f"/proc/{p}/fd"))
        except OSError:  # exited between the listing and the read
            continue
        rss_kb += next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")), 0)
        fds += n_fds
        procs += 1
    return rss_kb / 1024, fds, procs


class Sampler(threading.Thread):
    """Samples the server tree every `interval_s`: [seconds since start, RSS MiB, fds, processes]."""

    def __init__(self, pid: int, interval_s: float):
        super().__init__(name="sampler", daemon=True)
        self.pid, self.interval_s = pid, interval_s
        self.samples: list[list[float]] = []
        self.stopping = threading.Event()

    def run(self) -> None:
        t0 = time.monotonic()
        while not self.stopping.is_set():
            rss, fds, procs = sample_resources(self.pid)
            if procs:
                self.samples.append([round(time.monotonic() - t0, 2), round(rss, 1), fds, procs])
            self.stopping.wait(self.interval_s)


def windows(samples: list[list[float]], column: int) -> dict:
    """An early window (20-40% of the run: after warm-up) and a late one (the last 20%) of one column:
    each one's median and max, so growth over the run can be judged (see tests/system/test_soak.py)."""
    if len(samples) < 5:
        return {"early_median": None, "early_max": None, "late_median": None, "late_max": None, "samples": len(samples)}
    n = len(samples)
    early = [s[column] for s in samples[int(n * 0.2) : max(int(n * 0.4), int(n * 0.2) + 1)]]
    late = [s[column] for s in samples[int(n * 0.8) :]]
    return {"early_median": statistics.median(early), "early_max": max(early),
            "late_median": statistics.median(late), "late_max": max(late), "samples": n}


def plot_resources(path: Path, samples: list[list[float]]) -> str | None:
    """The server's RSS and open file descriptors over the run, as a PNG (None without matplotlib or samples)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    if not samples:
        return None
    t = [s[0] for s in samples]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 5), sharex=True)
    ax1.plot(t, [s[1] for s in samples], color="tab:blue")
    ax1.set_ylabel("server RSS (MiB)")
    ax1.grid(alpha=0.3)
    ax2.plot(t, [s[2] for s in samples], color="tab:purple")
    ax2.set_ylabel("open file descriptors")
    ax2.set_xlabel("seconds since sampling started")
    ax2.grid(alpha=0.3)
    fig.suptitle("server process tree (summed)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=100)
    plt.close(fig)
    return str(path)
