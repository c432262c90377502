"""The tower at the GPU's speed: every figure against transformers and the bf16 matmul ceiling measured
in the same run, on the same GPU, with the same weights (a preset's seeded random weights).

    python bench/bench_tower.py --out DIR [--preset qwen3-vl-4b] [--sections ceiling,tower,accuracy,fp8,...]
        [--shapes "448 b64,1024 b16,real-world 10"] [--no-by-kernel] [--fp8-gemms qkv] [--fp8-keep 0]

The tower figures of bench/RESULTS.md come from `--sections ceiling,tower,graphs,accuracy,fp8` with
`--shapes "448 b64,1024 b16,real-world 10"` (bench/gpu_tower.sh runs it after the GPU tests).

Needs a CUDA GPU, transformers and (accuracy) scikit-image's photographs. Sections (default: all; written
to DIR/bench_tower.json as they finish; a table is printed last):
  ceiling   bf16 8192^3 matmul TFLOP/s (always measured)
  tower     img/s of transformers' tower (SDPA), ours eager (--no-compile) and ours compiled with the
            attention plan measured at start-up, then with each attention kernel forced (--no-by-kernel:
            not), per --shapes step: 448px batch 1/8/64, 1024px batch 16, 8 mixed sizes, 1080p batch 4,
            the ten real-world photo sizes in one step (`real-world 10`)
  fp8       --dtype fp8: img/s per --fp8-gemms set x --fp8-keep bf16 blocks, as a ratio to bf16 compiled
            (with accuracy: relative L2 and per-token cosine against float32 on the photographs)
  profile, profile1, profile1024   the compiled forward's GPU time by kernel (448px x 64, x 1, 1024px x 16)
  graphs    ms per step of a CUDA-graph replay of the compiled tower, 1..16 images of 448px
  accuracy  bf16 relative L2 error against a float32 transformers run on 8 real photographs:
            transformers bf16, ours eager, ours compiled + graphs (the service's path)
  naive     the naive server: transformers' own image processor (PIL) and its tower, one 448px PNG at a
            time, 64 images (the baseline of the `loop` section)
  writer    the store alone: puts of 448px images' embeddings into /dev/shm, per writer thread count
  loop      step loop + /dev/shm store with pre-decoded 448px images, steps of 64 (per --writers)
  one       one 448px image on an idle step loop: submit -> stored, median of 50, with its parts
            (stage -> run -> D2H done without the store; one store put alone; the commit of a put
            reserved beforehand, which is what the loop waits for after the D2H)
  startup   `python -m service serve` of the preset twice on one compile cache: cold, then warm
            (needs the serving dependencies: fastapi, uvicorn, pydantic-settings, python-multipart)
"""

from __future__ import annotations

import argparse
import io
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "kernels")]  # this checkout\'s service and kernels

from service.engine.batcher import BatchLimits, Batcher  # noqa: E402
from service.config import Settings  # noqa: E402
from service.engine.core import Engine
from service.engine.job import EncodeJob  # noqa: E402
from service.engine.graphs import GraphKey, padded_cu_seqlens  # noqa: E402
from service.media.images import prepare_image  # noqa: E402
from service.media.preprocess import grid_for, smart_resize  # noqa: E402
from service.engine.loader import load_model  # noqa: E402
from service.engine.runner import use_compile_cache  # noqa: E402
from service.metrics import Metrics  # noqa: E402
from service.store.directory import DirectoryStore  # noqa: E402
from service.engine import attention  # noqa: E402
from service.engine.attention import AttentionPlan  # noqa: E402
from service.engine.tower import AttentionKind, TowerBatch, build_batch  # noqa: E402

# the real-world mix's ten photo sizes (width, height)
REAL_WORLD_SIZES = ((640, 480), (800, 600), (1024, 768), (1280, 720), (1920, 1080), (512, 512), (336, 336),
                    (1024, 1024), (480, 640), (1280, 960))
ALL = "ceiling,tower,fp8,profile,profile1,profile1024,graphs,accuracy,naive,writer,loop,one,startup"


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
    """FLOPs of one forward of the tower over images of these patch counts (GEMMs and attention)."""
    h, i, o = spec.hidden_size, spec.intermediate_size, spec.out_hidden_size
    total = 0.0
    for n in patches_per_image:
        total += 2 * n * (768 if frame_only else 1536) * h
        total += spec.depth * (2 * n * (4 * h * h + 2 * h * i) + 4 * n * n * h)
        total += (1 + spec.deepstack_levels) * 2 * (n // 4) * (16 * h * h + 4 * h * o)
    return total


def noise_png(seed: int, w: int, h: int) -> bytes:
    """A distinct w x h PNG: a gradient plus noise."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    base = np.linspace(0, 255, w * h * 3).reshape(h, w, 3)
    arr = np.clip(base + rng.normal(0, 40, (h, w, 3)), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def photos() -> list[bytes]:
    """scikit-image's real photographs (none without scikit-image)."""
    try:
        import skimage
    except ImportError:
        return []
    d = Path(skimage.__file__).parent / "data"
    names = ["astronaut.png", "chelsea.png", "coffee.png", "rocket.jpg", "camera.png", "motorcycle_left.png",
             "hubble_deep_field.jpg", "retina.jpg"]
    return [(d / n).read_bytes() for n in names if (d / n).exists()]


def synthetic_batch(spec, grids, device="cuda", dtype=torch.bfloat16, seed=0, batched=True):
    """A TowerBatch of random patch rows for `grids`, plus the transformers inputs of the same rows."""
    g = torch.Generator(device=device).manual_seed(seed)
    n = sum(t * h * w for t, h, w in grids)
    frames = torch.randn(n, 768, device=device, dtype=dtype, generator=g)
    arr = build_batch(grids, spec)
    tb = TowerBatch(frames, *(torch.from_numpy(arr[k]).to(device) for k in ("pos_hw", "interp_idx", "interp_w", "cu_seqlens")),
                    seq_lens=tuple(t * h * w for t, h, w in grids), attention=None if batched else AttentionKind.VARLEN)
    pv = frames.view(n, 3, 1, 256).expand(-1, -1, 2, -1).reshape(n, 1536).contiguous()  # both frames equal
    return tb, pv, torch.tensor(grids, device=device)


def kernel_profile(tower, batch, top: int = 25) -> list[dict]:
    """Where one forward of `tower` spends its GPU time: the `top` kernels by total time (torch.profiler)."""
    with torch.inference_mode():
        tower(batch)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            tower(batch)
            torch.cuda.synchronize()
    events = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:top]
    return [{"kernel": e.key[:120], "ms": round(e.device_time_total / 1e3, 3), "calls": e.count} for e in events]


def cosine_min(x: torch.Tensor, ref: torch.Tensor) -> float:
    """The least per-token cosine similarity of x to ref ([tokens, width] each)."""
    return float(torch.nn.functional.cosine_similarity(x.float(), ref.float(), dim=1).min())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--preset", default="qwen3-vl-4b")
    ap.add_argument("--sections", default=ALL)
    ap.add_argument("--loop-images", type=int, default=2048)
    ap.add_argument("--no-by-kernel", dest="by_kernel", action="store_false",
                    help="tower section: skip timing each attention kernel forced")
    ap.add_argument("--shapes", default="", help="tower section: only these shapes (comma-separated names)")
    ap.add_argument("--fp8-gemms", default="qkv,fc1,fc2;qkv;qkv,fc2;fc1,fc2",
                    help="fp8 section: the FP8 GEMM sets to measure (';'-separated)")
    ap.add_argument("--fp8-keep", default="none;0;0,1;0,1,2,3",
                    help="fp8 section: the bf16 block sets to measure (';'-separated; 'none' = every block FP8)")
    ap.add_argument("--writers", default="4", help="store writer threads to run the loop with (comma-separated)")
    args = ap.parse_args()
    sections = set(args.sections.split(","))
    args.out.mkdir(parents=True, exist_ok=True)
    from transformers import Qwen3VLVisionModel
    from transformers import __version__ as tf_version

    res: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "command": " ".join(sys.argv),
                 "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "transformers": tf_version,
                 "python": platform.python_version(), "preset": args.preset}
    print(json.dumps(res), flush=True)

    def save():
        (args.out / "bench_tower.json").write_text(json.dumps(res, indent=2))

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    res["ceiling_bf16_tflops"] = round(2 * 8192**3 / cuda_time(lambda: a @ b, reps=10) / 1e12, 1)
    del a, b
    print("ceiling", res["ceiling_bf16_tflops"], flush=True)

    cache = Path(tempfile.mkdtemp(prefix="qve-compile-"))
    settings = Settings(model=args.preset, device="cuda", dtype="bfloat16", max_batch_tokens=16384,
                        max_batch_images=64, pool_slots=3, compile_cache=cache)
    model = load_model(settings)
    spec, tower = model.spec, model.tower
    from service.presets import preset_vision_config

    hf = Qwen3VLVisionModel._from_config(preset_vision_config(args.preset), attn_implementation="sdpa",
                                         dtype=torch.bfloat16).cuda().eval()
    missing = hf.load_state_dict(tower.state_dict(), strict=False)
    assert not missing.missing_keys and not missing.unexpected_keys, missing

    shapes = {"448 b1": [(1, 28, 28)], "448 b8": [(1, 28, 28)] * 8, "448 b64": [(1, 28, 28)] * 64,
              "1024 b16": [(1, 64, 64)] * 16,
              "mixed 8": [(1, 28, 28), (1, 64, 64), (1, 16, 16), (1, 36, 48), (1, 48, 36), (1, 20, 60), (1, 40, 40),
                          (1, 32, 24)],
              "1080p b4": [(1, 68, 120)] * 4,
              # the real-world photo sizes, one of each, as the service resizes them
              "real-world 10": [grid_for(*smart_resize(h, w, model.params), model.params) for w, h in REAL_WORLD_SIZES]}
    shapes = {k: v for k, v in shapes.items() if k in args.shapes.split(",")} if args.shapes else shapes

    def time_tower(fn, grids, batched=True):
        tb, pv, grid = synthetic_batch(spec, grids, batched=batched)
        with torch.inference_mode():
            return cuda_time(lambda: fn(tb, pv, grid), reps=10 if len(grids) >= 16 else 20)

    ours = lambda tb, pv, grid: tower(tb)  # noqa: E731
    theirs = lambda tb, pv, grid: hf(pv, grid_thw=grid)  # noqa: E731

    # ---- eager numbers first (before compile() changes the tower's forward) ----------------------
    rows: dict[str, dict] = {}
    if "tower" in sections:
        for name, grids in shapes.items():
            fl = tower_flops(spec, [t * h * w for t, h, w in grids], frame_only=False)
            t_hf = time_tower(theirs, grids)
            t_eager = time_tower(ours, grids)
            rows[name] = {"images": len(grids), "patches": sum(t * h * w for t, h, w in grids), "tflop": round(fl / 1e12, 3),
                          "hf_ms": round(t_hf * 1e3, 2), "eager_ms": round(t_eager * 1e3, 2),
                          "hf_img_s": round(len(grids) / t_hf, 1), "eager_img_s": round(len(grids) / t_eager, 1)}
            print("tower", name, rows[name], flush=True)
        res["tower"] = rows
        save()

    acc: dict = {}
    blobs = photos()
    prepared = [prepare_image(b, model.params, settings.image_limits) for b in blobs]
    eager_engine = Engine(model, store=None, batcher=None, metrics=Metrics(),
                          options=settings.model_copy(update={"compile": False, "cuda_graphs": False}).runner_options())
    if "accuracy" in sections and blobs:
        from PIL import Image
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        proc = Qwen2VLImageProcessorPil(size={"shortest_edge": 65536, "longest_edge": 16777216}, patch_size=16,
                                        temporal_patch_size=2, merge_size=2, image_mean=[0.5] * 3, image_std=[0.5] * 3)
        inp = proc(images=[Image.open(io.BytesIO(b)) for b in blobs], return_tensors="pt")
        pv, grid = inp["pixel_values"].cuda(), inp["image_grid_thw"].cuda()
        with torch.inference_mode():
            o = hf(pv.bfloat16(), grid_thw=grid)
            hf_bf16 = torch.cat([o.pooler_output, *o.deepstack_features], 1).float().cpu()
            hf.float()
            o32 = hf(pv.float(), grid_thw=grid)
            ref = torch.cat([o32.pooler_output, *o32.deepstack_features], 1).float().cpu()
            hf.to(torch.bfloat16)
        eager_out = torch.cat(eager_engine.encode_sync(prepared)).float()
        rel = lambda x: float((x - ref).norm() / ref.norm())  # noqa: E731
        acc = {"images": len(blobs), "tokens": int(ref.shape[0]), "patches": int(grid.prod(-1).sum()),
               "transformers_bf16": rel(hf_bf16), "ours_eager_bf16": rel(eager_out),
               "cosine_min_transformers_bf16": cosine_min(hf_bf16, ref), "cosine_min_ours_eager_bf16": cosine_min(eager_out, ref)}
        res["accuracy"] = acc
        print("accuracy", acc, flush=True)
        save()

    if "naive" in sections:
        from PIL import Image
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        proc = Qwen2VLImageProcessorPil(size={"shortest_edge": 65536, "longest_edge": 16777216}, patch_size=16,
                                        temporal_patch_size=2, merge_size=2, image_mean=[0.5] * 3, image_std=[0.5] * 3)
        pngs = [noise_png(i, 448, 448) for i in range(64)]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.inference_mode():
            for blob in pngs:
                inp = proc(images=[Image.open(io.BytesIO(blob))], return_tensors="pt")
                o = hf(inp["pixel_values"].cuda().bfloat16(), grid_thw=inp["image_grid_thw"].cuda())
                torch.cat([o.pooler_output, *o.deepstack_features], 1).cpu()
        res["naive"] = {"images": len(pngs), "img_s": round(len(pngs) / (time.perf_counter() - t0), 1)}
        print("naive", res["naive"], flush=True)
        save()

    # ---- the service's engine: compile + CUDA graphs (what `serve` builds) ------------------------
    options = settings.runner_options()
    use_compile_cache(model, options)  # the fresh cache above: compile_s below is a cold compile
    t0 = time.perf_counter()
    engine = Engine(model, store=None, batcher=None, options=options, metrics=Metrics(),
                    store_writers=settings.store_writers)  # the loop sections give it a store
    res["engine_startup"] = {**engine.runner.startup, "wall_s": round(time.perf_counter() - t0, 2),
                             "attention": tower.attention_plan.describe(), "attention_ms": tower.attention_plan.ms}
    print("engine startup", res["engine_startup"], flush=True)
    save()

    if "accuracy" in sections and blobs:
        out = torch.cat(engine.encode_sync(prepared)).float()
        acc["ours_compiled_bf16"] = float((out - ref).norm() / ref.norm())
        # the same photos one at a time: every step then replays a CUDA graph
        one = torch.cat([engine.encode_sync([p])[0] for p in prepared]).float()
        acc["ours_graphs_bf16"] = float((one - ref).norm() / ref.norm())
        acc["cosine_min_ours_graphs_bf16"] = cosine_min(one, ref)
        print("accuracy", acc, flush=True)
        save()

    if "tower" in sections:
        plan = tower.attention_plan
        for name, grids in shapes.items():
            r = rows[name]
            tower.attention_plan = plan
            t_c = time_tower(ours, grids)
            r["compiled_ms"], r["compiled_img_s"] = round(t_c * 1e3, 2), round(len(grids) / t_c, 1)
            r["compiled_tflops"] = round(r["tflop"] / t_c, 1)
            r["compiled_pct_ceiling"] = round(100 * r["tflop"] / t_c / res["ceiling_bf16_tflops"], 1)
            # every attention kernel that runs here, forced, for the same step (the plan's pick is above)
            equal = len(set(grids)) == 1 and len(grids) > 1
            by_kernel = {}
            for kind in ((AttentionKind.BATCHED, AttentionKind.VARLEN) if equal else (AttentionKind.VARLEN,)) * args.by_kernel:
                for backend in attention.available(kind, tower.frame_proj_weight.device):
                    tower.attention_plan = AttentionPlan.forced(backend)
                    t_b = time_tower(ours, grids, batched=kind == AttentionKind.BATCHED)
                    by_kernel[f"{kind.value} {backend.value}"] = round(len(grids) / t_b, 1)
            r["compiled_img_s_by_kernel"] = by_kernel
            print("tower compiled", name, r, flush=True)
        tower.attention_plan = plan
        save()

    if "fp8" in sections:
        # --dtype fp8: one FP8 tower, compiled once; the bf16 block sets switch by re-quantising (the
        # compiled block takes its weights as inputs, so nothing compiles again)
        t0 = time.perf_counter()
        a8 = torch.randn(8192, 8192, device="cuda").to(torch.float8_e4m3fn)
        one_s = torch.ones(1, device="cuda")
        res["ceiling_fp8_tflops"] = round(2 * 8192**3 / cuda_time(
            lambda: torch._scaled_mm(a8, a8.t(), scale_a=one_s, scale_b=one_s, out_dtype=torch.bfloat16,
                                     use_fast_accum=True), reps=10) / 1e12, 1)
        del a8
        # No CUDA graphs here: they would keep reading the weights of the quantisation they were captured with.
        s8 = settings.model_copy(update={"dtype": "fp8", "cuda_graphs": False})
        m8 = load_model(s8)
        e8 = Engine(m8, store=None, batcher=None, metrics=Metrics(), options=s8.runner_options())
        res["fp8_startup"] = {**e8.runner.startup, "wall_s": round(time.perf_counter() - t0, 2)}
        print("fp8 ceiling", res["ceiling_fp8_tflops"], "startup", res["fp8_startup"], flush=True)
        ours8 = lambda tb, pv, grid: m8.tower(tb)  # noqa: E731
        res["fp8"] = []
        for gemms_s in args.fp8_gemms.split(";"):
            for keep_s in args.fp8_keep.split(";"):
                gemms = tuple(gemms_s.split(","))
                keep = () if keep_s == "none" else tuple(int(i) for i in keep_s.split(","))
                m8.tower.fuse_patch_embed()
                m8.tower.quantize_fp8(keep, gemms)
                row = {"gemms": list(gemms), "bf16_blocks": list(keep), "fp8_blocks": len(m8.tower.fp8_blocks)}
                if "accuracy" in sections and blobs:
                    out8 = torch.cat([e8.encode_sync([p])[0] for p in prepared]).float()  # compiled, no graphs
                    row["rel_l2_vs_f32"] = float((out8 - ref).norm() / ref.norm())
                    row["cosine_min_vs_f32"] = cosine_min(out8, ref)
                    row["cosine_mean_vs_f32"] = float(torch.nn.functional.cosine_similarity(out8, ref, dim=1).mean())
                for name, grids in shapes.items():
                    t8 = time_tower(ours8, grids)
                    row[f"{name} img_s"] = round(len(grids) / t8, 1)
                    if name in rows and "compiled_ms" in rows[name]:
                        row[f"{name} vs bf16"] = round(rows[name]["compiled_ms"] / 1e3 / t8, 3)
                if keep_s == args.fp8_keep.split(";")[0] and "448 b64" in shapes:  # where an FP8 forward's time goes
                    row["profile_448_b64"] = kernel_profile(m8.tower, synthetic_batch(spec, shapes["448 b64"])[0], 12)
                res["fp8"].append(row)
                print("fp8", row, flush=True)
                save()
        del e8, m8

    for prof_name, shape in (("profile", "448 b64"), ("profile1", "448 b1"), ("profile1024", "1024 b16")):
        if prof_name not in sections:  # where a compiled forward spends its GPU time, by kernel
            continue
        rows_p = kernel_profile(tower, synthetic_batch(spec, shapes[shape])[0])
        res[f"{prof_name}_{shape.replace(' ', '_')}"] = rows_p
        for r in rows_p:
            print(prof_name, r, flush=True)
        save()

    if "graphs" in sections:
        runner = engine.runner
        d, grows = runner.dev, []
        for k in (1, 2, 4, 8, 12, 16):
            n = 784 * k
            bucket = runner.graphs.bucket_for(n)
            if bucket is None:
                break
            arr = build_batch([(1, 28, 28)] * k, spec)
            runner.patches[:n].normal_()
            for nm in ("pos_hw", "interp_idx", "interp_w"):
                getattr(d, nm)[:n].copy_(torch.from_numpy(arr[nm]))
            # (the image layout's prefix: the buffer also holds a video step's groups after it)
            d.cu_seqlens[: runner.cu_length].copy_(
                torch.tensor(padded_cu_seqlens([784] * k, bucket, runner.cu_length), dtype=torch.int32))
            key = runner.graphs.graph_for((784,) * k)  # what the step loop replays: the equal-step graph
            with torch.inference_mode(), torch.cuda.stream(runner.compute_stream):
                t_g = cuda_time(lambda: runner.graphs.run(key), reps=50)
                t_v = cuda_time(lambda: runner.graphs.run(GraphKey.bucket(bucket)), reps=50)  # the varlen graph of that size
            grows.append({"images": k, "patches": n, "bucket": bucket, "graph": [key.patches, key.images],
                          "graph_ms": round(t_g * 1e3, 3), "img_s": round(k / t_g, 1),
                          "varlen_graph_ms": round(t_v * 1e3, 3)})
            print("graph", grows[-1], flush=True)
        res["graphs"] = grows
        save()

    writers = [int(w) for w in args.writers.split(",")]
    if "writer" in sections:  # the store alone: can it take what the tower produces?
        import concurrent.futures

        rows64 = torch.randn(64 * 196, spec.out_width, dtype=torch.bfloat16).pin_memory()
        res["writer"] = []
        for nw in sorted(set(writers + [1, 4, 8])):
            with tempfile.TemporaryDirectory(dir="/dev/shm") as sd, \
                    concurrent.futures.ThreadPoolExecutor(nw) as pool:
                store = DirectoryStore(Path(sd), 64 * 1024**3, model.model_id, spec.out_hidden_size, spec.deepstack_levels)
                t0 = time.perf_counter()
                for r in range(8):
                    list(pool.map(lambda i: store.put(f"w{r}_{i}", rows64[i * 196:(i + 1) * 196], (1, 28, 28)),
                                  range(64)))
                dt = time.perf_counter() - t0
                store.close()
            res["writer"].append({"threads": nw, "img_s": round(512 / dt, 1),
                                  "gb_s": round(512 * 196 * spec.out_width * 2 / dt / 1e9, 2)})
            print("writer", res["writer"][-1], flush=True)
        save()

    if "loop" in sections or "one" in sections:
        import concurrent.futures

        imgs = [prepare_image(noise_png(10_000 + i, 448, 448), model.params, settings.image_limits) for i in range(64)]
        with tempfile.TemporaryDirectory(dir="/dev/shm") as sd:
            store = DirectoryStore(Path(sd), 64 * 1024**3, model.model_id, spec.out_hidden_size, spec.deepstack_levels)
            if "one" in sections:  # the parts of a lone image's step, measured apart first
                parts = {"stage_run_d2h": [], "store_put": [], "store_commit_after_reserve": []}
                for i in range(60):
                    t0 = time.perf_counter()
                    rows1 = engine.encode_sync([imgs[i % 64]])[0]
                    parts["stage_run_d2h"].append(time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    store.put(f"part{i}", rows1, (1, 28, 28))
                    parts["store_put"].append(time.perf_counter() - t0)
                    r = store.reserve(f"part_r{i}", tuple(rows1.shape), rows1.dtype, (1, 28, 28))
                    t0 = time.perf_counter()
                    store.commit(r, rows1)
                    parts["store_commit_after_reserve"].append(time.perf_counter() - t0)
                res["one_image_parts_ms"] = {k: round(1e3 * statistics.median(v[10:]), 3) for k, v in parts.items()}
                print("one image parts", res["one_image_parts_ms"], flush=True)
            batcher = Batcher(BatchLimits(16384, 64, settings.max_wait_ms / 1000, 100_000))
            engine.store, engine.batcher = store, batcher
            engine.start()
            try:
                if "one" in sections:
                    lat = []
                    for i in range(60):
                        key = f"one{i}"
                        t0 = time.perf_counter()
                        tk = batcher.submit(key, EncodeJob(key, imgs[i % 64]), imgs[i % 64].num_tokens)
                        tk.future.result(timeout=60)
                        lat.append(time.perf_counter() - t0)
                    lat = lat[10:]
                    res["one_image_step"] = {"p50_ms": round(1e3 * statistics.median(lat), 3),
                                             "p90_ms": round(1e3 * sorted(lat)[int(0.9 * len(lat))], 3), "n": len(lat)}
                    print("one image step", res["one_image_step"], flush=True)
                    res["one_image_phases_ms"] = one_image_phases(engine, batcher, imgs)
                    print("one image phases", res["one_image_phases_ms"], flush=True)
                    save()
                if "loop" in sections:
                    res["loop"] = []
                    # Two passes, both recorded: single passes of the loop vary by a fifth and more between
                    # machines of one kind, and between one run's two passes.
                    t0 = time.perf_counter()
                    warm = [batcher.submit(f"warm{i}", EncodeJob(f"warm{i}", imgs[i % 64]), imgs[i % 64].num_tokens)
                            for i in range(args.loop_images)]
                    for tk in warm:
                        tk.future.result(timeout=600)
                    res["loop_first_pass_img_s"] = round(args.loop_images / (time.perf_counter() - t0), 1)
                    print("loop first pass", res["loop_first_pass_img_s"], flush=True)
                    for nw in writers:
                        engine.writer._put_pool.shutdown()
                        engine.writer._put_pool = concurrent.futures.ThreadPoolExecutor(nw, thread_name_prefix="store-put")
                        n = args.loop_images
                        steps0 = batcher.stats.batches
                        t0 = time.perf_counter()
                        tickets = [batcher.submit(f"k{nw}_{i}", EncodeJob(f"k{nw}_{i}", imgs[i % 64]), imgs[i % 64].num_tokens)
                                   for i in range(n)]
                        for tk in tickets:
                            tk.future.result(timeout=600)
                        dt = time.perf_counter() - t0
                        res["loop"].append({"writers": nw, "images": n, "img_s": round(n / dt, 1),
                                            "steps": batcher.stats.batches - steps0,
                                            "fence_waits": engine.runner.pool.stats.waits_blocked})
                        print("loop", res["loop"][-1], flush=True)
                        save()
            finally:
                batcher.close()
                engine.join(60)

    if "startup" in sections:
        del hf, engine, eager_engine, model, tower
        torch.cuda.empty_cache()
        res["startup"] = []
        scache = Path(tempfile.mkdtemp(prefix="qve-serve-compile-"))
        for run in ("cold", "warm"):
            res["startup"].append(serve_startup(args.preset, scache, run, args.out / f"serve_{run}.log"))
            print("startup", res["startup"][-1], flush=True)
            save()

    print_table(res)
    save()
    return 0


def one_image_phases(engine, batcher, imgs, n: int = 60) -> dict:
    """Where a lone image's step spends its time: each phase's start and end (ms after submit, medians),
    from wrappers around the loop's own calls. The writer's device wait ends where `commit` starts."""
    import service.store.directory as store_module

    marks: dict[str, list] = {}

    def wrap(obj, name, tag, keep=lambda r: True):
        orig = getattr(obj, name)

        def timed(*a, **k):
            t = time.perf_counter()
            r = orig(*a, **k)
            if keep(r):
                marks.setdefault(tag, []).append((t, time.perf_counter()))
            return r
        setattr(obj, name, timed)
        return orig

    runner, writer = engine.runner, engine.writer
    # `runner.stage` is the block that holds the slot: its parts are the fence (acquire) and the staging proper.
    saved = [(batcher, "next_batch", wrap(batcher, "next_batch", "batch_closed", keep=lambda r: r is not None)),
             (runner.pool, "acquire", wrap(runner.pool, "acquire", "acquire")),
             (runner, "_stage_into", wrap(runner, "_stage_into", "stage")), (runner, "run", wrap(runner, "run", "launch")),
             (writer, "_reserve", wrap(writer, "_reserve", "reserve")), (writer, "_commit", wrap(writer, "_commit", "commit")),
             (runner, "_patchify_cuda", wrap(runner, "_patchify_cuda", "patchify")),
             (runner.graphs, "run", wrap(runner.graphs, "run", "replay")),
             (runner.outputs, "acquire", wrap(runner.outputs, "acquire", "out_get")),
             (store_module, "_write_ec_file", wrap(store_module, "_write_ec_file", "write"))]
    rows = []
    try:
        for i in range(n):
            marks.clear()
            key = f"phase{i}"
            t0 = time.perf_counter()
            batcher.submit(key, EncodeJob(key, imgs[i % 64]), imgs[i % 64].num_tokens).future.result(timeout=60)
            t1 = time.perf_counter()
            time.sleep(0.005)  # let the writer return from its last call before the marks are read
            row = {"answered": t1 - t0}
            for tag, spans in marks.items():
                a, b = spans[0]
                row[f"{tag}_start"], row[f"{tag}_end"] = a - t0, b - t0
            rows.append(row)
    finally:
        for obj, name, orig in saved:
            setattr(obj, name, orig)
    rows = rows[10:]
    return {k: round(1e3 * statistics.median(r[k] for r in rows), 3) for k in rows[0]}


def serve_startup(preset: str, cache: Path, run: str, log_path: Path) -> dict:
    """Seconds from `python -m service serve` to the first /ready 200, and the phases /ready reports."""
    import httpx

    port = 18000 + (1 if run == "warm" else 0)
    with tempfile.TemporaryDirectory(dir="/dev/shm") as sd, open(log_path, "w") as log:
        t0 = time.perf_counter()
        srv = subprocess.Popen([sys.executable, "-m", "service", "serve", "--model", preset, "--device", "cuda",
                                "--store", sd, "--port", str(port), "--compile-cache", str(cache)],
                               cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.time() + 300
            while time.time() < deadline and srv.poll() is None:
                try:
                    r = httpx.get(f"http://127.0.0.1:{port}/ready", timeout=1)
                    if r.status_code == 200:
                        return {"run": run, "to_ready_s": round(time.perf_counter() - t0, 1), **r.json()}
                except httpx.TransportError:
                    pass
                time.sleep(0.25)
            return {"run": run, "error": f"not ready (exit code {srv.poll()}); see {log_path.name}"}
        finally:
            srv.terminate()
            try:
                srv.wait(60)
            except subprocess.TimeoutExpired:
                srv.kill()


def print_table(res: dict) -> None:
    print(f"\n{res['date']}  {res['gpu']}  torch {res['torch']}  transformers {res['transformers']}  preset {res['preset']}")
    print(f"bf16 matmul ceiling: {res['ceiling_bf16_tflops']} TFLOP/s")
    if "tower" in res:
        print("step       | transformers img/s | ours eager img/s | ours compiled img/s (TFLOP/s, % ceiling) | SDPA-batched img/s")
        for name, r in res["tower"].items():
            print(f"{name:10s} | {r['hf_img_s']:18.1f} | {r['eager_img_s']:16.1f} | {r.get('compiled_img_s', float('nan')):8.1f} "
                  f"({r.get('compiled_tflops', float('nan'))}, {r.get('compiled_pct_ceiling', float('nan'))}%) "
                  f"| {r.get('compiled_sdpa_img_s', '')}")
    for g in res.get("graphs", []):
        print(f"graph replay {g['images']:2d} images ({g['bucket']} patches): {g['graph_ms']} ms ({g['img_s']} img/s), "
              f"varlen graph {g.get('varlen_graph_ms')} ms")
    if "accuracy" in res:
        print("accuracy (rel L2 vs float32 transformers):", {k: v for k, v in res["accuracy"].items()})
    for k in ("engine_startup", "naive", "one_image_parts_ms", "one_image_step", "writer", "loop"):
        if k in res:
            print(k, res[k])
    for s in res.get("startup", []):
        print("serve start-up", {k: s.get(k) for k in ("run", "to_ready_s", "startup_s", "error")})


if __name__ == "__main__":
    sys.exit(main())
