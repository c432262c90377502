"""Tower variants at large steps (issue 6's 1024px figure), one process, same weights:

    python bench/probe_tower.py --out DIR

* residual adds inside the GEMMs (addmm with residual + bias as C) against a separate add per residual
  (tried on 2026-11-30 and not kept: results/2026-11-30-h200-graphs-staging/probe7_*; the variant lived in
  service/engine/tower.py's _make_block_fn as `residual_in_gemm` in commit b06fe8f: check that out to rerun it);
* the compiled forward launched from Python against the same forward replayed from a CUDA graph
  (is the gap between the kernels' sum and the wall time host-side?);
* the GPU kernel time of one forward (torch.profiler) against its wall time.
Writes DIR/probe_tower.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bench_gpu import cuda_time, tower_flops  # noqa: E402
from bench.bench_tower import synthetic_batch  # noqa: E402
from service.engine import attention, tower as tower_module  # noqa: E402
from service.config import Settings  # noqa: E402
from service.engine.loader import load_model  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--preset", default="qwen3-vl-4b")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    res: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "command": " ".join(sys.argv),
                 "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__}
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    res["ceiling_bf16_tflops"] = round(2 * 8192**3 / cuda_time(lambda: a @ a, reps=10) / 1e12, 1)
    del a
    settings = Settings(model=args.preset, device="cuda", dtype="bfloat16",
                        compile_cache=Path(tempfile.mkdtemp(prefix="qve-probe-")))
    model = load_model(settings)
    spec, tower = model.spec, model.tower
    tower.attention_plan = attention.measure_plan(model.device, model.dtype, spec.num_heads, spec.head_dim)
    shapes = {"448 b64": [(1, 28, 28)] * 64, "1024 b16": [(1, 64, 64)] * 16, "448 b8": [(1, 28, 28)] * 8}
    batches = {k: synthetic_batch(spec, g)[0] for k, g in shapes.items()}
    outs: dict = {}
    res["variants"] = {}
    for fused in (False, True):
        tower._block_fn = tower_module._make_block_fn(spec.num_heads, spec.head_dim, eps=1e-6,
                                                      max_rows=tower_module.max_block_rows(spec), residual_in_gemm=fused)
        torch._dynamo.reset()
        tower.compile()
        row = {}
        with torch.inference_mode():
            for name, tb in batches.items():
                outs[(fused, name)] = tower(tb).float()
                t = cuda_time(lambda: tower(tb), reps=10)
                fl = tower_flops(spec, list(tb.seq_lens), frame_only=False)
                row[name] = {"ms": round(t * 1e3, 2), "img_s": round(len(tb.seq_lens) / t, 1),
                             "pct_ceiling": round(100 * fl / t / 1e12 / res["ceiling_bf16_tflops"], 1)}
                print("residual_in_gemm" if fused else "separate_add", name, row[name], flush=True)
        res["variants"]["residual_in_gemm" if fused else "separate_add"] = row
    res["rel_diff_between_variants"] = {
        name: round(float(((outs[(True, name)] - outs[(False, name)]).norm() / outs[(False, name)].norm())), 6)
        for name in batches}
    print("rel diff", res["rel_diff_between_variants"], flush=True)

    # The service's variant (the last compiled): a CUDA graph of the whole 1024px forward, and the profile.
    tb = batches["1024 b16"]
    s = torch.cuda.Stream()
    with torch.inference_mode():
        with torch.cuda.stream(s):
            tower(tb)
        s.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.stream(s):
            g.capture_begin()
            tower(tb)
            g.capture_end()
        t_graph = cuda_time(g.replay, reps=10)
        t_launch = cuda_time(lambda: tower(tb), reps=10)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            tower(tb)
            torch.cuda.synchronize()
    kernels_ms = sum(e.device_time_total for e in prof.key_averages()) / 1e3
    res["1024 b16"] = {"launched_ms": round(t_launch * 1e3, 2), "graph_ms": round(t_graph * 1e3, 2),
                       "graph_img_s": round(16 / t_graph, 1), "kernels_sum_ms": round(kernels_ms, 2)}
    print("1024 b16", res["1024 b16"], flush=True)
    (args.out / "probe_tower.json").write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
