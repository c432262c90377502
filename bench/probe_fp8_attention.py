"""FlashAttention-3's FP8 forward against its bf16 one, at the tower's attention shapes (issue 24: the FP8
tower still runs its attention in bf16). GPU machine with the `fa3` extra; writes DIR/probe_fp8_attention.json.

    python bench/probe_fp8_attention.py --out DIR

Per step shape (16 heads x 64, the 4B preset's):
  * bf16: FA3 (varlen, and dense where the segments are equal) and cuDNN (equal segments);
  * fp8: FA3 with float8_e4m3fn q, k, v and per-tensor scales, the kernel alone (inputs quantised
    beforehand), and the quantisation it needs from the block's bf16 q, k, v (the amax of each, then the
    scaled cast; torch.compile'd, as the block would run it);
  * the error of bf16 FA3 and of fp8 FA3 against float32 attention: relative L2 and the least per-row cosine.
Inputs are random (randn, and randn with a few large channels, as trained ViTs' q and k have): what trained
weights give is not measured here. Decides whether FP8 attention is worth building into `--dtype fp8`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.bench_gpu import cuda_time  # noqa: E402
from bench.bench_tower import REAL_WORLD_SIZES  # noqa: E402
from service.config import PreprocessParams  # noqa: E402
from service.engine import attention  # noqa: E402
from service.media.preprocess import grid_for, smart_resize  # noqa: E402

H, D = 16, 64
FP8_MAX = 448.0


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor FP8: (x / s) as float8_e4m3fn and s [1] float32, the largest magnitude mapped to 448."""
    s = x.abs().amax().float().clamp(min=1e-12) / FP8_MAX
    return (x.float() / s).to(torch.float8_e4m3fn), s.reshape(1)


def quantize_qkv(q, k, v):
    (q8, qs), (k8, ks), (v8, vs) = quantize(q), quantize(k), quantize(v)
    return q8, k8, v8, qs, ks, vs


def reference(q, k, v, lens) -> torch.Tensor:
    """float32 attention per segment, [N, H, D]."""
    outs, at = [], 0
    for n in lens:
        qs, ks, vs = (t[at:at + n].float().transpose(0, 1)[None] for t in (q, k, v))
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, scale=D**-0.5)[0].transpose(0, 1))
        at += n
    return torch.cat(outs)


def errors(out: torch.Tensor, ref: torch.Tensor) -> dict:
    o, r = out.float().reshape(out.shape[0], -1), ref.reshape(ref.shape[0], -1)
    return {"rel_l2": float((o - r).norm() / r.norm()),
            "cosine_min": float(F.cosine_similarity(o, r, dim=1).min())}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    fa3 = attention.fa3_op()
    res = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "gpu": torch.cuda.get_device_name(),
           "torch": torch.__version__, "fa3": attention.fa3_status(), "command": " ".join(sys.argv), "shapes": []}
    if fa3 is None:
        print("FA3 is not available:", res["fa3"])
        (out_dir / "probe_fp8_attention.json").write_text(json.dumps(res, indent=1))
        return
    params = PreprocessParams()  # Qwen3-VL's preprocessor defaults: the service's image sizes
    shapes = {"448 b64": [784] * 64, "1024 b16": [4096] * 16, "1080p b4": [8160] * 4,
              "real-world 10": [g[1] * g[2] for g in
                                (grid_for(*smart_resize(h, w, params), params) for w, h in REAL_WORLD_SIZES)]}
    qz = torch.compile(quantize_qkv, dynamic=True)
    scale = D**-0.5
    for name, lens in shapes.items():
        for inputs in ("randn", "randn + outlier channels"):
            n = sum(lens)
            g = torch.Generator(device="cuda").manual_seed(0)
            qkv = torch.randn(n, 3, H, D, device="cuda", dtype=torch.float32, generator=g)
            if inputs != "randn":
                qkv[:, :2, :, :4] *= 20.0  # a few channels of q and k 20x the rest
            qkv = qkv.to(torch.bfloat16)
            q, k, v = qkv.unbind(1)  # strided views, as the block passes them
            cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
            m = max(lens)
            flop = sum(4 * L * L * H * D for L in lens)
            row = {"shape": name, "inputs": inputs, "segments": len(lens), "patches": n}
            ref = reference(q, k, v, lens)
            q8, k8, v8, qs, ks, vs = qz(q, k, v)
            b = len(lens)
            qd, kd, vd = (s.expand(b, H) for s in (qs, ks, vs))

            def fa3_bf16():
                return fa3(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=m, max_seqlen_k=m,
                           softmax_scale=scale)[0]

            def fa3_fp8():
                return fa3(q8, k8, v8, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=m, max_seqlen_k=m,
                           q_descale=qd, k_descale=kd, v_descale=vd, softmax_scale=scale)[0]

            timings = {"varlen fa3 bf16": fa3_bf16, "varlen fa3 fp8 (kernel)": fa3_fp8,
                       "fp8 quantisation of q, k, v": lambda: qz(q, k, v)}
            if len(set(lens)) == 1:
                L = lens[0]
                q4, k4, v4 = (t.reshape(b, L, H, D) for t in (q, k, v))
                q84, k84, v84 = (t.reshape(b, L, H, D) for t in (q8, k8, v8))
                qs4, ks4, vs4 = (t.reshape(b, L, H, D).transpose(1, 2) for t in (q, k, v))
                timings["dense fa3 bf16"] = lambda: fa3(q4, k4, v4, softmax_scale=scale)[0]
                timings["dense fa3 fp8 (kernel)"] = lambda: fa3(q84, k84, v84, q_descale=qd, k_descale=kd,
                                                                v_descale=vd, softmax_scale=scale)[0]
                timings["dense cudnn bf16"] = lambda: torch.ops.aten._scaled_dot_product_cudnn_attention(
                    qs4, ks4, vs4, None, False, scale=scale)[0]
            with torch.inference_mode():
                try:
                    row["error fa3 bf16"] = errors(fa3_bf16(), ref)
                    row["error fa3 fp8"] = errors(fa3_fp8(), ref)
                    for label, fn in timings.items():
                        ms = 1e3 * cuda_time(fn, reps=20)
                        row[f"{label} ms"] = round(ms, 4)
                        if "quantisation" not in label:
                            row[f"{label} TFLOP/s"] = round(flop / ms / 1e9, 1)
                except Exception as e:  # noqa: BLE001 - a build without these kernels: say so, go on
                    row["error"] = f"{type(e).__name__}: {e}"[:400]
            if "varlen fa3 fp8 (kernel) ms" in row:
                row["varlen fp8 + quantisation vs bf16"] = round(
                    row["varlen fa3 bf16 ms"] / (row["varlen fa3 fp8 (kernel) ms"] + row["fp8 quantisation of q, k, v ms"]), 3)
            print(row, flush=True)
            res["shapes"].append(row)
            (out_dir / "probe_fp8_attention.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
