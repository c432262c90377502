"""What a busy Python thread does to Mooncake calls (issue 21: Mooncake at 1 image per request was 0.59-0.72
of the directory's img/s on the H200 machine). Every call into Mooncake's client releases the GIL and
takes it back on return; with another thread busy in Python, taking it back can wait a whole switch
interval (5 ms), as the engine process's step loop, host and writer threads are. Measured here, in one
process, with no other thread and then with one thread spinning in Python:

    python bench/probe_mooncake_gil.py --out DIR [--seconds 3] [--entries 16]

  is_exist          one key per call
  lookup_many       --entries keys per call (MooncakeStore.lookup_many: one batch_is_exist)
  entry by entry    each entry's value (header + 4 MB of rows) and companion by two upsert_parts,
                    as MooncakeStore committed before it batched
  commit_many       --entries entries per call (one batch_remove, one batch_put_from_multi_buffers)

Entries are 196 x 10,240 bfloat16 (a 448px image on the 4B preset: 4.01 MB). Needs Mooncake's client and
mooncake_master (the `mooncake` extra). DIR/probe_mooncake_gil.json and a table on stdout.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")  # (else Mooncake advertises another interface)

TOKENS, WIDTH = 196, 2560 * 4


def _binary() -> Path:
    spec = importlib.util.find_spec("mooncake")
    found = Path(list(spec.submodule_search_locations)[0]) / "mooncake_master" if spec else None
    return found if found is not None and found.exists() else Path(shutil.which("mooncake_master") or "mooncake_master")


def main() -> int:
    import torch

    from service.config import MOONCAKE_BUFFER_BYTES, MooncakeOptions, parse_mooncake
    from service.store.format import tensor_bytes
    from service.store.mooncake import DTYPE_CODES, HEADER, MAGIC, MooncakeStore, meta_key, value_key
    from tests.mooncake_pool import LOOPBACK, Master

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--entries", type=int, default=16)
    ap.add_argument("--switch-interval-s", type=float, default=None,
                    help="sys.setswitchinterval for the run (Python's default: 0.005)")
    args = ap.parse_args()
    if args.switch_interval_s is not None:
        sys.setswitchinterval(args.switch_interval_s)
    args.out.mkdir(parents=True, exist_ok=True)
    res: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "command": " ".join(sys.argv),
                 "cpus": os.cpu_count(), "python": platform.python_version(), "entry_bytes": TOKENS * WIDTH * 2,
                 "entries_per_call": args.entries,
                 "switch_interval_s": sys.getswitchinterval(), "per_s": {}}
    master = Master(_binary(), LOOPBACK, Path(tempfile.mkdtemp(prefix="qve-probe-")) / "master.log", lease_ttl_ms=1000)
    try:
        options = MooncakeOptions(master=parse_mooncake(master.url), local_host="127.0.0.1", segment_bytes=1 << 30,
                                  buffer_bytes=MOONCAKE_BUFFER_BYTES, protocol="tcp", namespace=None)
        store = MooncakeStore(master.url, options, model_id="probe", out_hidden_size=2560, deepstack_levels=3,
                              dtype="bfloat16", min_residency_s=0, salt="probe")
        rows = [torch.randn(TOKENS, WIDTH).to(torch.bfloat16) for _ in range(args.entries)]
        keys = [f"e{i}" for i in range(args.entries)]
        store.commit_many([store.reserve(k, (TOKENS, WIDTH), torch.bfloat16, (1, 28, 28)) for k in keys], rows)

        def rate(fn, per_call: int) -> float:
            t0, calls = time.perf_counter(), 0
            while time.perf_counter() - t0 < args.seconds:
                fn()
                calls += 1
            return round(per_call * calls / (time.perf_counter() - t0), 1)

        header = memoryview(bytearray(HEADER.pack(MAGIC, DTYPE_CODES["bfloat16"], TOKENS, WIDTH)))

        def one_by_one():  # (MooncakeStore's commit before it batched: two upsert_parts per entry)
            for k, r in zip(keys, rows):
                assert store.client.upsert_parts(value_key(store.namespace, k), header, tensor_bytes(r),
                                                 config=store._config) == 0
                assert store.client.upsert_parts(meta_key(store.namespace, k), json.dumps({"key": k}).encode(),
                                                 config=store._config) == 0

        def batched():
            out = store.commit_many([store.reserve(k, (TOKENS, WIDTH), torch.bfloat16, (1, 28, 28)) for k in keys], rows)
            assert not any(isinstance(o, Exception) for o in out), out

        probes = {
            "is_exist": (lambda: store.client.is_exist(meta_key(store.namespace, keys[0])), 1),
            "lookup_many": (lambda: store.lookup_many(keys), args.entries),
            "entry_by_entry": (one_by_one, args.entries),
            "commit_many": (batched, args.entries),
        }
        for busy in (False, True):
            stop = threading.Event()

            def spin():  # pure Python, holding the GIL whenever it runs
                n = 0
                while not stop.is_set():
                    n += 1

            spinner = threading.Thread(target=spin, daemon=True)
            if busy:
                spinner.start()
            try:
                res["per_s"]["busy thread" if busy else "alone"] = {name: rate(fn, n) for name, (fn, n) in probes.items()}
            finally:
                stop.set()
                if busy:
                    spinner.join()
            (args.out / "probe_mooncake_gil.json").write_text(json.dumps(res, indent=2))
        store.close()
    finally:
        master.stop()
    print(f"{res['date']}  {res['cpus']} CPUs  {args.entries} entries of {res['entry_bytes']} bytes per call")
    print("probe | alone /s | one busy Python thread /s")
    for name in probes:
        print(f"{name} | {res['per_s']['alone'][name]} | {res['per_s']['busy thread'][name]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
