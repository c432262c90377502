"""Kernel and host-copy probes behind issue 6's open figures (GPU machine; writes DIR/probe_kernels.json).

    python bench/probe_kernels.py --out DIR [--parts store,attention,attn_graph,gemm,warm,sources,commit]

  attention   16 heads x 64 at the tower's shapes (one 448px image, 64 of them, 16 of 1024px): varlen
              flash (what padded graphs run), SDPA flash, cuDNN, memory-efficient, FlexAttention
  attn_graph  the same kernels captured 24 times in a CUDA graph (launch costs gone), 1..8 images
  gemm        the block's GEMM shapes in bf16 against FP8 (torch._scaled_mm, per-row/column scales)
  store       a 4 MB store write after a reservation: writev against a copy into the file mapped ahead
  warm        writev into fresh tmpfs pages after posix_fallocate, or after writing zeros at reserve
  sources     writev speed by the kind of host buffer the D2H landed in
  commit      the real EmbeddingStore reserve + commit, its system calls timed
Results of these runs: bench/results/2026-11-30-h200-graphs-staging/ (see bench/RESULTS.md).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import ctypes
import json
import mmap
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.bench_gpu import cuda_time  # noqa: E402


def cuda_ms(fn, iters=20) -> float:
    """Median milliseconds of fn(), CUDA events (bench_gpu.cuda_time, which gives seconds)."""
    return 1e3 * cuda_time(fn, reps=iters)


def attention(out: dict) -> None:
    from torch.nn.attention.varlen import varlen_attn

    try:
        from torch.nn.attention.flex_attention import flex_attention
        flex = torch.compile(flex_attention, dynamic=False)
    except Exception as e:  # noqa: BLE001
        flex, out["flex_error"] = None, repr(e)
    H, D = 16, 64
    res = {}
    for name, B, L in (("448 b1", 1, 784), ("448 b64", 64, 784), ("1024 b16", 16, 4096)):
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(B * L, H, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
        cu = torch.arange(0, (B + 1) * L, L, device="cuda", dtype=torch.int32)
        qs, ks, vs = (t.view(B, L, H, D).transpose(1, 2) for t in (q, k, v))
        flop = 4 * B * L * L * H * D
        ref = F.scaled_dot_product_attention(qs.float(), ks.float(), vs.float()) if B * L <= 50176 else None
        cands = {
            "varlen_flash": lambda: varlen_attn(q, k, v, cu, cu, L, L),
            "cudnn": lambda: torch.ops.aten._scaled_dot_product_cudnn_attention(qs, ks, vs, None, False)[0],
            "sdpa_flash": lambda: F.scaled_dot_product_attention(qs, ks, vs),
        }

        def eff():
            with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.EFFICIENT_ATTENTION):
                return F.scaled_dot_product_attention(qs, ks, vs)
        cands["sdpa_efficient"] = eff
        if flex is not None:
            cands["flex"] = lambda: flex(qs, ks, vs)
        row = {}
        for cname, fn in cands.items():
            try:
                with torch.inference_mode():
                    o = fn()
                    ms = cuda_ms(fn)
                err = None
                if ref is not None:
                    o4 = o.view(B, L, H, D).transpose(1, 2) if o.dim() == 3 else o
                    err = float(((o4.float() - ref).norm() / ref.norm()).item())
                row[cname] = {"ms": round(ms, 4), "tflops": round(flop / ms / 1e9, 1), "rel_err": err}
            except Exception as e:  # noqa: BLE001
                row[cname] = {"error": repr(e)[:300]}
        res[name] = row
        print(name, json.dumps(row), flush=True)
    out["attention"] = res


def attention_in_graphs(out: dict) -> None:
    """What a graph replay pays per block for attention at small steps: 24 calls captured in one graph
    (launch costs gone, as in the service's graphs), per kernel."""
    from torch.nn.attention.varlen import varlen_attn

    H, D, res = 16, 64, {}
    for B in (1, 2, 4, 8):
        L = 784
        q, k, v = (torch.randn(B * L, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        cu = torch.arange(0, (B + 1) * L, L, device="cuda", dtype=torch.int32)
        qs, ks, vs = (t.view(B, L, H, D).transpose(1, 2) for t in (q, k, v))
        cands = {
            "varlen_flash": lambda: varlen_attn(q, k, v, cu, cu, L, L),
            "cudnn": lambda: torch.ops.aten._scaled_dot_product_cudnn_attention(qs, ks, vs, None, False)[0],
            "sdpa_flash": lambda: F.scaled_dot_product_attention(qs, ks, vs),
        }
        row = {}
        for name, fn in cands.items():
            try:
                s = torch.cuda.Stream()
                with torch.inference_mode(), torch.cuda.stream(s):
                    fn()
                    s.synchronize()
                    g = torch.cuda.CUDAGraph()
                    g.capture_begin()
                    for _ in range(24):
                        fn()
                    g.capture_end()
                    ms = cuda_ms(g.replay, iters=50)
                row[name] = {"ms_per_call": round(ms / 24, 4)}
            except Exception as e:  # noqa: BLE001
                row[name] = {"error": repr(e)[:300]}
        res[f"448 b{B}"] = row
        print("in graph", B, json.dumps(row), flush=True)
    out["attention_in_graph"] = res


def gemms(out: dict) -> None:
    res = {}
    if not hasattr(torch, "_scaled_mm"):
        out["gemm"] = "no _scaled_mm"
        return
    f8 = torch.float8_e4m3fn
    for M in (784, 50176, 65536):
        for K, N, what in ((1024, 3072, "qkv"), (1024, 1024, "proj"), (1024, 4096, "fc1"), (4096, 1024, "fc2")):
            a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K**0.5
            bias = torch.randn(N, device="cuda", dtype=torch.bfloat16)
            flop = 2 * M * N * K
            t16 = cuda_ms(lambda: F.linear(a, w, bias))
            # per-row activation scales (computed each call, as a served step would) x per-column weight scales
            ws = (w.abs().amax(1, keepdim=True).float() / 448.0).clamp(min=1e-12)
            w8 = (w.float() / ws).to(f8)

            def fp8():
                s = (a.abs().amax(1, keepdim=True).float() / 448.0).clamp(min=1e-12)
                a8 = (a.float() / s).to(f8)
                return torch._scaled_mm(a8, w8.t(), scale_a=s, scale_b=ws.t(), bias=bias, out_dtype=torch.bfloat16)

            def fp8_mm_only(a8=(a.float() / (a.abs().amax(1, keepdim=True).float() / 448.0)).to(f8),
                            s=(a.abs().amax(1, keepdim=True).float() / 448.0)):
                return torch._scaled_mm(a8, w8.t(), scale_a=s, scale_b=ws.t(), bias=bias, out_dtype=torch.bfloat16)
            row = {"bf16_ms": round(t16, 4), "bf16_tflops": round(flop / t16 / 1e9, 1)}
            try:
                tq = cuda_ms(fp8)
                tm = cuda_ms(fp8_mm_only)
                ref = F.linear(a.float(), w.float(), bias.float())
                err8 = float(((fp8().float() - ref).norm() / ref.norm()).item())
                err16 = float(((F.linear(a, w, bias).float() - ref).norm() / ref.norm()).item())
                row.update(fp8_with_quant_ms=round(tq, 4), fp8_mm_ms=round(tm, 4),
                           fp8_mm_tflops=round(flop / tm / 1e9, 1), fp8_rel_err=err8, bf16_rel_err=err16)
            except Exception as e:  # noqa: BLE001
                row["fp8_error"] = repr(e)[:300]
            res[f"M{M} {what}"] = row
            print(M, what, json.dumps(row), flush=True)
    out["gemm"] = res


def store_writes(out: dict, root: str) -> None:
    """One 448px image's ec_cache (4 MB, after a ~300-byte header) into a fresh tmpfs file that was
    fallocated beforehand, from a pinned buffer the GPU has just written (as in the step loop: the
    source is cold in the CPU caches). Variants: writev (today); the file mapped and its pages
    populated ahead (the reserve), then one memmove or four in threads."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    MAP_POPULATE, MADV_POPULATE_WRITE = 0x8000, 23
    nbytes, hdr = 196 * 10240 * 2, b"h" * 312
    size = len(hdr) + nbytes
    dev = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    mv = memoryview((ctypes.c_ubyte * nbytes).from_address(src.data_ptr())).cast("B")
    pool = concurrent.futures.ThreadPoolExecutor(4)
    variants = ("writev_hot", "writev", "pop_map1", "pop_map4", "madv4_map4")
    res = {v: {"prep_ms": [], "copy_ms": [], "unmap_ms": []} for v in variants}
    ok = []
    d = tempfile.mkdtemp(dir=root)

    def split_copy(addr, k):
        q = -(-nbytes // k)
        parts = [(j * q, min(q, nbytes - j * q)) for j in range(k)]
        fs = [pool.submit(ctypes.memmove, addr + len(hdr) + o, src.data_ptr() + o, n) for o, n in parts[1:]]
        ctypes.memmove(addr + len(hdr) + parts[0][0], src.data_ptr(), parts[0][1])
        for f in fs:
            f.result()

    for i in range(40):
        for v in variants:
            if v != "writev_hot":
                dev.add_(1)
                src.copy_(dev, non_blocking=True)  # DMA into the pinned buffer, like the step's D2H
                torch.cuda.synchronize()
            p = os.path.join(d, f"{v}-{i}")
            fd = os.open(p, os.O_CREAT | os.O_RDWR)
            os.posix_fallocate(fd, 0, size)
            r = res[v]
            if v.startswith("writev"):
                t = time.perf_counter()
                os.writev(fd, [hdr, mv])
                r["copy_ms"].append((time.perf_counter() - t) * 1e3)
            else:
                t = time.perf_counter()
                flags = mmap.MAP_SHARED | (MAP_POPULATE if v.startswith("pop") else 0)
                addr = libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, flags, fd, 0)
                if v.startswith("madv"):
                    q = (size // 4 + 4095) // 4096 * 4096
                    list(pool.map(lambda j: libc.madvise(addr + j * q, max(0, min(q, size - j * q)), MADV_POPULATE_WRITE),
                                  range(4)))
                r["prep_ms"].append((time.perf_counter() - t) * 1e3)
                ctypes.memmove(addr, hdr, len(hdr))
                t = time.perf_counter()
                split_copy(addr, 1 if v.endswith("map1") else 4)
                r["copy_ms"].append((time.perf_counter() - t) * 1e3)
                t = time.perf_counter()
                libc.munmap(addr, size)
                r["unmap_ms"].append((time.perf_counter() - t) * 1e3)
            os.close(fd)
            with open(p, "rb") as f:
                ok.append(f.read() == hdr + bytes(mv))
            if i % 8 != 7:
                os.unlink(p)  # keep some: the store's pages are not always recycled ones
    out["store_write_4MB"] = {v: {k: round(statistics.median(x[5:]), 4) for k, x in r.items() if x} for v, r in res.items()}
    out["store_write_4MB"]["content_ok"] = all(ok)
    print(json.dumps(out["store_write_4MB"]), flush=True)


def store_commit(out: dict, root: str) -> None:
    """The real EmbeddingStore's reserve + commit of one 448px image, from a pinned buffer the GPU has
    just written, with the system calls inside commit timed (is it writev, or something around it?),
    interleaved with a raw writev of the same bytes into a fallocated file."""
    import service.store.directory as st

    dev = torch.randn(196, 10240, device="cuda" if torch.cuda.is_available() else "cpu").to(torch.bfloat16)
    host = torch.empty(196 * 4, 10240, dtype=torch.bfloat16, pin_memory=torch.cuda.is_available())  # like the output ring
    rows = host[:196]
    sysc: dict[str, list] = {}
    real = {}
    for name in ("writev", "fchmod", "close", "replace", "posix_fallocate", "open", "mkdir"):
        f = getattr(os, name)
        real[name] = f

        def timed(*a, _f=f, _n=name, **k):
            t = time.perf_counter()
            try:
                return _f(*a, **k)
            finally:
                sysc.setdefault(_n, []).append((time.perf_counter() - t) * 1e3)
        setattr(os, name, timed)
    d = tempfile.mkdtemp(dir=root)
    store = st.EmbeddingStore(Path(d), 64 * 1024**3, "probe", 2560, 3)
    res = {"reserve_ms": [], "commit_ms": [], "raw_writev_ms": []}
    try:
        for i in range(40):
            dev.add_(1)
            rows.copy_(dev, non_blocking=True)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            t = time.perf_counter()
            r = store.reserve(f"k{i}", (196, 10240), torch.bfloat16, (1, 28, 28))
            t1 = time.perf_counter()
            store.commit(r, rows)
            t2 = time.perf_counter()
            res["reserve_ms"].append((t1 - t) * 1e3)
            res["commit_ms"].append((t2 - t1) * 1e3)
            dev.add_(1)
            rows.copy_(dev, non_blocking=True)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            p = os.path.join(d, f"raw{i}")
            fd = real["open"](p, os.O_CREAT | os.O_RDWR)
            real["posix_fallocate"](fd, 0, 312 + rows.nbytes)
            mv = st._tensor_bytes(rows)
            t = time.perf_counter()
            real["writev"](fd, [b"h" * 312, mv])
            res["raw_writev_ms"].append((time.perf_counter() - t) * 1e3)
            real["close"](fd)
    finally:
        for name, f in real.items():
            setattr(os, name, f)
    out["store_commit"] = {**{k: round(statistics.median(v[5:]), 4) for k, v in res.items()},
                           "syscalls_ms": {k: round(statistics.median(v), 4) for k, v in sysc.items()}}
    print(json.dumps(out["store_commit"]), flush=True)


def write_sources(out: dict, root: str) -> None:
    """Does the kind of host buffer the D2H lands in change how fast writev copies it into tmpfs?
    4 MB after a DMA, from: a 4 MB pinned tensor, a slice of a 16 MB and of a 335 MB pinned tensor
    (the engine's output ring), pageable memory, and anonymous memory advised for huge pages then
    registered with cudaHostRegister."""
    import cupy

    nbytes = 196 * 10240 * 2
    dev = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
    srcs = {"pinned_4MB": torch.empty(nbytes, dtype=torch.uint8, pin_memory=True),
            "pinned_16MB": torch.empty(4 * nbytes, dtype=torch.uint8, pin_memory=True),
            "pinned_335MB": torch.empty(335 * 2**20, dtype=torch.uint8, pin_memory=True),
            "pageable_335MB": torch.empty(335 * 2**20, dtype=torch.uint8)}
    size = 336 * 2**20
    mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mm.madvise(mmap.MADV_HUGEPAGE)
    thp = torch.frombuffer(mm, dtype=torch.uint8)
    thp.fill_(1)  # fault it in (as huge pages where the kernel can)
    cupy.cuda.runtime.hostRegister(thp.data_ptr(), size, 0)
    srcs["registered_thp_336MB"] = thp
    res = {k: [] for k in srcs}
    d = tempfile.mkdtemp(dir=root)
    for i in range(30):
        for name, buf in srcs.items():
            dst = buf[:nbytes]
            dev.add_(1)
            dst.copy_(dev, non_blocking=True)
            torch.cuda.synchronize()
            p = os.path.join(d, f"{name}{i}")
            fd = os.open(p, os.O_CREAT | os.O_RDWR)
            os.posix_fallocate(fd, 0, 312 + nbytes)
            mv = memoryview((ctypes.c_ubyte * nbytes).from_address(dst.data_ptr())).cast("B")
            t = time.perf_counter()
            os.writev(fd, [b"h" * 312, mv])
            res[name].append((time.perf_counter() - t) * 1e3)
            os.close(fd)
    cupy.cuda.runtime.hostUnregister(thp.data_ptr())
    try:
        thp_kb = int([ln for ln in open("/proc/meminfo") if ln.startswith("AnonHugePages")][0].split()[1])
    except Exception:  # noqa: BLE001
        thp_kb = -1
    out["writev_by_source"] = {**{k: round(statistics.median(v[5:]), 4) for k, v in res.items()},
                               "anon_huge_pages_kb": thp_kb,
                               "thp_enabled": open("/sys/kernel/mm/transparent_hugepage/enabled").read().strip()}
    print(json.dumps(out["writev_by_source"]), flush=True)


def warm_reserve(out: dict, root: str) -> None:
    """Fresh tmpfs pages (never recycled): does writing zeros at reserve time (off the critical path)
    make the later writev of the embeddings faster than after posix_fallocate alone?"""
    nbytes = 196 * 10240 * 2
    size = 312 + nbytes
    dev = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
    src = torch.empty(16 * nbytes, dtype=torch.uint8, pin_memory=True)[:nbytes]
    mv = memoryview((ctypes.c_ubyte * nbytes).from_address(src.data_ptr())).cast("B")
    zeros = bytes(1 << 20)
    variants = ("fallocate", "zeros", "fallocate_zeros")
    res = {v: {"prep_ms": [], "write_ms": []} for v in variants}
    d = tempfile.mkdtemp(dir=root)
    for i in range(30):
        for v in variants:
            dev.add_(1)
            src.copy_(dev, non_blocking=True)
            torch.cuda.synchronize()
            fd = os.open(os.path.join(d, f"{v}{i}"), os.O_CREAT | os.O_RDWR)
            t = time.perf_counter()
            if v.startswith("fallocate"):
                os.posix_fallocate(fd, 0, size)
            if v.endswith("zeros"):
                views = [memoryview(zeros)] * (size >> 20) + [memoryview(zeros)[: size & ((1 << 20) - 1)]]
                os.pwritev(fd, views, 0)
            t1 = time.perf_counter()
            os.pwritev(fd, [b"h" * 312, mv], 0)
            t2 = time.perf_counter()
            res[v]["prep_ms"].append((t1 - t) * 1e3)
            res[v]["write_ms"].append((t2 - t1) * 1e3)
            assert os.fstat(fd).st_size == size
            os.close(fd)
    out["warm_reserve"] = {v: {k: round(statistics.median(x[5:]), 4) for k, x in r.items()} for v, r in res.items()}
    print(json.dumps(out["warm_reserve"]), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--shm", default="/dev/shm")
    ap.add_argument("--parts", default="store,attention,attn_graph,gemm")
    a = ap.parse_args()
    out = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
           "torch": torch.__version__, "cudnn": torch.backends.cudnn.version()}
    parts = a.parts.split(",")
    if "store" in parts:
        store_writes(out, a.shm)
    if "warm" in parts:
        warm_reserve(out, a.shm)
    if "sources" in parts:
        write_sources(out, a.shm)
    if "commit" in parts:
        store_commit(out, a.shm)
    if "attention" in parts:
        attention(out)
    if "attn_graph" in parts:
        attention_in_graphs(out)
    if "gemm" in parts:
        gemms(out)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "probe_kernels.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
