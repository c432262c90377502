"""Store writes and reads, the two backends in one run: put and get MB/s of 4 MB entries (a 448x448 image
on the 4B preset in bfloat16: 196 tokens x 10,240) and the median put's latency, Mooncake Store over TCP on
loopback against the directory store in /dev/shm (the baseline). Any machine; no GPU.

    python bench/bench_store.py --out DIR [--entries 64] [--rounds 3]

Puts run in this process through the service's own store classes (directory.DirectoryStore,
mooncake.MooncakeStore, with the segment in this process); gets run in another process, as an LM
server reads (store/reader.py's readers), so the Mooncake gets cross a process boundary by TCP. Each
round writes new keys. Needs Mooncake's client (the `mooncake` extra) and mooncake_master. Prints each
round's MB/s, then a table of the medians (put MB/s, put ms, get MB/s) and Mooncake / directory;
DIR/bench_store.json holds every round.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "kernels")]  # this checkout\'s service and kernels

TOKENS, OUT_HIDDEN, LEVELS = 196, 2560, 3  # the 4B preset: 2560 x (1 + 3) = 10,240 columns


def _reader(store: str, keys: list[str], namespace: str | None) -> None:
    """In its own process: read every key once; print the seconds it took (JSON)."""
    import torch  # noqa: F401  (imported before the clock starts: the readers import it on their first read)

    from service.store.reader import open_reader

    reader = open_reader(store, namespace=namespace) if store.startswith("mooncake://") else open_reader(store)
    t0 = time.perf_counter()
    for k in keys:
        emb = reader.read(k)
        assert emb.main.shape == (TOKENS, OUT_HIDDEN)
    print(json.dumps({"s": time.perf_counter() - t0}))


def _gets(store: str, keys: list[str], namespace: str | None) -> float:
    code = ("import json, sys; sys.path.insert(0, %r); from bench.bench_store import _reader; "
            "_reader(%r, json.loads(sys.argv[1]), %r)") % (str(ROOT), store, namespace)
    out = subprocess.run([sys.executable, "-c", code, json.dumps(keys)], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "MC_TCP_BIND_ADDRESS": "127.0.0.1"})
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])["s"]


def main() -> int:
    import torch

    from service.store.options import MOONCAKE_BUFFER_BYTES, MooncakeOptions
    from service.store.directory import DirectoryStore
    from service.store.mooncake import MooncakeStore
    from tests.support.mooncake_pool import LOOPBACK, Master

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--entries", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    ec = torch.randn(TOKENS, OUT_HIDDEN * (1 + LEVELS)).to(torch.bfloat16)
    mb = ec.numel() * ec.element_size() / 1e6
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    work = Path(tempfile.mkdtemp(prefix="qve-bench-store-", dir=shm))
    binary = Path(sys.executable).parent / "mooncake_master"  # (the mooncake extra's, beside this Python)
    master = Master(binary, LOOPBACK, work / "master.log", lease_ttl_ms=30_000)
    seg = int(args.entries * mb * 1e6 * (args.rounds + 1) * 1.3)  # all rounds' entries, with room under the watermark
    pooled = MooncakeStore(master.url, MooncakeOptions(master=master.url.removeprefix("mooncake://"),
                                                       local_host="127.0.0.1", segment_bytes=seg,
                                                       buffer_bytes=MOONCAKE_BUFFER_BYTES, protocol="tcp", namespace=None),
                           model_id="bench", out_hidden_size=OUT_HIDDEN, deepstack_levels=LEVELS, dtype="bfloat16",
                           min_residency_s=0, salt="bench")
    directory = DirectoryStore(work / "dir", 64 << 30, "bench", out_hidden_size=OUT_HIDDEN, deepstack_levels=LEVELS,
                               dtype="bfloat16", min_residency_s=0)
    runs: dict[str, dict[str, list[float]]] = {n: {"put": [], "put_ms": [], "get": []} for n in ("directory", "mooncake")}
    try:
        for r in range(args.rounds):
            for name, store, url, ns in (("directory", directory, str(work / "dir"), None),
                                         ("mooncake", pooled, master.url, pooled.namespace)):
                keys = [f"r{r}-{i}" for i in range(args.entries)]
                took = []
                for k in keys:
                    t0 = time.perf_counter()
                    store.put(k, ec, (1, 28, 28))
                    took.append(time.perf_counter() - t0)
                runs[name]["put"].append(args.entries * mb / sum(took))
                runs[name]["put_ms"].append(1e3 * statistics.median(took))
                runs[name]["get"].append(args.entries * mb / _gets(url, keys, ns))
                print(f"round {r + 1} {name}: put {runs[name]['put'][-1]:.0f} MB/s, get {runs[name]['get'][-1]:.0f} MB/s",
                      flush=True)
    finally:
        pooled.close()
        master.stop()
        subprocess.run(["rm", "-rf", str(work)])
    res = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "command": " ".join(sys.argv),
           "cpus": os.cpu_count(), "python": platform.python_version(), "entry_mb": round(mb, 3),
           "entries": args.entries, "rounds": args.rounds, "runs": runs,
           "medians": {n: {op: round(statistics.median(v), 3 if op == "put_ms" else 1) for op, v in ops.items()}
                       for n, ops in runs.items()}}
    (args.out / "bench_store.json").write_text(json.dumps(res, indent=2))
    m = res["medians"]
    print(f"\n{res['date']}  {res['cpus']} CPUs  {args.entries} entries of {mb:.2f} MB x {args.rounds} rounds (medians)")
    print("backend | put MB/s | put ms (median) | get MB/s (another process)")
    for n in m:
        print(f"{n} | {m[n]['put']} | {m[n]['put_ms']} | {m[n]['get']}")
    print(f"mooncake / directory | {m['mooncake']['put'] / m['directory']['put']:.2f} | "
          f"{m['mooncake']['put_ms'] / m['directory']['put_ms']:.2f} | {m['mooncake']['get'] / m['directory']['get']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
