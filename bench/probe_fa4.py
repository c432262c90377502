"""Probe: FlashAttention-4 (the `flash-attn-4` package, CuTe DSL kernels with an SM90 forward) against every
other attention kernel the tower can run, at the tower's shapes (16 heads of 64, bf16, full attention):

    python bench/probe_fa4.py --out DIR

Each kernel is called through the service's own `attention.attend` (FA4 through its custom op), on strided
q/k/v views of one packed qkv tensor as the tower passes them, and timed with CUDA events two ways: one
call at a time on an idle device (bench_gpu.cuda_time, median of 20: the host's launch included) and
queued behind a busy-wait kernel, 8 calls back to back (attention.gpu_ms: the device's time alone, how the
engine's start-up plan measures), with the host's own time per call. Steps: 64 x 448px (784 patches),
1 x 448px, 16 x 1024px (4,096), 4 x 1080p (8,160) and issue 24's ten real-world photo sizes in one varlen
step. For each: ms and TFLOP/s (queued), idle_ms (one call at a time), host_ms, the relative L2 error
against float32 SDPA on the first segment, and the first call's time (FA4's JIT compile).

FA4 is not a dependency of the service: the optional `fa4` extra. Its install where no registry is:
flash-attn-4, nvidia-cutlass-dsl (+ -libs-base, -libs-core, -libs-cu13: a 92 MB wheel), apache-tvm-ffi,
torch-c-dlpack-ext, quack-kernels; with `pip --target DIR`, PYTHONPATH needs DIR/nvidia_cutlass_dsl/dsl_packages
too (the package's .pth is not read there; bench/gpu_common.sh). Results: DIR/probe_fa4.json.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.bench_gpu import cuda_time  # noqa: E402
from bench.bench_tower import REAL_WORLD_SIZES  # noqa: E402
from service.engine import attention  # noqa: E402
from service.engine.attention import AttentionKind, Attn, Backend  # noqa: E402
from service.config import PreprocessParams  # noqa: E402
from service.media.preprocess import grid_for, smart_resize  # noqa: E402

HEADS, DIM = 16, 64


def real_world_lengths() -> tuple[int, ...]:
    params = PreprocessParams()
    return tuple(h * w for _, h, w in (grid_for(*smart_resize(hh, ww, params), params) for ww, hh in REAL_WORLD_SIZES))


def probe(name: str, lens: tuple[int, ...]) -> dict:
    device = torch.device("cuda")
    n = sum(lens)
    g = torch.Generator(device=device).manual_seed(0)
    qkv = torch.randn(n, 3, HEADS, DIM, device=device, dtype=torch.bfloat16, generator=g)
    q, k, v = qkv.unbind(1)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    flop = sum(4 * HEADS * m * m * DIM for m in lens)
    res: dict = {"step": name, "segments": len(lens), "patches": n, "gflop": round(flop / 1e9, 2), "kernels": {}}
    first = lens[0]
    with torch.inference_mode():
        f32 = F.scaled_dot_product_attention(*(t[:first].float().transpose(0, 1)[None] for t in (q, k, v)))
        f32 = f32[0].transpose(0, 1)
    kinds = [AttentionKind.VARLEN] + ([AttentionKind.BATCHED] if len(set(lens)) == 1 else [])
    for kind in kinds:
        for backend in attention.CANDIDATES[kind]:
            key = f"{kind.value} {backend.value}"
            if backend not in attention.available(kind, device):
                res["kernels"][key] = {"skipped": "not available here"}
                continue
            attn = Attn(kind, backend, cu, max(lens) if kind == AttentionKind.VARLEN else 0,
                        len(lens) if kind == AttentionKind.BATCHED else 0, None)
            run = lambda: attention.attend(q, k, v, attn, DIM**-0.5)  # noqa: E731
            try:
                with torch.inference_mode():
                    t0 = time.perf_counter()
                    out = run()
                    torch.cuda.synchronize()
                    first_s = time.perf_counter() - t0
                    s = cuda_time(run)
                    queued = attention.gpu_ms(run) / 1e3
                    torch.cuda._sleep(40_000_000)  # the device busy: the loop below times the host alone
                    t0 = time.perf_counter()
                    for _ in range(8):
                        run()
                    host_s = (time.perf_counter() - t0) / 8
                    torch.cuda.synchronize()
                err = ((out[:first].float() - f32).norm() / f32.norm()).item()
                res["kernels"][key] = {"ms": round(queued * 1e3, 4), "tflops": round(flop / queued / 1e12, 1),
                                       "idle_ms": round(s * 1e3, 4), "host_ms": round(host_s * 1e3, 4),
                                       "rel_err_vs_f32": float(f"{err:.3g}"), "first_call_s": round(first_s, 2)}
            except Exception as e:  # noqa: BLE001
                res["kernels"][key] = {"error": f"{type(e).__name__}: {e}"[:1500],
                                       "traceback": traceback.format_exc()[-2000:]}
            print(name, key, {k: v for k, v in res["kernels"][key].items() if k != "traceback"}, flush=True)
    timed = {k: r["ms"] for k, r in res["kernels"].items() if "ms" in r}
    if timed:
        best = min(timed, key=timed.get)
        res["fastest"] = best
        fa4 = [k for k in timed if k.endswith("fa4")]
        others = {k: t for k, t in timed.items() if not k.endswith("fa4")}
        if fa4 and others:
            res["fa4_vs_best_other"] = round(min(others.values()) / min(timed[k] for k in fa4), 3)
    return res


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    res = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "command": " ".join(sys.argv),
           "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
           "fa3": attention.fa3_status(), "fa4": attention.fa4_status(), "steps": []}
    try:
        from importlib.metadata import version

        res["flash_attn_4"] = version("flash-attn-4")
        res["nvidia_cutlass_dsl"] = version("nvidia-cutlass-dsl-libs-core")
    except Exception as e:  # noqa: BLE001
        res["versions_error"] = str(e)
    steps = {"64 x 448px": (784,) * 64, "1 x 448px": (784,), "16 x 1024px": (4096,) * 16,
             "4 x 1080p": (8160,) * 4, "real-world 10": real_world_lengths()}
    for name, lens in steps.items():
        res["steps"].append(probe(name, lens))
        (args.out / "probe_fa4.json").write_text(json.dumps(res, indent=2))
    print(json.dumps({s["step"]: (s.get("fastest"), s.get("fa4_vs_best_other")) for s in res["steps"]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
