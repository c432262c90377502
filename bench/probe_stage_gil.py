"""Copying a step's pixels into a staging buffer while other threads want the GIL (the 2-core machine's probe
behind the one-copy staging tried on 2026-12-03 and reverted, bench/RESULTS.md): 39 448px images copied one numpy
assignment each, with one np.concatenate, and with one torch.cat, beside N threads that run Python and a system
call in a loop (as the store's threads do), with the engine process's switch interval (1 ms).

    python bench/probe_stage_gil.py [N]      # N contending threads (default 3); prints ms per step, each way
"""

from __future__ import annotations

import os
import sys
import threading
import time

import numpy as np
import torch


def main() -> None:
    hogs = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    sys.setswitchinterval(0.001)  # as service/procs/engine_process.py sets it
    torch.set_num_threads(1)
    srcs = [np.random.randint(0, 255, 448 * 448 * 3, dtype=np.uint8) for _ in range(39)]
    dst = np.empty(sum(s.size for s in srcs), dtype=np.uint8)
    tdst, tsrc = torch.from_numpy(dst), [torch.from_numpy(s) for s in srcs]
    stop = False

    def hog() -> None:
        x = 0
        while not stop:
            for i in range(1000):
                x += i
            os.stat("/")  # gives the GIL up briefly, as a store thread's system calls do

    threads = [threading.Thread(target=hog) for _ in range(hogs)]
    for t in threads:
        t.start()

    def per_image() -> None:
        off = 0
        for s in srcs:
            dst[off : off + s.size] = s
            off += s.size

    ways = {"numpy per image": per_image, "np.concatenate": lambda: np.concatenate(srcs, out=dst),
            "torch.cat": lambda: torch.cat(tsrc, out=tdst)}
    for name, fn in ways.items():
        fn()
        t0 = time.perf_counter()
        for _ in range(20):
            fn()
        print(f"{hogs} threads  {name:16s} {(time.perf_counter() - t0) / 20 * 1e3:.2f} ms", flush=True)
    stop = True
    for t in threads:
        t.join()


if __name__ == "__main__":
    main()
