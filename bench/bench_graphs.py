"""CUDA-graph replay vs the eager tower, per bucket, with a consistent padded layout staged (a CUDA GPU).

    python bench/bench_graphs.py --out DIR [--preset qwen3-vl-4b] [--max-images 64] [--images 1,2,...] [--exact-images N]

For each step of k 448x448 images (--images, default 1,2,3,4,6,7,8,16,64): the eager tower on exactly
k*784 patches, the replay of the padded varlen graph of its bucket and of the equal-step graph
(batched attention) where there is one, each with its relative difference to the eager output, and the
host time of launching the eager tower. Prints a row per step as it goes, then a table (ms per step,
img/s); writes DIR/bench_graphs_<max-images>.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[1] / "kernels")]
from bench.bench_tower import cuda_time  # noqa: E402
from service.config import Settings  # noqa: E402
from service.engine.graphs import GraphKey, padded_cu_seqlens  # noqa: E402
from service.engine.loader import load_model  # noqa: E402
from service.engine.runner import Runner, use_compile_cache  # noqa: E402
from service.engine.tower import TowerBatch, build_batch  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--preset", default="qwen3-vl-4b")
    ap.add_argument("--max-images", type=int, default=64)
    ap.add_argument("--images", default="1,2,3,4,6,7,8,16,64", help="step sizes to time (comma-separated)")
    ap.add_argument("--exact-images", type=int, default=None, help="--graph-exact-images of the runner (default: the "
                    "service's); above it, equal steps replay their bucket's varlen graph")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    more = {} if args.exact_images is None else {"graph_exact_images": args.exact_images}
    s = Settings(model=args.preset, device="cuda", dtype="bfloat16", max_batch_images=args.max_images, **more)
    model = load_model(s)
    options = s.runner_options()
    use_compile_cache(model, options)
    t0 = time.perf_counter()
    eng = Runner(model, options)
    capture_s = time.perf_counter() - t0
    spec, d = model.spec, eng.dev
    rows = []
    for k in (int(x) for x in args.images.split(",")):
        if k > args.max_images:
            break
        grids = [(1, 28, 28)] * k
        n = 784 * k
        arr = build_batch(grids, spec)
        bucket = eng.graphs.bucket_for(n) or n  # above the largest graph: eager only
        # stage exactly what the step loop would: real rows, padded cu_seqlens for the bucket
        eng.patches[:n].normal_()
        for name in ("pos_hw", "interp_idx", "interp_w"):
            getattr(d, name)[:n].copy_(torch.from_numpy(arr[name]))
        cu = padded_cu_seqlens([784] * k, bucket, eng.cu_length)
        d.cu_seqlens[: len(cu)].copy_(torch.tensor(cu, dtype=torch.int32))
        eager = TowerBatch(eng.patches[:n], d.pos_hw[:n], d.interp_idx[:n], d.interp_w[:n],
                           torch.from_numpy(arr["cu_seqlens"]).cuda(), tuple([784] * k))
        with torch.inference_mode(), torch.cuda.stream(eng.compute_stream):
            t_e = cuda_time(lambda: model.tower(eager))
            graphed = bucket in eng.graphs.buckets  # the padded varlen graph (equal steps: bench_tower.py)
            t_g = cuda_time(lambda: eng.graphs.run(GraphKey.bucket(bucket))) if graphed else float("nan")
            eq = GraphKey.equal(k, 784)  # batched attention, unpadded (--graph-exact-images)
            t_q = cuda_time(lambda: eng.graphs.run(eq)) if eq in eng.graphs.equal else float("nan")
            a = model.tower(eager)
            b = eng.graphs.run(GraphKey.bucket(bucket))[: n // 4] if graphed else a
            rel = ((a.float() - b.float()).norm() / a.float().norm()).item()
            c = eng.graphs.run(eq)[: n // 4] if eq in eng.graphs.equal else a
            rel_eq = ((a.float() - c.float()).norm() / a.float().norm()).item()
        # host cost of launching the eager tower (what holds the GIL)
        torch.cuda.synchronize()
        h0 = time.perf_counter()
        with torch.inference_mode(), torch.cuda.stream(eng.compute_stream):
            model.tower(eager)
        host_eager = time.perf_counter() - h0
        torch.cuda.synchronize()
        row = {"images": k, "patches": n, "bucket": bucket, "eager_ms": round(t_e * 1e3, 2), "graph_ms": round(t_g * 1e3, 2),
               "equal_graph_ms": round(t_q * 1e3, 2),
               "eager_img_s": round(k / t_e, 1), "graph_img_s": round(k / t_g, 1), "eager_host_launch_ms": round(host_eager * 1e3, 2),
               "rel_diff": rel, "equal_rel_diff": rel_eq}
        rows.append(row)
        print(row, flush=True)
    res = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "gpu": torch.cuda.get_device_name(0),
           "torch": torch.__version__, "preset": args.preset, "max_images": args.max_images, "cu_length": eng.cu_length,
           "capture_s": round(capture_s, 1), "rows": rows, "command": " ".join(sys.argv)}
    (args.out / f"bench_graphs_{args.max_images}.json").write_text(json.dumps(res, indent=2))
    print("images | bucket | eager ms (host launch ms) | graph ms | equal graph ms | eager img/s | graph img/s")
    for r in rows:
        print(f"{r['images']:6d} | {r['bucket']:6d} | {r['eager_ms']:8.2f} ({r['eager_host_launch_ms']:.2f}) | {r['graph_ms']:8.2f} "
              f"| {r['equal_graph_ms']:8.2f} | {r['eager_img_s']:11.1f} | {r['graph_img_s']:11.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
