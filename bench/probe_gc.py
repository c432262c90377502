"""Python's garbage collector in a process holding what an engine process holds (any machine; writes
DIR/probe_gc.json): the full collection's time with the start-up objects in the collector's generations and
after gc.freeze (procs/child.py's settle_heap), and the automatic collections that a serving engine's
long-lived objects trigger (a store entry per image: here ENTRIES small objects, as store/directory.py keeps
per entry), with their pauses, before and after the freeze.

    python bench/probe_gc.py --out DIR [--model qwen3-vl-4b] [--entries 50000]
    python bench/probe_gc.py --out DIR --survivors 1000   # the tracked objects a real request leaves alive

--survivors N: the single-process service (tiny model, CPU) in this process answers N distinct small PNGs one
by one after a warm-up; the tracked objects alive after a full collection, per image (what the store keeps).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


@dataclass
class _Entry:  # the shape of a store index entry (store/directory.py's _Entry holding a StoredItem)
    nbytes: int
    item: dict
    keep_until: float = 0.0


def full_ms() -> float:
    t0 = time.perf_counter()
    gc.collect()
    return round(1e3 * (time.perf_counter() - t0), 3)


def churn(entries: int) -> dict:
    """Keep `entries` new long-lived objects, with temporaries between them; the automatic collections of
    generation 2 meanwhile and their pauses."""
    pauses: list[float] = []
    started: dict[int, float] = {}

    def cb(phase, info):
        if info["generation"] != 2:
            return
        if phase == "start":
            started[2] = time.perf_counter()
        else:
            pauses.append(time.perf_counter() - started.pop(2))

    gc.callbacks.append(cb)
    kept = {}
    t0 = time.perf_counter()
    for i in range(entries):
        tmp = [{"k": i} for _ in range(20)]  # an answer's temporaries
        kept[f"key{i}"] = _Entry(4_014_080, {"key": f"key{i}", "grid": [1, 28, 28], "tmp": len(tmp)})
    wall = time.perf_counter() - t0
    gc.callbacks.remove(cb)
    return {"entries": entries, "wall_s": round(wall, 3), "full_collections": len(pauses),
            "pause_ms_total": round(1e3 * sum(pauses), 1), "pause_ms_max": round(1e3 * max(pauses, default=0), 1)}


def survivors(n: int) -> dict:
    """Tracked objects left alive per image by n requests to the single-process service (tiny model, CPU)."""
    import base64
    import tempfile

    from fastapi.testclient import TestClient

    from service.config import Settings
    from service.procs.local import local_app
    from tests import imagedata

    settings = Settings(model="tiny", device="cpu", store=Path(tempfile.mkdtemp()) / "store", decode_workers=1,
                        max_pixels=256 * 256)
    blobs = [imagedata.encode(imagedata.textured_rgb(64, 64, seed=i), "PNG") for i in range(n + 200)]

    def body(b: bytes) -> dict:
        url = "data:image/png;base64," + base64.b64encode(b).decode()
        return {"images": [{"type": "image_url", "image_url": {"url": url}}]}

    with TestClient(local_app(settings)) as client:
        while client.get("/ready").status_code != 200:
            time.sleep(0.1)
        for b in blobs[:200]:  # warm-up: every path's caches filled
            assert client.post("/encode", json=body(b)).status_code == 200
        gc.collect()
        before = len(gc.get_objects())
        for b in blobs[200:]:
            assert client.post("/encode", json=body(b)).status_code == 200
        gc.collect()
        after = len(gc.get_objects())
    return {"images": n, "objects_alive_per_image": round((after - before) / n, 2)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="qwen3-vl-4b")
    ap.add_argument("--entries", type=int, default=50_000)
    ap.add_argument("--survivors", type=int, default=0)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.survivors:
        res = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "command": " ".join(sys.argv),
               "python": sys.version.split()[0], **survivors(args.survivors)}
        print(json.dumps(res, indent=1))
        (out / "probe_gc_survivors.json").write_text(json.dumps(res, indent=1))
        return
    t0 = time.perf_counter()
    import torch  # noqa: F401

    from service.config import Settings
    from service.engine.loader import load_model
    from service.procs.child import settle_heap

    model = load_model(Settings(model=args.model, device="cpu", dtype="float32"))  # noqa: F841 (held)
    res = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "command": " ".join(sys.argv),
           "python": sys.version.split()[0], "model": args.model, "load_s": round(time.perf_counter() - t0, 1),
           "objects": len(gc.get_objects())}
    res["full_collection_ms"] = min(full_ms() for _ in range(3))
    res["churn"] = churn(args.entries)
    frozen, seconds = settle_heap()
    res["frozen"], res["settle_s"] = frozen, round(seconds, 3)
    res["full_collection_ms_frozen"] = min(full_ms() for _ in range(3))
    res["churn_frozen"] = churn(args.entries)
    print(json.dumps(res, indent=1))
    (out / "probe_gc.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
