"""GPU benchmark: this service against transformers, measured in the same run on the same GPU.

    python bench/bench_gpu.py --out DIR [--preset qwen3-vl-4b] [--images 512] [--quick]

Sections (each a ratio against a baseline measured here, plus absolute numbers):
  ceiling     bf16 8192^3 matmul TFLOP/s (the roof for the tower's matmuls)
  accuracy    ours vs transformers on real photographs, bf16, both against a float32 transformers run
  tower       tower-only img/s at batch 1 / 8 / 64 of 448x448: transformers (sdpa) vs ours
  e2e_hf      the naive server: HF PIL processor + transformers tower, one image at a time
  e2e_engine  our batcher + step loop + /dev/shm store, images already decoded (the GPU path)
  e2e_http    our real server process under 64 concurrent HTTP clients (decode in worker processes)
Writes DIR/bench_gpu.json and prints a table.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from service.engine.batcher import BatchLimits, Batcher  # noqa: E402
from service.config import Settings  # noqa: E402
from service.engine.core import Engine
from service.engine.job import EncodeJob  # noqa: E402
from service.media.images import prepare_image  # noqa: E402
from service.engine.loader import load_model  # noqa: E402
from service.engine.runner import use_compile_cache  # noqa: E402
from service.metrics import Metrics  # noqa: E402
from service.store.directory import EmbeddingStore  # noqa: E402
from service.engine.tower import TowerBatch, build_batch  # noqa: E402


def cuda_time(fn, reps=20, warmup=3) -> float:
    """Median seconds of fn() measured with CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1000)
    return statistics.median(times)


def tower_flops(spec, patches_per_image: list[int], frame_only: bool) -> float:
    h, i, o = spec.hidden_size, spec.intermediate_size, spec.out_hidden_size
    total = 0.0
    for n in patches_per_image:
        total += 2 * n * (768 if frame_only else 1536) * h
        total += spec.depth * (2 * n * (4 * h * h + 2 * h * i) + 4 * n * n * h)
        total += (1 + spec.deepstack_levels) * 2 * (n // 4) * (16 * h * h + 4 * h * o)
    return total


def noise_png(seed: int, w: int, h: int) -> bytes:
    rng = np.random.default_rng(seed)
    base = np.linspace(0, 255, w * h * 3).reshape(h, w, 3)
    arr = np.clip(base + rng.normal(0, 40, (h, w, 3)), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def photos() -> list[bytes]:
    try:
        import skimage
    except ImportError:
        return []
    d = Path(skimage.__file__).parent / "data"
    names = ["astronaut.png", "chelsea.png", "coffee.png", "rocket.jpg", "camera.png", "motorcycle_left.png",
             "hubble_deep_field.jpg", "retina.jpg"]
    return [(d / n).read_bytes() for n in names if (d / n).exists()]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--preset", default="qwen3-vl-4b")
    ap.add_argument("--images", type=int, default=512)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--skip-http", action="store_true")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    from transformers import Qwen3VLVisionModel
    from transformers import __version__ as tf_version
    try:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    except ImportError:  # older transformers: the plain class is the PIL one
        from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor as Qwen2VLImageProcessorPil

    res: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "command": " ".join(sys.argv),
                 "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "transformers": tf_version,
                 "python": platform.python_version(), "preset": args.preset}
    try:
        import cupy

        res["cupy"] = cupy.__version__
    except ImportError:
        res["cupy"] = None
    print(json.dumps(res), flush=True)

    def save():
        (args.out / "bench_gpu.json").write_text(json.dumps(res, indent=2))

    # ---- ceiling -------------------------------------------------------------------------------
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    t = cuda_time(lambda: a @ b, reps=10)
    res["ceiling_bf16_tflops"] = round(2 * 8192**3 / t / 1e12, 1)
    del a, b
    print("ceiling", res["ceiling_bf16_tflops"], flush=True)

    # ---- models: ours, and transformers' with the very same weights ------------------------------
    settings = Settings(model=args.preset, device="cuda", dtype="bfloat16", max_batch_tokens=16384,
                        max_batch_images=64, pool_slots=3)
    model = load_model(settings)
    spec = model.spec
    from service.presets import preset_vision_config

    hf = Qwen3VLVisionModel._from_config(preset_vision_config(args.preset), attn_implementation="sdpa",
                                         dtype=torch.bfloat16).cuda().eval()
    missing = hf.load_state_dict(model.tower.state_dict(), strict=False)
    assert not missing.missing_keys and not missing.unexpected_keys, missing
    proc = Qwen2VLImageProcessorPil(size={"shortest_edge": 65536, "longest_edge": 16777216}, patch_size=16,
                                    temporal_patch_size=2, merge_size=2, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    options = settings.runner_options()
    use_compile_cache(model, options)
    t0 = time.perf_counter()
    engine = Engine(model, store=None, batcher=None, options=options, metrics=Metrics(),
                    store_writers=settings.store_writers)  # the loop below gets a store
    res["graph_capture_s"] = round(time.perf_counter() - t0, 1)
    res["graph_buckets"] = engine.runner.buckets
    limits = settings.image_limits

    # ---- accuracy at real size on real photographs ------------------------------------------------
    blobs = photos()
    if blobs:
        prepared = [prepare_image(b, model.params, limits) for b in blobs]
        with torch.no_grad():
            ours = torch.cat(engine.encode_sync(prepared)).float()
            pil = [Image.open(io.BytesIO(b)) for b in blobs]
            inp = proc(images=pil, return_tensors="pt")
            pv, grid = inp["pixel_values"].cuda(), inp["image_grid_thw"].cuda()
            o = hf(pv.bfloat16(), grid_thw=grid)
            theirs = torch.cat([o.pooler_output, *o.deepstack_features], 1).float().cpu()
            hf32 = hf.float()
            o32 = hf32(pv.float(), grid_thw=grid)
            ref = torch.cat([o32.pooler_output, *o32.deepstack_features], 1).float().cpu()
            hf.to(torch.bfloat16)
        res["accuracy"] = {
            "images": len(blobs), "tokens": int(ref.shape[0]),
            "ours_bf16_rel_err_vs_fp32": float((ours - ref).norm() / ref.norm()),
            "transformers_bf16_rel_err_vs_fp32": float((theirs - ref).norm() / ref.norm()),
        }
        print("accuracy", res["accuracy"], flush=True)
        save()

    # ---- tower only -----------------------------------------------------------------------------
    res["tower"] = []
    side = 448
    g = side // 16
    for bsz in ([1, 8] if args.quick else [1, 8, 64]):
        grids = [(1, g, g)] * bsz
        n = g * g * bsz
        frames = torch.randn(n, 768, device="cuda", dtype=torch.bfloat16)
        pv = frames.view(n, 3, 1, 256).expand(-1, -1, 2, -1).reshape(n, 1536).contiguous()
        grid_t = torch.tensor(grids, device="cuda")
        arr = build_batch(grids, spec)
        tb = TowerBatch(frames, *(torch.from_numpy(arr[k]).cuda() for k in ("pos_hw", "interp_idx", "interp_w", "cu_seqlens")),
                        seq_lens=tuple([g * g] * bsz))
        with torch.inference_mode():
            t_hf = cuda_time(lambda: hf(pv, grid_thw=grid_t))
            t_ours = cuda_time(lambda: model.tower(tb))
        fl = tower_flops(spec, [g * g] * bsz, frame_only=False)
        row = {"batch": bsz, "side": side, "hf_img_s": round(bsz / t_hf, 1), "ours_img_s": round(bsz / t_ours, 1),
               "speedup": round(t_hf / t_ours, 2), "hf_ms": round(t_hf * 1e3, 2), "ours_ms": round(t_ours * 1e3, 2),
               "ours_tflops": round(fl / t_ours / 1e12, 1), "hf_tflops": round(fl / t_hf / 1e12, 1)}
        res["tower"].append(row)
        print("tower", row, flush=True)
        save()

    # ---- end to end: the naive transformers server (processor + tower, one image at a time) ----------
    n_hf = 32 if args.quick else 64
    pngs = [noise_png(i, side, side) for i in range(n_hf)]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.inference_mode():
        for blob in pngs:
            inp = proc(images=[Image.open(io.BytesIO(blob))], return_tensors="pt")
            o = hf(inp["pixel_values"].cuda().bfloat16(), grid_thw=inp["image_grid_thw"].cuda())
            torch.cat([o.pooler_output, *o.deepstack_features], 1).cpu()
    dt = time.perf_counter() - t0
    res["e2e_hf"] = {"images": n_hf, "img_s": round(n_hf / dt, 1)}
    print("e2e_hf", res["e2e_hf"], flush=True)
    save()

    # ---- end to end: our batcher + step loop + store (images pre-decoded) ------------------------------
    n = args.images // (4 if args.quick else 1)
    prepared = [prepare_image(noise_png(10_000 + i, side, side), model.params, limits) for i in range(64)]
    with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as d:
        store = EmbeddingStore(Path(d), 64 * 1024**3, model.model_id, spec.out_hidden_size, spec.deepstack_levels)
        batcher = Batcher(BatchLimits(16384, 64, 0.002, 100_000))
        eng = engine  # reuse its captured graphs; give it the store and queue it runs against
        eng.store, eng.batcher = store, batcher
        eng.encode_sync(prepared[:8])
        eng.start()
        t0 = time.perf_counter()
        tickets = [batcher.submit(f"k{i}", EncodeJob(f"k{i}", prepared[i % 64]), prepared[i % 64].num_tokens) for i in range(n)]
        for tk in tickets:
            tk.future.result(timeout=600)
        dt = time.perf_counter() - t0
        batcher.close()
        eng.join(30)
        st = batcher.stats
        res["e2e_engine"] = {"images": n, "img_s": round(n / dt, 1), "steps": st.batches,
                             "fence_waits": eng.runner.pool.stats.waits_blocked, "store_mb": round(store.bytes_used / 1e6, 1)}
    print("e2e_engine", res["e2e_engine"], flush=True)
    save()

    # ---- end to end over HTTP -------------------------------------------------------------------
    if not args.skip_http:
        del hf, model, engine, eng
        torch.cuda.empty_cache()
        port = 18080
        with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as d:
            log = open(args.out / "server.log", "w")
            srv = subprocess.Popen([sys.executable, "-m", "service", "serve", "--model", args.preset, "--device", "cuda",
                                    "--store", d, "--port", str(port), "--decode-workers", "12", "--max-wait-ms", "3"],
                                   cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
            try:
                import httpx

                deadline = time.time() + 300
                while time.time() < deadline:
                    try:
                        if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=1).status_code == 200:
                            break
                    except httpx.TransportError:
                        time.sleep(0.5)
                lt = subprocess.run([sys.executable, "-m", "service", "loadtest", "--url", f"http://127.0.0.1:{port}",
                                     "--concurrency", "64", "--requests", str(n), "--sizes", f"{side}x{side}", "--unique",
                                     "--out", str((args.out / "loadtest.json").resolve())], cwd=ROOT,
                                    capture_output=True, text=True, timeout=400)
                print(lt.stdout[-3000:], lt.stderr[-2000:], flush=True)
                if (args.out / "loadtest.json").exists():
                    res["e2e_http"] = json.loads((args.out / "loadtest.json").read_text())
            finally:
                srv.terminate()
                srv.wait(60)
        save()

    # ---- table ------------------------------------------------------------------------------------
    print(f"\n{res['date']}  {res['gpu']}  torch {res['torch']}  transformers {res['transformers']}  cupy {res['cupy']}")
    print(f"bf16 matmul ceiling: {res['ceiling_bf16_tflops']} TFLOP/s   preset {args.preset}")
    if "accuracy" in res:
        a = res["accuracy"]
        print(f"accuracy ({a['images']} photos, {a['tokens']} tokens): rel err vs fp32  ours {a['ours_bf16_rel_err_vs_fp32']:.2e}"
              f"  transformers {a['transformers_bf16_rel_err_vs_fp32']:.2e}")
    print("tower 448px (eager)  batch | transformers img/s | ours img/s | speedup | ours TFLOP/s")
    for r in res["tower"]:
        print(f"                     {r['batch']:5d} | {r['hf_img_s']:18.1f} | {r['ours_img_s']:10.1f} | {r['speedup']:7.2f} "
              f"| {r['ours_tflops']:.1f}")
    print(f"e2e naive processor+tower (1 at a time): {res['e2e_hf']['img_s']} img/s")
    print(f"e2e our engine (pre-decoded):            {res['e2e_engine']['img_s']} img/s  ({res['e2e_engine']['steps']} steps)")
    if "e2e_http" in res:
        print(f"e2e our HTTP server (64 clients):        {res['e2e_http'].get('summary', {}).get('images_per_s')} img/s")
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
