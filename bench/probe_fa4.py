"""Probe: FlashAttention-4 (the `flash-attn-4` package, CuTe DSL kernels with an SM90 forward) against
the cuDNN attention the tower uses, at the tower's shapes (16 heads of 64, bf16, full attention):

    python bench/probe_fa4.py --out DIR

1024px images: 16 x 4,096 patches (where issue 6's 1024px target is short); 448px: 64 x 784. Each
kernel timed with CUDA events (bench_gpu.cuda_time); the outputs compared with each other and with a
float32 reference on a slice; and whether FA4 can be captured in a CUDA graph (the service replays
graphs for small steps). FA4 is not a dependency of the service. Its install: flash-attn-4,
nvidia-cutlass-dsl (+ -libs-base, -libs-cu13: a 92 MB wheel), apache-tvm-ffi, torch-c-dlpack-ext,
quack-kernels, einops; with `pip --target DIR`, PYTHONPATH needs DIR/nvidia_cutlass_dsl/dsl_packages too
(the package's .pth is not read there). A run of 2026-12-01 did so on an H200 and `cutlass.cute` still did not
import: those wheels carry no `cutlass` Python sources (bench/RESULTS.md). A failed import is recorded
in the JSON and the cuDNN figures still are. Results: DIR/probe_fa4.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.bench_gpu import cuda_time  # noqa: E402

HEADS, DIM = 16, 64


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def probe(batch: int, length: int) -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(batch, length, HEADS, DIM, device="cuda", dtype=torch.bfloat16, generator=g)
               for _ in range(3))
    flop = 4 * batch * HEADS * length * length * DIM
    res: dict = {"batch": batch, "length": length, "heads": HEADS, "dim": DIM, "gflop": round(flop / 1e9, 1)}
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))  # SDPA's [B, H, L, D] views of the same memory

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(qt, kt, vt)

    ref_out = cudnn().transpose(1, 2)
    s = cuda_time(cudnn)
    res["cudnn_ms"], res["cudnn_tflops"] = round(s * 1e3, 3), round(flop / s / 1e12, 1)
    # float32 reference on the first image (math backend), to judge both kernels' errors
    with sdpa_kernel(SDPBackend.MATH):
        f32 = F.scaled_dot_product_attention(qt[:1].float(), kt[:1].float(), vt[:1].float()).transpose(1, 2)
    res["cudnn_rel_err_vs_f32"] = rel_err(ref_out[:1], f32)
    try:
        from flash_attn.cute import flash_attn_func

        def fa4():
            out = flash_attn_func(q, k, v)
            return out[0] if isinstance(out, tuple) else out

        t0 = time.perf_counter()
        out = fa4()
        torch.cuda.synchronize()
        res["fa4_first_call_s"] = round(time.perf_counter() - t0, 2)  # the CuTe DSL compile
        res["fa4_rel_err_vs_f32"] = rel_err(out[:1], f32)
        res["fa4_vs_cudnn_rel"] = rel_err(out, ref_out)
        s = cuda_time(fa4)
        res["fa4_ms"], res["fa4_tflops"] = round(s * 1e3, 3), round(flop / s / 1e12, 1)
        res["fa4_speedup_vs_cudnn"] = round(res["cudnn_ms"] / res["fa4_ms"], 3)
        try:  # inside a CUDA graph, as the service would run it for small steps
            graph = torch.cuda.CUDAGraph()
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream):
                fa4()
                with torch.cuda.graph(graph, stream=stream):
                    captured = fa4()
            graph.replay()
            torch.cuda.synchronize()
            res["fa4_graph_equal"] = bool(torch.equal(captured, fa4()))
            s = cuda_time(graph.replay)
            res["fa4_graph_ms"] = round(s * 1e3, 3)
        except Exception as e:  # noqa: BLE001
            res["fa4_graph_error"] = f"{type(e).__name__}: {e}"[:500]
    except Exception as e:  # noqa: BLE001
        res["fa4_error"] = f"{type(e).__name__}: {e}"[:2000]
        res["fa4_traceback"] = traceback.format_exc()[-3000:]
    return res


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    res = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "command": " ".join(sys.argv),
           "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "shapes": []}
    try:
        from importlib.metadata import version

        res["flash_attn_4"] = version("flash-attn-4")
        res["nvidia_cutlass_dsl"] = version("nvidia-cutlass-dsl")
    except Exception as e:  # noqa: BLE001
        res["versions_error"] = str(e)
    for batch, length in ((16, 4096), (64, 784), (1, 784)):
        res["shapes"].append(probe(batch, length))
        print(json.dumps(res["shapes"][-1]), flush=True)
        (args.out / "probe_fa4.json").write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
