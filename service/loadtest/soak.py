"""Soak test: many distinct images through the load tool while readers read the store; then the
server's log, health, memory and file descriptors. One JSON report and a short markdown table.

    # start the server itself (on 127.0.0.1, a port the kernel picks, a fresh store under /dev/shm):
    qwen3vl-encoder soak --serve "--model tiny --device cpu --store-capacity-bytes 4000000 \\
        --store-min-residency-s 1" --images 2000 --out-dir soak-out
    # or a server that is already running:
    qwen3vl-encoder soak --url http://127.0.0.1:8080 --store-root /dev/shm/qwen3vl-encoder-cache \\
        --server-log server.log --server-pid 1234 --images 100000 --processes 4 --concurrency 64 \\
        --verify-every 100 --out-dir soak-out

(`python -m service soak ...` is the same; `make soak` is the scaled-down soak that CI runs.)

What runs: `qwen3vl-encoder loadtest` with every image distinct, every --replay-every'th answered image read
back from the store as a consumer reads it (shape, grid, finite values) and every --verify-every'th
replay compared with a float32 reference of the same weights (the service's own tower on the CPU).
Meanwhile --readers threads (in a process of their own) read random entries of the store, pausing
--read-pause-ms between reads: a read that races an eviction may find the entry gone, and one that
races a write may find its directory before its file (both counted as `vanished`, which is fine); a
file that does not parse, does not match its own metadata, holds non-finite values, or
reads back different bytes for the same key is `inconsistent`, which must never happen. The server
processes' memory (RSS) and open file descriptors are sampled throughout. After the load: /health,
the store's eviction count (/metrics), temp files left in the store, and the server log scanned for
tracebacks and CUDA errors (after the server stopped too, with --serve).

Exit status 0 when every check passed (see `checks` in the report), 1 when one failed, 2 when the
server could not be started or reached.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import multiprocessing
import os
import platform
import re
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path

import httpx

from service.loadtest import cli as loadtest
from service.loadtest.readers import readers_main
from service.loadtest.report import strict_json
from service.loadtest.resources import Sampler, plot_resources, windows
from service.loadtest.server import Server, serve_settings

# Lines of a server log that mean something went wrong inside it.
LOG_PROBLEMS = re.compile(r"Traceback \(most recent call last\)|CUDA error|cudaError|illegal memory access|"
                          r"device-side assert|Segmentation fault|core dumped")


def scan_log(path: Path) -> dict:
    """Lines of the server log that name a traceback or a CUDA error (the first few, verbatim)."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return {"scanned": False, "tracebacks": None, "cuda_errors": None, "first": []}
    hits = [line for line in lines if LOG_PROBLEMS.search(line)]
    return {"scanned": True, "lines": len(lines), "tracebacks": sum("Traceback" in h for h in hits),
            "cuda_errors": sum("Traceback" not in h for h in hits), "first": hits[:5]}


def temp_files(root: Path) -> list[str]:
    """Store temp files (a writer's `.tmp-*`, in the root or a key directory): none may outlive a write."""
    found = [str(p) for p in root.glob(".tmp*")]
    found += [str(p) for p in root.glob("*/.tmp*")]
    return found


def metric(text: str, name: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.split()[-1])
    return None


def build_parser() -> argparse.ArgumentParser:
    """The soak's flags: `qwen3vl-encoder soak` hands its arguments to this parser as they are."""
    p = argparse.ArgumentParser(prog="qwen3vl-encoder soak", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--serve", metavar="ARGS", help="start `python -m service serve ARGS` on 127.0.0.1 (quote ARGS)")
    where.add_argument("--url", help="a running server (loopback)")
    p.add_argument("--store-root", type=Path, help="the server's --store (with --serve: its --store, or a fresh one)")
    p.add_argument("--server-log", type=Path, help="--url: the server's log, to scan")
    p.add_argument("--server-pid", type=int, help="--url: the server's pid, to sample its RSS and file descriptors")
    p.add_argument("--images", type=int, default=2000, help="distinct images to encode")
    p.add_argument("--duration-s", type=float, default=None,
                   help="stop starting requests after this long (then --images is only an upper bound): a soak by time")
    p.add_argument("--images-per-request", type=int, default=1)
    p.add_argument("--sizes", default="256x256")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--processes", type=int, default=1, help="load-tool client processes")
    p.add_argument("--replay-every", type=int, default=10)
    p.add_argument("--verify-every", type=int, default=1, help="verify every Kth replay against the float32 reference")
    p.add_argument("--readers", type=int, default=2, help="threads reading the store meanwhile (0: none)")
    p.add_argument("--read-pause-ms", type=float, default=1.0,
                   help="each reader's pause between reads (keeps a small machine's cores for the server)")
    p.add_argument("--sample-interval-s", type=float, default=0.5, help="RSS / file-descriptor sampling period")
    p.add_argument("--ready-timeout-s", type=float, default=600.0, help="--serve: how long the server may take to start")
    p.add_argument("--fault-inject", metavar="SPEC", help="--serve only, the control run: QVE_FAULT_INJECT for the server "
                   "(e.g. stall=20000000,no-fence on cuda), to show the soak catches what a missing fence corrupts")
    p.add_argument("--loadtest-args", default="",
                   help="more `qwen3vl-encoder loadtest` flags (quoted), e.g. '--model DIR'")
    p.add_argument("--out-dir", type=Path, default=Path("soak-out"))
    return p


def main(argv: list[str] | None = None) -> int:
    """`qwen3vl-encoder soak ARGS`: the server (started here, or the one at --url), the soak, its report; the exit
    status (the module's docstring lists them)."""
    args = build_parser().parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else list(argv)  # for the report
    args.out_dir.mkdir(parents=True, exist_ok=True)
    started = datetime.datetime.now(datetime.timezone.utc)
    server, made_root, serve_args = None, None, []
    reference_args: list[str] = []
    log = args.server_log
    try:
        if args.serve is not None:
            serve_args = shlex.split(args.serve)
            try:
                settings = serve_settings(serve_args)
            except ValueError as e:  # pydantic's ValidationError: a bad value in ARGS
                print(f"error: --serve {args.serve!r}: {e}", file=sys.stderr)
                return 2
            explicit_store = "--store" in serve_args or any(a.startswith("--store=") for a in serve_args)
            if explicit_store:
                store = settings.store
            else:  # a fresh store of its own, so nothing from an earlier run is a hit or takes room
                base = Path("/dev/shm") if os.access("/dev/shm", os.W_OK) else None
                made_root = Path(tempfile.mkdtemp(prefix="qve-soak-", dir=base))
                store = made_root / "store"
                serve_args += ["--store", str(store)]
            # The reference must be the server's weights and preprocessing.
            reference_args = ["--model", settings.model, "--model-seed", str(settings.seed)]
            for flag, value in (("--min-pixels", settings.min_pixels), ("--max-pixels", settings.max_pixels)):
                if value is not None:
                    reference_args += [flag, str(value)]
            log = args.out_dir / "server.log"
            print(f"starting: python -m service serve {shlex.join(serve_args)}", file=sys.stderr, flush=True)
            server = Server(serve_args, log, args.ready_timeout_s, args.fault_inject)
            url, pid = server.url, server.proc.pid
        else:
            if not loadtest.is_loopback_url(args.url):
                print(f"error: {args.url} is not a loopback address", file=sys.stderr)
                return 2
            if args.store_root is None:
                print("error: --url needs --store-root (the server's --store), for the replays and the readers", file=sys.stderr)
                return 2
            url, pid, store = args.url, args.server_pid, args.store_root
        return _soak(args, url, pid, Path(store), server, log, serve_args, reference_args, started)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        if server is not None:
            server.stop()
        if made_root is not None:
            shutil.rmtree(made_root, ignore_errors=True)


def _soak(args, url: str, pid: int | None, store: Path, server: Server | None, log: Path | None,
          serve_args: list[str], reference_args: list[str], started) -> int:
    sampler = Sampler(pid, args.sample_interval_s) if pid else None
    ctx = multiprocessing.get_context("spawn")
    stop_readers, reader_out = ctx.Event(), ctx.Queue()
    readers = None
    if args.readers:
        readers = ctx.Process(target=readers_main, args=(str(store), args.readers, args.read_pause_ms / 1000,
                                                         stop_readers, reader_out))
        readers.start()
    if sampler:
        sampler.start()

    lt_report = args.out_dir / "loadtest.json"
    requests = math.ceil(args.images / args.images_per_request)
    lt_argv = ["--url", url, "--requests", str(requests), "--duration-s", str(args.duration_s or 1e9),
               "--concurrency", str(args.concurrency),
               "--processes", str(args.processes), "--images-per-request", str(args.images_per_request),
               "--sizes", args.sizes, "--replay-every", str(args.replay_every), "--store-root", str(store),
               "--verify", "--verify-every", str(args.verify_every), "--out", str(lt_report),
               *reference_args, *shlex.split(args.loadtest_args)]
    print(f"load: qwen3vl-encoder loadtest {shlex.join(lt_argv)}", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    try:
        lt_rc = loadtest.main(lt_argv)
    finally:
        load_s = time.monotonic() - t0
        stop_readers.set()
        reader_tally = None
        if readers:
            try:
                reader_tally = reader_out.get(timeout=60)
            except Exception:  # queue.Empty: the reader process died; the check below fails on it
                reader_tally = {"reads": 0, "ok": 0, "vanished": 0, "inconsistent": 0,
                                "problems": [f"the reader process exited with status {readers.exitcode}"]}
        if readers:
            readers.join(30)
        if sampler:
            sampler.stopping.set()
            sampler.join(10)

    headers = {"Authorization": f"Bearer {os.environ['QVE_API_KEY'].split(',')[0]}"} if os.environ.get("QVE_API_KEY") else {}
    try:
        health = httpx.get(url + "/health", timeout=10).status_code
        metrics_text = httpx.get(url + "/metrics", timeout=10, headers=headers).text
    except httpx.HTTPError as e:
        health, metrics_text = f"error: {type(e).__name__}", ""
    tmp_after_load = temp_files(store)
    exit_status, shutdown_clean = None, None
    if server is not None:
        exit_status = server.stop()
        text = log.read_text(errors="replace")
        shutdown_clean = "Application shutdown complete" in text
    tmp_after_stop = temp_files(store) if server is not None else None
    log_scan = scan_log(log) if log else {"scanned": False, "tracebacks": None, "cuda_errors": None, "first": []}

    lt = json.loads(lt_report.read_text()) if lt_report.exists() else None
    s = lt["summary"] if lt else {}
    samples = sampler.samples if sampler else []
    report = {
        "date": started.isoformat(timespec="seconds"),
        "machine": {"host": platform.node(), "cpu": _cpu_name(), "cores": os.cpu_count(), "python": platform.python_version()},
        "command": "qwen3vl-encoder soak " + shlex.join(args.argv),
        "server": {"url": url, "serve_args": serve_args, "ready": lt["server"] if lt else None, "log": str(log) if log else None,
                   "exit_status": exit_status, "shutdown_clean": shutdown_clean},
        "load": {"loadtest_exit_status": lt_rc, "report": str(lt_report), "plot": lt.get("plot") if lt else None,
                 "load_wall_s": s.get("wall_s"), "tool_s": round(load_s, 2),  # the load itself; with set-up
                 "images_requested": args.images, "requests": s.get("requests"),
                 "ok_images": s.get("ok_images"), "cached_images": s.get("cached_images"),
                 "non_2xx": (s.get("requests", 0) - s.get("ok_requests", 0)), "status_counts": s.get("status_counts"),
                 "retries": s.get("retries"), "images_per_s": s.get("images_per_s"), "latency_ms": s.get("latency_ms"),
                 "interrupted": lt.get("interrupted") if lt else None},
        "replay": lt.get("replay") if lt else None,
        "verify": lt.get("verify") if lt else None,
        "readers": {"threads": args.readers, **reader_tally} if reader_tally else None,
        "store": {"root": str(store), "evictions": metric(metrics_text, "qve_store_evictions"),
                  "items": metric(metrics_text, "qve_store_items"), "temp_files_after_load": tmp_after_load,
                  "temp_files_after_stop": tmp_after_stop},
        "health_after": health,
        "server_log": log_scan,
        "resources": {"interval_s": args.sample_interval_s, "columns": ["t_s", "rss_mib", "fds", "processes"],
                      "rss_mib": windows(samples, 1), "fds": windows(samples, 2), "samples": samples},
    }
    report["checks"] = checks(report, args)
    report["passed"] = all(report["checks"].values())
    report["resources"]["plot"] = plot_resources(args.out_dir / "resources.png", samples)
    (args.out_dir / "soak.json").write_text(json.dumps(strict_json(report), indent=2) + "\n")
    table = markdown(report)
    (args.out_dir / "soak.md").write_text(table + "\n")
    print(table)
    return 0 if report["passed"] else 1


def checks(r: dict, args) -> dict[str, bool]:
    """The pass criteria, each by name (all must hold)."""
    load, replay, verify, readers, store = r["load"], r["replay"] or {}, r["verify"] or {}, r["readers"], r["store"]
    c = {
        # (by time: every request sent, all its images; by count: all --images)
        "all images encoded": (load["ok_images"] or 0) >= (args.images if args.duration_s is None else
                                                           (load["requests"] or 0) * args.images_per_request)
                              and (load["ok_images"] or 0) > 0 and not load["interrupted"],
        "0 non-2xx": load["non_2xx"] == 0,
        "replays all ok": replay.get("wrong") == 0 and replay.get("missing") == 0 and replay.get("ok", 0) > 0,
        "verified all ok": verify.get("wrong") == 0 and verify.get("ok", 0) > 0,
        "/health 200 after": r["health_after"] == 200,
        "no temp files left": not store["temp_files_after_load"] and not store["temp_files_after_stop"],
    }
    rss, fds = r["resources"]["rss_mib"], r["resources"]["fds"]
    if rss["early_median"] is not None and args.duration_s is not None:
        # A soak by time says whether memory and descriptors stay flat: the late window's median RSS within 10%
        # of the early one's (the allocator's sawtooth, tests/system/test_soak.py), the late max of descriptors within 8.
        c["RSS flat"] = rss["late_median"] <= 1.10 * rss["early_median"]
        c["fds flat"] = fds["late_max"] <= fds["early_max"] + 8
    if readers is not None:
        c["0 inconsistent reads"] = readers["inconsistent"] == 0 and readers["reads"] > 0
    if r["server_log"]["scanned"]:
        c["no tracebacks or CUDA errors in the log"] = r["server_log"]["tracebacks"] == 0 and r["server_log"]["cuda_errors"] == 0
    if r["server"]["shutdown_clean"] is not None:
        c["clean shutdown"] = bool(r["server"]["shutdown_clean"])
    return c


def markdown(r: dict) -> str:
    load, rep, ver, rd, st, res = r["load"], r["replay"] or {}, r["verify"] or {}, r["readers"], r["store"], r["resources"]
    lat = load["latency_ms"] or {}
    ready = r["server"]["ready"] or {}

    def num(x, fmt="{:.1f}"):
        return "-" if x is None else fmt.format(x)

    rows = [
        ("date", r["date"]),
        ("machine", f"{r['machine']['cpu']} ({r['machine']['cores']} cores)"),
        ("server", f"{ready.get('model')} on {ready.get('device')} ({ready.get('dtype')})"),
        ("images", f"{load['ok_images']} encoded of {load['images_requested']} requested, {load['cached_images']} cached; "
                   f"{load['requests']} requests, non-2xx {load['non_2xx']}, retries {load['retries']}"),
        ("throughput", f"{num(load['images_per_s'])} img/s over {num(load['load_wall_s'], '{:.1f}')} s; latency p50 {num(lat.get('p50'))} ms, "
                       f"p99 {num(lat.get('p99'))} ms"),
        ("replayed (every 10th)" if rep.get("every") == 10 else f"replayed (every {rep.get('every')})",
         f"{rep.get('ok')} ok, {rep.get('missing')} missing, {rep.get('wrong')} wrong"),
        ("verified vs float32", f"{ver.get('ok')} ok, {ver.get('wrong')} wrong; worst rel. L2 error "
                                f"{num(ver.get('worst_rel_err'), '{:.2e}')} (tolerance {ver.get('tolerance')})"),
    ]
    if rd:
        rows.append(("store readers", f"{rd['reads']} reads on {rd['threads']} threads: {rd['ok']} ok, "
                                      f"{rd['vanished']} vanished (raced an eviction or a write), {rd['inconsistent']} inconsistent"))
    rows += [
        ("store", f"{num(st['evictions'], '{:.0f}')} evictions; temp files left: {len(st['temp_files_after_load'])} after "
                  f"the load" + ("" if st["temp_files_after_stop"] is None else f", {len(st['temp_files_after_stop'])} after stop")),
        ("server RSS MiB", f"early {num(res['rss_mib']['early_median'])} -> late {num(res['rss_mib']['late_median'])} "
                           f"(medians, {res['rss_mib']['samples']} samples)"),
        ("server open fds", f"early max {num(res['fds']['early_max'], '{:.0f}')} -> late max {num(res['fds']['late_max'], '{:.0f}')}"),
        ("server log", "not scanned" if not r["server_log"]["scanned"] else
         f"{r['server_log']['tracebacks']} tracebacks, {r['server_log']['cuda_errors']} CUDA errors"),
        ("/health after", str(r["health_after"])),
        ("result", "PASSED" if r["passed"] else "FAILED: " + ", ".join(k for k, ok in r["checks"].items() if not ok)),
    ]
    return "| | |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in rows)


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


if __name__ == "__main__":
    sys.exit(main())
