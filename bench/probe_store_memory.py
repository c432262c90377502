"""What a store write costs on this machine's tmpfs, and why: page allocation, first touch, copy.

    python bench/probe_store_memory.py --out DIR [--dir /dev/shm] [--gb 4] [--threads 4]

Writes entries of one 448px image's size (196 tokens x 10240 bf16 = 4,014,080 bytes) as the store does
(`posix_fallocate` = the reservation, then one `writev` = the commit), in rounds over the same amount of
data, each round's files unlinked before the next:
  fresh      the first round: the machine has not held this much memory yet
  reused     at once again (the pages just freed)
  rested     again after 5 s (a virtual machine may have handed freed memory back to its host)
  threads    --threads writers at once (each its share), reused memory
  mapped     reservation = fallocate + mmap(MAP_POPULATE); commit = one memmove into the mapping; the
             munmap timed apart (it can follow the answer)
  huge       the `fresh` round on a tmpfs mounted with huge=always, where this machine lets us mount one
Also anonymous memory touched for the first and the second time (numpy), and the kernel's settings that
decide huge pages on tmpfs. Medians per entry in ms, rates in GB/s; DIR/probe_store_memory.json.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import platform
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ENTRY = 196 * 10240 * 2


def meminfo() -> dict[str, int]:
    out = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        k, v = line.split(":", 1)
        if k in ("MemTotal", "MemFree", "MemAvailable", "Shmem", "ShmemHugePages", "AnonHugePages"):
            out[k] = int(v.split()[0]) // 1024  # MiB
    return out


def write_round(d: Path, n: int, src: np.ndarray, mapped: bool = False, tag: str = "") -> dict:
    """n entries into d: per-entry reserve / commit (/ unmap) seconds, the round's wall time."""
    mv = memoryview(src)
    res, com, unm = [], [], []
    t_start = time.perf_counter()
    for i in range(n):
        p = d / f"{tag}{i}"
        fd = os.open(p, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o644)
        t0 = time.perf_counter()
        os.posix_fallocate(fd, 0, ENTRY)
        m = mmap.mmap(fd, ENTRY, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE) if mapped else None
        t1 = time.perf_counter()
        if m is None:
            os.writev(fd, [mv])
        else:
            ctypes.memmove(ctypes.addressof(ctypes.c_char.from_buffer(m)), src.ctypes.data, ENTRY)
        t2 = time.perf_counter()
        if m is not None:
            m.close()
        t3 = time.perf_counter()
        os.close(fd)
        res.append(t1 - t0), com.append(t2 - t1), unm.append(t3 - t2)
    wall = time.perf_counter() - t_start
    med = lambda xs: round(1e3 * statistics.median(xs), 3)  # noqa: E731
    out = {"entries": n, "reserve_ms": med(res), "commit_ms": med(com), "wall_s": round(wall, 3),
           "gb_s": round(n * ENTRY / wall / 1e9, 2), "reserve_gb_s": round(n * ENTRY / sum(res) / 1e9, 2),
           "commit_gb_s": round(n * ENTRY / sum(com) / 1e9, 2)}
    if mapped:
        out["unmap_ms"] = med(unm)
    return out


def clear(d: Path) -> None:
    for p in d.iterdir():
        p.unlink()


def threaded(d: Path, n: int, src: np.ndarray, threads: int) -> dict:
    parts: list[dict] = [{} for _ in range(threads)]

    def run(k: int) -> None:
        parts[k] = write_round(d, n // threads, src, tag=f"t{k}_")

    t0 = time.perf_counter()
    ts = [threading.Thread(target=run, args=(k,)) for k in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    wall = time.perf_counter() - t0
    return {"threads": threads, "entries": n, "wall_s": round(wall, 3), "gb_s": round(n * ENTRY / wall / 1e9, 2),
            "per_thread": parts}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--dir", default="/dev/shm")
    ap.add_argument("--gb", type=float, default=4.0)
    ap.add_argument("--threads", type=int, default=4)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    n = int(args.gb * 1e9 / ENTRY)
    src = np.random.default_rng(0).integers(0, 255, ENTRY, dtype=np.uint8)
    r: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "kernel": platform.release(),
               "cpus": os.cpu_count(), "entry_bytes": ENTRY, "command": "python bench/probe_store_memory.py " +
               f"--out OUT --dir {args.dir} --gb {args.gb} --threads {args.threads}"}
    for f in ("/sys/kernel/mm/transparent_hugepage/shmem_enabled", "/sys/kernel/mm/transparent_hugepage/enabled"):
        r[f] = Path(f).read_text().strip() if Path(f).exists() else None
    r["meminfo_start_mib"] = meminfo()

    def show(k: str) -> None:
        print(k, r[k], flush=True)
        (args.out / "probe_store_memory.json").write_text(json.dumps(r, indent=2))

    d = Path(tempfile.mkdtemp(prefix="probe-store-", dir=args.dir))
    try:
        r["fresh"] = write_round(d, n, src)
        r["meminfo_after_fresh_mib"] = meminfo()
        show("fresh")
        clear(d)
        r["reused"] = write_round(d, n, src)
        show("reused")
        clear(d)
        time.sleep(5)
        r["rested"] = write_round(d, n, src)
        show("rested")
        clear(d)
        r["threads"] = threaded(d, n, src, args.threads)
        show("threads")
        clear(d)
        r["mapped"] = write_round(d, n, src, mapped=True)
        show("mapped")
        clear(d)
        r["meminfo_end_mib"] = meminfo()
    finally:
        shutil.rmtree(d, ignore_errors=True)

    # Anonymous memory, first and second touch of the same amount (numpy fills; freed in between).
    for k in ("anon_first", "anon_second"):
        t0 = time.perf_counter()
        a = np.ones(n * ENTRY // 8, dtype=np.float64)
        r[k] = {"gb_s": round(a.nbytes / (time.perf_counter() - t0) / 1e9, 2)}
        del a
        show(k)

    huge = Path(tempfile.mkdtemp(prefix="probe-huge-"))
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", f"huge=always,size={int(args.gb * 1.5 * 1e9)}", "tmpfs",
                            str(huge)], capture_output=True, text=True)
    r["huge_mount"] = {"rc": mount.returncode, "stderr": mount.stderr.strip()[-300:]}
    if mount.returncode == 0:
        try:
            r["huge"] = write_round(huge, n, src)
            r["huge"]["shmem_huge_mib"] = meminfo().get("ShmemHugePages")
            clear(huge)
            r["huge_reused"] = write_round(huge, n, src)
            clear(huge)
        finally:
            subprocess.run(["umount", str(huge)], check=False)
    show("huge_mount")
    huge.rmdir()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
