"""Video throughput on one GPU: this service against transformers' video processor + vision tower one
request at a time, in one run on one machine (needs PyAV, torchvision and transformers).

    python bench/bench_video.py --out DIR [--preset qwen3-vl-4b] [--seconds 30] [--fps 30]
        [--sizes 1280x720,1920x1080] [--configs default,budget] [--clips 16] [--concurrency 8]
        [--api-processes 4] [--one-at-a-time 3]

1. A vision-only checkpoint of the preset's architecture (transformers' Qwen3VLVisionModel with seeded random
   weights, saved in bf16), one directory per video config, which differ only in video_preprocessor_config.json:
   `default` = Qwen3VLVideoProcessor's class defaults (the whole clip within 786,432 pixels: ~240 tokens for
   30 s), `budget` = size {shortest_edge 4096, longest_edge 25,165,824} (32 times that: ~12k tokens).
2. Per size, one H.264 MP4 (libx264 preset `fast`, crf 23, yuv420p, B-frames and CABAC as encoders make
   them) of --seconds at --fps: a camera pan across a real photograph (the load tool's `photo` pattern), and
   --clips variants of it, the same packets remuxed under another metadata comment: distinct bytes, so no
   cache hits, and the same decode work.
3. transformers, one clip at a time: its own PyAV loader (video_utils.read_video_pyav, the indices from the
   processor's sample_frames), Qwen3VLVideoProcessor on the sampled frames (its default torchvision path on
   the CPU), Qwen3VLVisionModel (sdpa, bf16) on the GPU, synchronised; one warm-up, then --one-at-a-time
   clips timed.
4. The service (`serve --model CKPT --api-processes N`): the same clips one at a time, then --clips clips
   with --concurrency requests in flight (JSON data URLs, one video per request).
Frames are the sampled frames (an answer's frames_indices), tokens its num_tokens; `source frames/s` counts
the frames of the clips, each of which is decoded. JSON DIR/bench_video.json (written after every phase)
and a table on stdout.
"""

from __future__ import annotations

import argparse
import base64
import http.client
import io
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "kernels")]  # this checkout\'s service and kernels

from bench.bench_frontend import stop, wait_ready  # noqa: E402

CONFIGS = {
    "default": {},  # Qwen3VLVideoProcessor's class defaults
    "budget": {"size": {"shortest_edge": 4096, "longest_edge": 25165824}},
}


def make_clip(width: int, height: int, seconds: float, fps: int, seed: int) -> bytes:
    """An H.264 MP4 (libx264 `fast`): a pan across a photograph (the load test's make_video)."""
    from service.loadtest.media import make_video

    return make_video(width, height, int(round(seconds * fps)), fps, seed, "photo", x264_preset="fast")


def variant(data: bytes, tag: str) -> bytes:
    """The same video stream remuxed (no re-encode) under another metadata comment: other bytes, other key."""
    import av

    buf = io.BytesIO()
    with av.open(io.BytesIO(data)) as src, av.open(buf, mode="w", format="mp4") as out:
        out.metadata["comment"] = tag
        ins = src.streams.video[0]
        outs = out.add_stream_from_template(ins)
        for pkt in src.demux(ins):
            if pkt.dts is None:  # the demuxer's flush packet
                continue
            pkt.stream = outs
            out.mux(pkt)
    return buf.getvalue()


def write_checkpoint(preset: str, root: Path) -> dict[str, Path]:
    """One checkpoint directory per CONFIGS entry, sharing one weights file; returns name -> directory."""
    import torch
    from transformers import Qwen3VLVisionModel

    from service.presets import preset_vision_config

    torch.manual_seed(0)
    base = root / "weights"
    Qwen3VLVisionModel._from_config(preset_vision_config(preset), dtype=torch.bfloat16).save_pretrained(base)
    dirs = {}
    for name, cfg in CONFIGS.items():
        d = root / name
        d.mkdir()
        for f in base.iterdir():
            (d / f.name).symlink_to(f)
        (d / "video_preprocessor_config.json").write_text(json.dumps(cfg))
        dirs[name] = d
    return dirs


def transformers_one_at_a_time(ckpt: Path, config: dict, clips: list[Path], warmup: Path) -> dict:
    """transformers' loader + processor + tower per clip, one at a time; per-clip seconds, frames, tokens."""
    import torch
    from transformers import Qwen3VLVisionModel
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
    from transformers.video_utils import read_video_pyav

    model = Qwen3VLVisionModel.from_pretrained(ckpt, dtype=torch.bfloat16, attn_implementation="sdpa").cuda().eval()
    proc = Qwen3VLVideoProcessor(**config)

    def one(path: Path) -> tuple[float, int, int, list[int]]:
        t0 = time.perf_counter()
        frames, meta = read_video_pyav(str(path), sample_indices_fn=lambda metadata, **kw: proc.sample_frames(metadata))
        out = proc(videos=[frames], video_metadata=[meta], do_sample_frames=False, return_tensors="pt")
        grid = out["video_grid_thw"].cuda()
        with torch.inference_mode():
            model(out["pixel_values_videos"].cuda().to(torch.bfloat16), grid_thw=grid)
        torch.cuda.synchronize()
        t, h, w = (int(x) for x in out["video_grid_thw"][0])
        return time.perf_counter() - t0, len(frames), t * h * w // 4, [t, h, w]

    one(warmup)
    runs = [one(p) for p in clips]
    del model
    torch.cuda.empty_cache()
    return summarize([(s, f, n) for s, f, n, _ in runs], wall=sum(s for s, _, _, _ in runs),
                     extra={"grid_thw": runs[0][3], "frames_per_clip": runs[0][1]})


def summarize(runs: list[tuple[float, int, int]], wall: float, extra: dict | None = None) -> dict:
    lat = sorted(s for s, _, _ in runs)
    frames, tokens = sum(f for _, f, _ in runs), sum(n for _, _, n in runs)
    return {"clips": len(runs), "wall_s": round(wall, 3), "clips_s": round(len(runs) / wall, 3),
            "frames_s": round(frames / wall, 1), "tokens_s": round(tokens / wall, 1),
            "p50_s": round(lat[len(lat) // 2], 3), "max_s": round(lat[-1], 3), **(extra or {})}


def serve(ckpt: Path, port: int, store: Path, api_processes: int, cache: Path, log: Path,
          device: str = "cuda") -> subprocess.Popen:
    cmd = [sys.executable, "-m", "service", "serve", "--model", str(ckpt), "--device", device, "--store", str(store),
           "--port", str(port), "--api-processes", str(api_processes), "--compile-cache", str(cache),
           "--store-min-residency-s", "0", "--max-queue-tokens", str(1 << 20)]  # (a 30 s clip can be 12k tokens)
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return wait_ready(proc, port, log)


def post(port: int, clip: bytes) -> tuple[float, int, dict]:
    """One video's /encode: (seconds, status, the answer with its Server-Timing phases under "phases")."""
    body = json.dumps({"images": [{"type": "video_url", "video_url": {
        "url": "data:video/mp4;base64," + base64.b64encode(clip).decode()}}]}).encode()
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    t0 = time.perf_counter()
    c.request("POST", "/encode", body, {"Content-Type": "application/json"})
    r = c.getresponse()
    answer = r.read()
    dt = time.perf_counter() - t0
    c.close()
    phases = {}
    for part in (r.getheader("Server-Timing") or "").split(","):
        name, _, dur = part.strip().partition(";dur=")
        if dur:
            phases[name] = float(dur)
    out = json.loads(answer) if r.status == 200 else {"error": answer[:300].decode(errors="replace")}
    return dt, r.status, {**out, "phases": phases}


def service_runs(port: int, clips: list[bytes], concurrency: int) -> dict:
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        res = list(pool.map(lambda c: post(port, c), clips))
    wall = time.perf_counter() - t0
    bad = [(st, a) for _, st, a in res if st != 200]
    ok = [(dt, len(a["items"][0]["frames_indices"]), a["items"][0]["num_tokens"]) for dt, st, a in res if st == 200]
    out = summarize(ok, wall, {"concurrency": concurrency, "status": {str(st): sum(1 for _, s, _ in res if s == st)
                                                                       for st in {s for _, s, _ in res}}})
    phases: dict[str, list[float]] = {}
    for _, st, a in res:
        for k, v in a["phases"].items():
            phases.setdefault(k, []).append(v)
    out["server_timing_p50_ms"] = {k: round(sorted(v)[len(v) // 2], 1) for k, v in phases.items()}
    out["server_timing_ms"] = {k: [round(x, 1) for x in v] for k, v in phases.items()}
    if ok:
        item = next(a for _, st, a in res if st == 200)["items"][0]
        out |= {"grid_thw": item["grid_thw"], "frames_per_clip": len(item["frames_indices"])}
    if bad:
        out["first_error"] = bad[0]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--preset", default="qwen3-vl-4b")
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--fps", type=int, default=30)
    ap.add_argument("--sizes", default="1280x720,1920x1080")
    ap.add_argument("--configs", default="default,budget")
    ap.add_argument("--clips", type=int, default=16, help="distinct clips per size for the loaded phase")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--one-at-a-time", type=int, default=3, help="clips timed one at a time, both sides")
    ap.add_argument("--api-processes", type=int, default=4)
    ap.add_argument("--port", type=int, default=18200)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke test of this script (with --preset tiny)")
    ap.add_argument("--no-transformers", action="store_true", help="the service only (where torchvision is missing)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    import torch
    import transformers

    res = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu", "cpus": os.cpu_count(),
           "torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
           "args": {k: str(v) for k, v in vars(args).items()}, "command": " ".join(sys.argv), "configs": CONFIGS,
           "runs": []}

    def save():
        (args.out / "bench_video.json").write_text(json.dumps(res, indent=1))

    work = Path(tempfile.mkdtemp(prefix="qve-video-"))
    sizes = [tuple(int(x) for x in s.split("x")) for s in args.sizes.split(",")]
    t0 = time.perf_counter()
    with ProcessPoolExecutor(len(sizes)) as pool:
        bases = list(pool.map(make_clip, [w for w, _ in sizes], [h for _, h in sizes], [args.seconds] * len(sizes),
                              [args.fps] * len(sizes), range(len(sizes))))
    clips: dict[str, list[bytes]] = {}
    for (w, h), base in zip(sizes, bases):
        name = f"{w}x{h}"
        # one warm-up clip, --one-at-a-time clips, then --clips for the loaded phase: all distinct
        clips[name] = [variant(base, f"qve-bench {name} {i}") for i in range(1 + args.one_at_a_time + args.clips)]
        assert len(set(clips[name])) == len(clips[name]), "variants must differ (no cache hits)"
        for i, c in enumerate(clips[name][: 1 + args.one_at_a_time]):
            (work / f"{name}-{i}.mp4").write_bytes(c)
        res.setdefault("clips", {})[name] = {"bytes": len(base), "frames": int(round(args.seconds * args.fps))}
    res["clips_made_s"] = round(time.perf_counter() - t0, 1)
    print("clips", res["clips"], f"{res['clips_made_s']} s", flush=True)
    dirs = write_checkpoint(args.preset, work / "ckpt")
    save()

    cache = work / "compile"
    for cname in args.configs.split(","):
        for name in clips if not args.no_transformers else ():
            files = [work / f"{name}-{i}.mp4" for i in range(1 + args.one_at_a_time)]
            try:
                hf = transformers_one_at_a_time(dirs[cname], CONFIGS[cname], files[1:], files[0])
            except Exception as e:  # (recorded; the service's half still runs)
                hf = {"error": f"{type(e).__name__}: {e}", "clips_s": None, "frames_s": None, "tokens_s": None,
                      "p50_s": None}
            res["runs"].append({"config": cname, "size": name, "who": "transformers, one at a time", **hf})
            print(res["runs"][-1], flush=True)
            save()
        store = Path(tempfile.mkdtemp(prefix="qve-video-store-", dir="/dev/shm"))
        srv = serve(dirs[cname], args.port, store, args.api_processes, cache, args.out / f"serve_{cname}.log",
                    args.device)
        try:
            for name, cl in clips.items():
                post(args.port, cl[0])  # warm-up (the video shapes' first step)
                one = service_runs(args.port, cl[1 : 1 + args.one_at_a_time], 1)
                res["runs"].append({"config": cname, "size": name, "who": "service, one at a time", **one})
                print(res["runs"][-1], flush=True)
                loaded = service_runs(args.port, cl[1 + args.one_at_a_time :], args.concurrency)
                res["runs"].append({"config": cname, "size": name, "who": f"service, {args.concurrency} in flight",
                                    **loaded})
                print(res["runs"][-1], flush=True)
                save()
        finally:
            stop(srv, 60)
            shutil.rmtree(store, ignore_errors=True)
    save()
    print_table(res)
    shutil.rmtree(work, ignore_errors=True)
    return 0


def print_table(res: dict) -> None:
    print(f"\n{res['date']}  {res['gpu']}  {res['cpus']} CPUs  torch {res['torch']}  transformers {res['transformers']}")
    print("| config | clip | who | clips/s | sampled frames/s | tokens/s | p50 s | grid_thw | server phases p50 ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in res["runs"]:
        print(f"| {r['config']} | {r['size']} | {r['who']} | {r['clips_s']} | {r['frames_s']} | {r['tokens_s']} | "
              f"{r['p50_s']} | {r.get('grid_thw')} | {r.get('server_timing_p50_ms', '')} |")


if __name__ == "__main__":
    sys.exit(main())
