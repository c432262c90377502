"""The real-world photo-size mix over HTTP: `serve` with each configuration in turn, the same black-box
load against each, in one run on one machine (a CUDA GPU).

    python bench/bench_mix.py --out DIR [--preset qwen3-vl-4b] [--configs "cudnn:--attention cudnn;auto:"]
        [--requests 3000] [--processes 4] [--concurrency 64] [--idle 60] [--sizes 448x448] [--profile-s 8]

Load: `python -m service loadtest` as a separate program (4 client processes, asyncio httpx), one image per request,
distinct JPEG photographs (the `photo` pattern) cycled over ten real-world sizes (640x480 ... 1280x960),
--concurrency in flight in all, after a warm-up of 256 requests; then --idle requests one at a time (an
idle server's latency, p50). A configuration is `name:extra serve flags`; `cudnn` (--attention cudnn:
batched cuDNN, FA2 varlen) is the kernels before the measured plan, the baseline of the same run.
The tower's FLOPs per image (bench_tower.tower_flops) turn img/s into TFLOP/s. Prints a row per configuration
as it finishes, then a table (img/s, TFLOP/s and the ratio to the first configuration, latency, idle p50);
JSON DIR/bench_mix.json. `--sizes 448x448` (with --requests 8000 --concurrency 128): 448px photographs instead.

Where the time goes, per configuration: the CPU seconds of every server process and thread (and of the load
generator: its client and image-building processes) over the measured load, the engine's steps and images per
step (/metrics), the GPU's busy fraction (nvidia-smi, every 100 ms); `--profile-s N` then samples every server
process with py-spy (if on PATH) for N s of a further load (bench_frontend.profile; DIR/pyspy_*.top).
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "kernels")]  # this checkout\'s service and kernels

from bench.bench_frontend import (cpu_snapshot, cpu_used, engine_counters, gpu_busy, gpu_busy_pct,  # noqa: E402
                                  per_step, profile, stop, store_parent, summarize, wait_ready)
from bench.bench_tower import REAL_WORLD_SIZES  # noqa: E402

SIZES = ",".join(f"{w}x{h}" for w, h in REAL_WORLD_SIZES)


def load(args, port: int, out: Path, requests: int, concurrency: int, processes: int, seed: int) -> dict:
    cmd = [sys.executable, "-m", "service", "loadtest", "--url", f"http://127.0.0.1:{port}",
           "--sizes", args.sizes, "--pattern", "photo", "--format", "jpeg", "--images-per-request", "1",
           "--requests", str(requests), "--duration-s", "600", "--concurrency", str(concurrency),
           "--processes", str(processes), "--seed", str(seed), "--out", str(out.resolve()), "--quiet"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)  # (cwd: this checkout's service)
    if done.returncode != 0:
        raise RuntimeError(f"loadtest failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    return json.loads(out.read_text())


def children_cpu_s() -> float:
    """CPU seconds of this process's finished children (the load generator and its processes)."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--preset", default="qwen3-vl-4b")
    ap.add_argument("--configs", default="cudnn:--attention cudnn;auto:")
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--processes", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--idle", type=int, default=60)
    ap.add_argument("--sizes", default=SIZES, help="image sizes WxH,... cycled over the requests (default: the mix)")
    ap.add_argument("--profile-s", type=int, default=0, help="py-spy every server process for N s of a further load")
    ap.add_argument("--profile-gil", action=argparse.BooleanOptionalAction, default=True,
                    help="py-spy --gil (only the thread holding each process's GIL)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    import torch

    from bench.bench_tower import tower_flops
    from service.config import Settings
    from service.engine.loader import load_model
    from service.media.preprocess import grid_for, smart_resize

    model = load_model(Settings(model=args.preset, device="cpu", dtype="float32"))  # geometry only
    sizes = [tuple(int(v) for v in s.split("x")) for s in args.sizes.split(",")]
    patches = [h * w for _, h, w in (grid_for(*smart_resize(hh, ww, model.params), model.params) for ww, hh in sizes)]
    tflop_per_image = tower_flops(model.spec, patches, frame_only=False) / len(patches) / 1e12
    del model
    res = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "command": " ".join(sys.argv),
           "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none", "torch": torch.__version__,
           "python": platform.python_version(), "preset": args.preset, "sizes": args.sizes,
           "tflop_per_image": round(tflop_per_image, 4), "runs": []}
    cache = Path(tempfile.mkdtemp(prefix="qve-mix-cc-"))

    def save():
        (args.out / "bench_mix.json").write_text(json.dumps(res, indent=2))

    for i, config in enumerate(args.configs.split(";")):
        name, _, flags = config.partition(":")
        port = 18200 + i
        parent, flags = store_parent(flags)  # (a config's @store=DIR: its store under DIR)
        store = Path(tempfile.mkdtemp(prefix="qve-mix-", dir=parent))
        log = args.out / f"serve_{name}.log"
        cmd = [sys.executable, "-m", "service", "serve", "--model", args.preset, "--port", str(port),
               "--store", str(store), "--store-capacity-bytes", str(16 * 1024**3), "--store-min-residency-s", "0",
               "--max-queue-images", "4096", "--compile-cache", str(cache), *shlex.split(flags)]
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log.open("w"), stderr=subprocess.STDOUT)
        try:
            wait_ready(proc, port, log, f"server {name}")
            row = {"name": name, "flags": flags, "ready_s": round(time.perf_counter() - t0, 1)}
            load(args, port, args.out / f"warm_{name}.json", 256, args.concurrency, args.processes, 1000 + i)
            steps0, cpu0, client0, busy = engine_counters(port), cpu_snapshot([proc.pid]), children_cpu_s(), gpu_busy()
            rep = load(args, port, args.out / f"load_{name}.json", args.requests, args.concurrency, args.processes,
                       2000 + i)
            busy_pct, client_s, cpu, steps1 = gpu_busy_pct(busy), children_cpu_s() - client0, cpu_used(cpu0, cpu_snapshot(
                [proc.pid])), engine_counters(port)
            s = rep["summary"]
            row.update(ok_images=s["ok_images"], requests=s["requests"], errors=s["errors"],
                       img_s=round(s["images_per_s"], 1), tflops=round(s["images_per_s"] * tflop_per_image, 1),
                       latency_ms=s["latency_ms"], gpu_busy_pct=busy_pct,
                       **per_step(steps0, steps1, s["wall_s"]),
                       server_cpu_s=round(sum(p["cpu_s"] for p in cpu["processes"]), 1),
                       load_generator_cpu_s=round(client_s, 1), cpu=cpu)
            if args.profile_s:
                spies = profile(args, proc.pid, name)
                load(args, port, args.out / f"profiled_{name}.json", args.requests, args.concurrency, args.processes,
                     4000 + i)
                summarize(spies)
            idle = load(args, port, args.out / f"idle_{name}.json", args.idle, 1, 1, 3000 + i)
            row["idle_p50_ms"] = idle["summary"]["latency_ms"].get("p50")
            res["runs"].append(row)
            print(name, row, flush=True)
            save()
        finally:
            stop(proc, 60)
            shutil.rmtree(store, ignore_errors=True)  # (the next config's store may share its tmpfs)
    base = res["runs"][0]["img_s"] if res["runs"] else None
    print(f"\n{res['date']}  {res['gpu']}  preset {args.preset}  1 image/request, "
          f"{args.concurrency} in flight, {args.processes} client processes, sizes {args.sizes}")
    for r in res["runs"]:
        print(f"{r['name']:8s} {r['img_s']} img/s ({r['tflops']} TFLOP/s, x{(r['img_s'] or 0) / (base or 1):.3f}) "
              f"p50 {r['latency_ms'].get('p50')} ms, idle p50 {r['idle_p50_ms']} ms, errors {r['errors']}; "
              f"{r.get('images_per_step')} images/step, GPU busy {r['gpu_busy_pct']}%, CPU s: server {r['server_cpu_s']}, "
              f"load generator {r['load_generator_cpu_s']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
