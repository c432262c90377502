"""Puts into a fresh Mooncake segment against puts into one already written (issue 21: on the H200, Mooncake
at 1 image per request gave 0.55-0.79 of the directory's img/s while one engine thread, Mooncake's, spent
most of its time in the kernel). A put into this host's own segment is a memcpy in Mooncake's one memcpy
thread; each page of a segment nobody has written yet costs that thread a page fault and the kernel's
zeroing of the page. store/mooncake.connect now faults the segment in at start (fault_in).

    python bench/probe_mooncake_fault.py --out DIR [--segment-mib 1024] [--passes 2]

Each mode in a process of its own, with its own client and segment on one mooncake_master (loopback, TCP):
`untouched` (fault_in skipped: as before) and `faulted in` (as connect does now). Each pass puts 4.01 MB
entries (a 448px image on the 4B preset), 16 per commit_many, until 90% of the segment is written, then
removes them all. Per pass: MB/s, the process's user and kernel CPU seconds. DIR/probe_mooncake_fault.json
and a table. Needs Mooncake's client and mooncake_master (the `mooncake` extra).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")  # (else Mooncake advertises another interface)

TOKENS, WIDTH = 196, 2560 * 4


def run_mode(url: str, segment: int, passes: int, fault: bool) -> dict:
    """In this process: one client, its segment, `passes` passes of puts. Returns the figures."""
    import torch

    from service.config import MOONCAKE_BUFFER_BYTES, MooncakeOptions, parse_mooncake
    from service.store import mooncake

    if not fault:
        mooncake.fault_in = lambda ranges, expected: None
    options = MooncakeOptions(master=parse_mooncake(url), local_host="127.0.0.1", segment_bytes=segment,
                              buffer_bytes=MOONCAKE_BUFFER_BYTES, protocol="tcp", namespace=None)
    t0 = time.perf_counter()
    store = mooncake.MooncakeStore(url, options, model_id="probe", out_hidden_size=2560, deepstack_levels=3,
                                   dtype="bfloat16", min_residency_s=0, salt="probe")
    out = {"setup_s": round(time.perf_counter() - t0, 2), "passes": []}
    rows = [torch.randn(TOKENS, WIDTH).to(torch.bfloat16) for _ in range(16)]
    entry = TOKENS * WIDTH * 2
    n = int(0.9 * segment / entry) // 16 * 16
    for p in range(passes):
        c0, t0 = os.times(), time.perf_counter()
        for i in range(0, n, 16):
            keys = [f"p{p}-{j}" for j in range(i, i + 16)]
            res = store.commit_many([store.reserve(k, (TOKENS, WIDTH), torch.bfloat16, (1, 28, 28)) for k in keys], rows)
            assert not any(isinstance(r, Exception) for r in res), res
        dt, c1 = time.perf_counter() - t0, os.times()
        out["passes"].append({"entries": n, "mb_s": round(n * entry / dt / 1e6, 1), "user_s": round(c1.user - c0.user, 2),
                              "kernel_s": round(c1.system - c0.system, 2)})
        store.client.remove_all()
    store.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path)
    ap.add_argument("--segment-mib", type=int, default=1024)
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--mode", choices=("untouched", "faulted"), help=argparse.SUPPRESS)  # (the child's)
    ap.add_argument("--url", help=argparse.SUPPRESS)
    args = ap.parse_args()
    segment = args.segment_mib * 1024**2
    if args.mode:
        print(json.dumps(run_mode(args.url, segment, args.passes, args.mode == "faulted")))
        return 0
    from bench.probe_mooncake_gil import _binary
    from tests.mooncake_pool import LOOPBACK, Master

    args.out.mkdir(parents=True, exist_ok=True)
    res: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "command": " ".join(sys.argv),
                 "cpus": os.cpu_count(), "python": platform.python_version(), "kernel": platform.release(),
                 "entry_bytes": TOKENS * WIDTH * 2, "segment_bytes": segment, "modes": {}}
    master = Master(_binary(), LOOPBACK, Path(tempfile.mkdtemp(prefix="qve-probe-")) / "master.log", lease_ttl_ms=1000)
    try:
        for mode in ("untouched", "faulted"):
            child = subprocess.run([sys.executable, __file__, "--mode", mode, "--url", master.url, "--segment-mib",
                                    str(args.segment_mib), "--passes", str(args.passes)],
                                   capture_output=True, text=True, timeout=600)
            if child.returncode != 0:
                raise SystemExit(f"{mode} failed:\n{child.stderr[-3000:]}")
            res["modes"][mode] = json.loads(child.stdout.strip().splitlines()[-1])
            (args.out / "probe_mooncake_fault.json").write_text(json.dumps(res, indent=2))
    finally:
        master.stop()
    print(f"{res['date']}  {res['cpus']} CPUs  kernel {res['kernel']}  segment {args.segment_mib} MiB, "
          f"entries of {res['entry_bytes']} bytes, 16 a call")
    print("| segment | setup s | pass | MB/s | user s | kernel s |")
    print("|---|---|---|---|---|---|")
    for mode, r in res["modes"].items():
        for i, p in enumerate(r["passes"]):
            print(f"| {mode} | {r['setup_s']} | {i + 1} | {p['mb_s']} | {p['user_s']} | {p['kernel_s']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
