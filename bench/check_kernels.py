"""Check and time kernels/qve_kernels/patchify.py on a GPU. Standalone: needs torch (CUDA) and cupy.

    python bench/check_kernels.py --out DIR [--reps 200] [--warmup 20]

1. Correctness, with its own tiny torch reference (no tolerance: float32 output must equal it bit for
   bit, bfloat16 output must equal its .to(bfloat16)): images of mixed sizes (32x32 to 1024x768),
   random uint8, output poisoned with NaN before the launch; src and image table each from device
   memory and from pinned host memory (read in place through unified addressing); float32 and
   bfloat16; temporal off and on; unaligned image offsets (byte-load path); bad arguments rejected.
2. Timing, CUDA events, median over reps after warm-up: 16 images of 448x448 and 4 of 1024x1024,
   bfloat16 and float32 out, src pinned (UVA) vs already on the device, plus the pinned H2D copy of
   src alone, copy + kernel (the alternative to UVA), and the same result from plain torch ops. A host sleep kernel is queued before each
   timed launch so the events measure the GPU work, not the Python launch. GB/s counts bytes read
   from src plus bytes written to out. The launcher's host cost is timed too.

Writes DIR/check_kernels.json, prints versions and a table; exits 1 if any check failed.
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[1] / "kernels")]  # run from anywhere without installing

import torch  # noqa: E402

from qve_kernels.patchify import patchify_cuda  # noqa: E402

P, M = 16, 2


# ---- reference and inputs: the GPU tests' own oracle (independent of the service's CPU patchify) ----------
from tests.unit.kernels.test_patchify import make_batch, make_lut, reference  # noqa: E402




# ---- checks -------------------------------------------------------------------------------------------
def check_matrix() -> list[dict]:
    results = []
    lut = make_lut(2)
    lut_d = lut.cuda()
    batches = {
        "": make_batch([(32, 32), (64, 96), (96, 64), (448, 448), (32, 320), (1024, 768)], seed=1),
        "unaligned ": make_batch([(64, 32), (32, 96), (128, 128)], seed=3, pad=5),  # byte-load path
    }
    where = ("cuda", "pinned")
    for (tag, batch), src_where, table_where, dtype, temporal in itertools.product(
        batches.items(), where, where, (torch.float32, torch.bfloat16), (False, True)
    ):
        src, table, pixels, rows = batch
        s = src.pin_memory() if src_where == "pinned" else src.cuda()
        t = table.pin_memory() if table_where == "pinned" else table.cuda()
        cols = 3 * P * P * (2 if temporal else 1)
        out = torch.full((rows, cols), float("nan"), device="cuda", dtype=dtype)  # poison
        patchify_cuda(s, t, lut_d, out, temporal=temporal, images_host=table)
        torch.cuda.synchronize()
        got = out.cpu()
        ref = torch.cat([reference(px, lut, temporal) for px in pixels]).to(dtype)
        unwritten = int(torch.isnan(got.float()).sum())
        equal = torch.equal(got, ref)
        mismatched = 0 if equal else int((got.float() != ref.float()).sum()) - unwritten
        name = f"{tag}src={src_where} table={table_where} {str(dtype)[6:]} temporal={temporal}"
        results.append({"check": name, "ok": equal and unwritten == 0, "unwritten": unwritten, "mismatched": mismatched})
    return results


def check_rejects() -> list[dict]:
    src, table, _, rows = make_batch([(64, 64)], seed=7)
    lut, src_d, table_d = make_lut().cuda(), src.cuda(), table.cuda()
    out = torch.empty(rows, 3 * P * P, device="cuda")
    cases = {
        "pageable src": lambda: patchify_cuda(src, table_d, lut, out),
        "float src": lambda: patchify_cuda(src_d.float(), table_d, lut, out),
        "int64 table": lambda: patchify_cuda(src_d, table_d.long(), lut, out),
        "float64 lut": lambda: patchify_cuda(src_d, table_d, lut.double(), out),
        "temporal width": lambda: patchify_cuda(src_d, table_d, lut, out, temporal=True),
        "float16 out": lambda: patchify_cuda(src_d, table_d, lut, out.half()),
        "rows mismatch": lambda: patchify_cuda(src_d, table.pin_memory(), lut, out[:-1]),
    }
    results = []
    for name, call in cases.items():
        try:
            call()
            results.append({"check": f"rejects {name}", "ok": False, "error": "no error raised"})
        except ValueError as e:
            results.append({"check": f"rejects {name}", "ok": True, "error": str(e)})
    return results


# ---- timing -------------------------------------------------------------------------------------------
def gpu_median_us(fn, reps: int, warmup: int) -> float:
    """Median GPU time of fn() in µs; a sleep kernel first lets the host queue the launch ahead."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1_000_000)  # ~0.5 ms at ~2 GHz: longer than the Python launch below
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def host_median_us(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
        torch.cuda.synchronize()
    return statistics.median(times)


def torch_baseline(src_dev: torch.Tensor, n: int, h: int, w: int, lut: torch.Tensor, out: torch.Tensor) -> None:
    """The same result from plain torch ops (equal-size images batched), for comparison."""
    x = src_dev.view(n, h, w, 3).long() + torch.arange(0, 3 * 256, 256, device=src_dev.device)
    vals = lut.view(-1)[x]  # [n, H, W, 3] float32
    gh, gw = h // P, w // P
    vals = vals.view(n, gh // M, M, P, gw // M, M, P, 3).permute(0, 1, 4, 2, 5, 7, 3, 6)
    out.view(n, gh // M, gw // M, M, M, 3, P, P).copy_(vals)


def timings(reps: int, warmup: int) -> list[dict]:
    rows_out = []
    lut = make_lut().cuda()
    for label, sizes in (("16x 448x448", [(448, 448)] * 16), ("4x 1024x1024", [(1024, 1024)] * 4)):
        src, table, _, rows = make_batch(sizes, seed=11)
        src_pinned, src_dev = src.pin_memory(), src.cuda()
        src_dev_copy = torch.empty_like(src_dev)
        table_dev = table.cuda()
        for dtype in (torch.bfloat16, torch.float32):
            out = torch.empty(rows, 3 * P * P, device="cuda", dtype=dtype)
            out_bytes = out.numel() * out.element_size()
            cases = {
                "kernel, src pinned (UVA)": lambda: patchify_cuda(src_pinned, table_dev, lut, out),
                "kernel, src on device": lambda: patchify_cuda(src_dev, table_dev, lut, out),
                "H2D copy of src (pinned)": lambda: src_dev_copy.copy_(src_pinned, non_blocking=True),
                "H2D copy + kernel": lambda: (
                    src_dev_copy.copy_(src_pinned, non_blocking=True),
                    patchify_cuda(src_dev_copy, table_dev, lut, out),
                ),
                "torch ops baseline, src on device": lambda: torch_baseline(src_dev, len(sizes), *sizes[0], lut, out),
            }
            for name, fn in cases.items():
                if name.startswith("H2D copy of") and dtype != torch.bfloat16:
                    continue  # independent of the output dtype
                us = gpu_median_us(fn, reps, warmup)
                moved = src.numel() + (0 if name.startswith("H2D copy of") else out_bytes)
                rows_out.append({
                    "workload": label, "out_dtype": str(dtype)[6:], "case": name, "median_us": round(us, 2),
                    "bytes": moved, "GB_per_s": round(moved / us / 1e3, 1),
                    "src_bytes": src.numel(), "out_bytes": out_bytes, "rows": rows,
                })
        out = torch.empty(rows, 3 * P * P, device="cuda", dtype=torch.bfloat16)
        host_cases = {
            "launcher host cost, device table, unchecked": lambda: patchify_cuda(src_pinned, table_dev, lut, out),
            "launcher host cost, device table + images_host check": lambda: patchify_cuda(
                src_pinned, table_dev, lut, out, images_host=table
            ),
        }
        for name, fn in host_cases.items():
            us = round(host_median_us(fn, reps), 1)
            rows_out.append({"workload": label, "out_dtype": "bfloat16", "case": name, "host_median_us": us})
    return rows_out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="directory for check_kernels.json")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    import cupy

    versions = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cupy": cupy.__version__,
        "cupy_cuda_runtime": cupy.cuda.runtime.runtimeGetVersion(),
        "cuda_driver": cupy.cuda.runtime.driverGetVersion(),
        "gpu": torch.cuda.get_device_name(),
    }
    print("versions: " + ", ".join(f"{k}={v}" for k, v in versions.items()))

    report: dict = {"versions": versions}
    try:
        checks = check_matrix() + check_rejects()
    except Exception:
        traceback.print_exc()
        checks = [{"check": "checks raised", "ok": False, "error": traceback.format_exc()}]
    report["checks"] = checks
    failed = [c for c in checks if not c["ok"]]
    print(f"\nchecks: {len(checks) - len(failed)}/{len(checks)} passed")
    for c in failed:
        print(f"  FAILED {c['check']}: {json.dumps({k: v for k, v in c.items() if k not in ('check', 'ok')})}")

    path = args.out / "check_kernels.json"
    path.write_text(json.dumps(report, indent=2))  # now too, in case timing crashes the process
    report["timings"] = timings(args.reps, args.warmup)
    print(f"\n{'workload':<14} {'out':<9} {'case':<58} {'median us':>10} {'GB/s':>8}")
    for r in report["timings"]:
        if "median_us" in r:
            print(f"{r['workload']:<14} {r['out_dtype']:<9} {r['case']:<58} {r['median_us']:>10.1f} {r['GB_per_s']:>8.1f}")
        else:
            print(f"{r['workload']:<14} {r['out_dtype']:<9} {r['case']:<58} {r['host_median_us']:>10.1f} {'(host)':>8}")

    path.write_text(json.dumps(report, indent=2))
    print(f"\nwrote {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
