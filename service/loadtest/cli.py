"""Load test for the encoder service: distinct images over HTTP, live progress, a JSON report and a plot.

    qwen3vl-encoder loadtest                                  # a short run against http://127.0.0.1:8080
    qwen3vl-encoder loadtest --concurrency 64 --requests 20000 --processes 4 --out run.json   # + run.png
    qwen3vl-encoder loadtest --rate 50 --duration-s 60        # open loop: Poisson arrivals, 50 requests/s
    qwen3vl-encoder loadtest --replay-every 10 --verify --store-root /dev/shm/qwen3vl-encoder-cache

(`python -m service loadtest ...` is the same; `make loadtest ARGS="..."` runs it against URL.)

Load. Closed loop by default: --concurrency requests in flight, the next one sent as soon as one is
answered. `--rate R` is an open loop instead: requests arrive as a Poisson process at R per second
however long the answers take (what clients see under an offered load). `--processes N` spreads the
load over N client processes, for when one cannot saturate the server.

Images. Every image is distinct by default (a fresh seed per run, recorded in the report), so nothing
is a cache hit; helper processes build them before each request's clock starts, so latency is the
service's alone. `--repeat` cycles one image per size (the cache-hit path); `--images DIR` sends your
own files instead (cycled: from the second pass on they are cache hits).

Videos. `--generated-videos N` puts N clips in each request, made here with PyAV (H.264 in
MP4, a pan across a generated picture: --video-size, --video-frames, --video-fps; distinct per request
unless --repeat), `--videos DIR` sends your files instead (--videos-per-request, cycled), after the
request's images (`--images-per-request 0`: videos only). The summary then gives videos/s, the
frames/s of the frames the encoder sampled (its answers' frames_indices) and tokens/s beside images/s.

Checks. `--replay-every N` reads every Nth answered image back from the store the way a consumer does
(vLLM's ECExampleConnector reads `<store root>/<key>/encoder_cache.safetensors`; here with the
project's reader, service.store.format.read_embeddings) and checks it against the answer: shape, grid_thw,
deepstack levels, dtype, finite values. `--verify` also compares those embeddings with float32 ones
computed here, on the CPU, by the service's own tower on the same weights (tests/unit/engine/test_core.py and
tests/system/test_server.py hold that tower to transformers within 1e-5), as a relative L2 error.

Before any load, GET /ready must answer 200: a server still starting is waited for (--wait-ready, 60 s),
and one that is not there, or not ready in time, is one clear line and exit status 2. The run stops
after --requests requests or --duration-s seconds, whichever comes first (requests in flight then are
awaited). Ctrl-C stops it early and prints the partial summary. Exit status: 0 done; 1 no request
succeeded, or a replayed or verified embedding was wrong; 2 bad arguments or no ready server;
130 interrupted. A request that fails on a reused keep-alive connection (the server closed it while
idle) is sent once more; the report counts these retries.

NOTE: load tests target this machine only. A URL whose host is not loopback (127.0.0.0/8, ::1,
localhost) is refused unless --allow-remote is given.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import secrets
import sys
from pathlib import Path
from urllib.parse import urlsplit

from service.loadtest.checks import VERIFY_TOLERANCE, Reference, Verifier, reference_model_from_id
from service.loadtest.driver import NotReady, preflight, run_load, run_videos
from service.loadtest.media import IMAGE_SUFFIXES, PATTERNS, VIDEO_SUFFIXES, image_files, parse_sizes, video_files
from service.loadtest.plot import write_plot
from service.loadtest.report import build_report, format_table, percentile, summarize


def is_loopback_url(url: str) -> bool:
    """True if the URL's host is a loopback address or 'localhost' (no DNS lookup is made)."""
    host = urlsplit(url).hostname
    if host is None:
        return False
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def build_parser() -> argparse.ArgumentParser:
    """The load test's flags: `qwen3vl-encoder loadtest` hands its arguments to this parser as they are."""
    p = argparse.ArgumentParser(prog="qwen3vl-encoder loadtest", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8080", help="the encoder service (loopback unless --allow-remote)")
    p.add_argument("--api-key", default=(os.environ.get("QVE_API_KEY") or "").split(",")[0] or None,
                   help="sent as Authorization: Bearer (default: the first of $QVE_API_KEY)")
    load = p.add_argument_group("load")
    load.add_argument("--api", choices=("encode", "chat"), default="encode",
                      help="encode: POST /encode; chat: POST /v1/chat/completions as vLLM's EPD proxy posts it to its "
                      "encoder (the media as a chat message's parts, max_tokens 1)")
    load.add_argument("--concurrency", type=int, default=4, help="closed loop: requests in flight")
    load.add_argument("--rate", type=float, default=0.0, help="open loop instead: Poisson arrivals, requests/s")
    load.add_argument("--max-in-flight", type=int, default=1024, help="--rate: arrivals wait beyond this many in flight")
    load.add_argument("--requests", type=int, default=200, help="stop after this many requests")
    load.add_argument("--duration-s", type=float, default=10.0, help="stop starting requests after this long")
    load.add_argument("--processes", type=int, default=1, help="client processes (when one cannot saturate the server)")
    load.add_argument("--timeout-s", type=float, default=300.0, help="per-request timeout")
    load.add_argument("--wait-ready", type=float, default=60.0, metavar="SECONDS",
                      help="wait this long for a server still starting to answer /ready 200 (0: not at all)")
    img = p.add_argument_group("images")
    img.add_argument("--images-per-request", type=int, default=1, help="images in each request (0: videos only)")
    img.add_argument("--sizes", default="256x256", help="WIDTHxHEIGHT list, cycled over the images")
    mode = img.add_mutually_exclusive_group()
    mode.add_argument("--unique", dest="unique", action="store_true", default=True, help="no two images alike")
    mode.add_argument("--repeat", dest="unique", action="store_false", help="one image per size, repeated (cache hits)")
    mode.add_argument("--images", metavar="DIR", help="send the image files in DIR (cycled) instead of generated ones")
    img.add_argument("--pattern", choices=PATTERNS, default="gradient", help="photo needs scikit-image")
    img.add_argument("--format", choices=("png", "jpeg"), default="png", help="how generated images are encoded")
    img.add_argument("--seed", type=int, default=None, help="image seed (default: a fresh one per run, in the report)")
    img.add_argument("--gen-workers", type=int, default=max(1, min(8, (os.cpu_count() or 2) // 2)),
                     help="processes that build the images (split over the client processes)")
    vid = p.add_argument_group("videos")
    vids = vid.add_mutually_exclusive_group()
    vids.add_argument("--generated-videos", type=int, default=0, metavar="N",
                      help="N clips in each request, made here with PyAV (H.264 in MP4)")
    vids.add_argument("--videos", metavar="DIR", help=f"send the video files in DIR ({', '.join(VIDEO_SUFFIXES)}), cycled")
    vid.add_argument("--videos-per-request", type=int, default=1, help="--videos: files in each request")
    vid.add_argument("--video-size", default="320x240", help="generated clips: WIDTHxHEIGHT (even numbers)")
    vid.add_argument("--video-frames", type=int, default=24, help="generated clips: frames")
    vid.add_argument("--video-fps", type=int, default=8, help="generated clips: frames per second")
    chk = p.add_argument_group("checks")
    chk.add_argument("--replay-every", type=int, default=0, metavar="N", help="read every Nth answered image back from the store")
    chk.add_argument("--store-root", type=Path, default=None, help="the server's --store (default: its default)")
    chk.add_argument("--verify", action="store_true", help="compare replayed embeddings with a float32 reference")
    chk.add_argument("--verify-every", type=int, default=1, metavar="K", help="verify every Kth replay")
    chk.add_argument("--verify-device", default="cpu",
                     help="--verify: where the float32 reference runs (cuda: no TF32; a 4B reference on a CPU takes seconds per image)")
    chk.add_argument("--verify-tol", type=float, default=None, help="relative L2 error allowed (default: by the server's dtype)")
    chk.add_argument("--model", default=None, help="--verify: the server's --model (default: the preset /ready names)")
    chk.add_argument("--model-seed", type=int, default=None, help="--verify: the server's --seed (default: from /ready)")
    chk.add_argument("--min-pixels", type=int, default=None, help="--verify: the server's --min-pixels (default: from /ready)")
    chk.add_argument("--max-pixels", type=int, default=None, help="--verify: the server's --max-pixels (default: from /ready)")
    rep = p.add_argument_group("report")
    rep.add_argument("--out", type=Path, help="write the JSON report here (and the plot beside it, .png)")
    rep.add_argument("--plot", type=Path, help="write the PNG plot here (default: --out with .png)")
    rep.add_argument("--quiet", action="store_true", help="no live progress")
    p.add_argument("--allow-remote", action="store_true", help="allow a non-loopback --url (not for shared machines)")
    return p


def check_args(p: argparse.ArgumentParser, args) -> None:
    if not args.allow_remote and not is_loopback_url(args.url):
        p.error(f"{args.url} is not a loopback address; load tests target 127.0.0.1 (or pass --allow-remote)")
    with_videos = bool(args.generated_videos or args.videos)
    if min(args.concurrency, args.requests, args.images_per_request + with_videos, args.gen_workers, args.processes,
           args.max_in_flight) < 1 or args.duration_s <= 0 or args.rate < 0 or args.replay_every < 0 or args.verify_every < 1:
        p.error("--concurrency, --requests, --images-per-request (0 with videos), --gen-workers, --processes, "
                "--max-in-flight, --duration-s and --verify-every must be positive; --rate and --replay-every not negative")
    if not args.rate and args.concurrency < args.processes:
        p.error(f"--concurrency {args.concurrency} is less than --processes {args.processes}: each process needs one")
    if args.api == "chat" and args.replay_every:
        p.error("--replay-every reads answered keys back from the store; a chat answer names none (--api encode)")
    if args.verify and not args.replay_every:
        p.error("--verify checks replayed embeddings: give --replay-every N too")
    if args.pattern == "photo":
        try:
            import skimage.data  # noqa: F401
        except ImportError:
            p.error("--pattern photo needs scikit-image (pip install scikit-image)")
    for flag, folder, files, suffixes in (("--images", args.images, image_files, IMAGE_SUFFIXES),
                                          ("--videos", args.videos, video_files, VIDEO_SUFFIXES)):
        if folder and (not Path(folder).is_dir() or not files(Path(folder))):
            p.error(f"{flag} {folder}: not a directory with {flag[2:-1]} files ({', '.join(suffixes)})")
    try:
        parse_sizes(args.sizes)
        ((vw, vh),) = parse_sizes(args.video_size)
    except ValueError as e:
        p.error(str(e))
    if args.generated_videos < 0 or min(args.videos_per_request, args.video_frames, args.video_fps) < 1 or vw % 2 or vh % 2:
        p.error("--generated-videos must not be negative; --videos-per-request, --video-frames and --video-fps must be "
                "positive; --video-size even (H.264 in yuv420p)")
    if with_videos:
        try:
            import av  # noqa: F401
        except ImportError:
            p.error("videos need PyAV, a dependency of this project: reinstall it (make install-serve, or pip install -e .)")


def main(argv: list[str] | None = None) -> int:
    """`qwen3vl-encoder loadtest ARGS`: the run, its summary, and the report and plot when asked; the exit status
    (the module's docstring lists them)."""
    p = build_parser()
    args = p.parse_args(argv)
    check_args(p, args)
    if args.seed is None:
        args.seed = secrets.randbits(32)
    if args.replay_every and args.store_root is None:
        from service.store.options import default_store_dir

        args.store_root = default_store_dir()
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        server = preflight(args.url, headers, args.wait_ready)
    except NotReady as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    verifier = None
    if args.verify:
        model, seed = args.model, args.model_seed
        if model is None:
            preset = reference_model_from_id(str(server.get("model", "")))
            if preset is None:
                print(f"error: the server runs {server.get('model')!r}, not a preset: pass its checkpoint directory "
                      "as --model for --verify", file=sys.stderr)
                return 2
            model, seed = preset[0], preset[1] if seed is None else seed
        # The server's pixel bounds from /ready unless given (a server started with --max-pixels resizes
        # differently from the preset's defaults).
        min_pixels = args.min_pixels if args.min_pixels is not None else server.get("min_pixels")
        max_pixels = args.max_pixels if args.max_pixels is not None else server.get("max_pixels")
        reference = Reference(model, seed or 0, min_pixels, max_pixels, device=args.verify_device)
        if reference.model_id != server.get("model"):
            print(f"error: the reference model {reference.model_id!r} is not the server's {server.get('model')!r}: "
                  "pass the server's --model (and --model-seed)", file=sys.stderr)
            return 2
        tol = args.verify_tol if args.verify_tol is not None else VERIFY_TOLERANCE.get(server.get("dtype"), 3e-2)
        verifier = Verifier(reference, tol)

    run = run_load(args, verifier, quiet=args.quiet)
    if verifier is not None:
        try:
            verifier.finish(skip_pending=run.interrupted)
        except KeyboardInterrupt:
            run.interrupted = True
    summary = summarize(run.results, run.wall_s)

    plot = args.plot or (args.out.with_suffix(".png") if args.out else None)
    plot_written = None
    if args.out or plot:
        title = (f"{server.get('model')} on {server.get('device')} ({server.get('dtype')}): "
                 + (f"--rate {args.rate:g}" if args.rate else f"--concurrency {args.concurrency}")
                 + f", {args.images_per_request} image(s)/request, {args.sizes}"
                 + (f", {run_videos(args)} video(s)/request" if run_videos(args) else ""))
        report = build_report(args, server, summary, run, verifier, None)
        if plot:
            plot_written = write_plot(plot, report, title)
            report["plot"] = plot_written
        if args.out:
            args.out.write_text(json.dumps(report, indent=2) + "\n")

    if run.interrupted:
        print(f"interrupted: partial results ({run.cancelled} requests in flight were cancelled)")
    print(format_table(summary, run.replay if args.replay_every else None, verifier.tally if verifier else None))
    for problem in (run.replay.problems + (verifier.tally.problems if verifier else []))[:5]:
        print(f"  wrong: {problem}")
    for err in run.client_errors:
        print(f"  client failed: {err}")
    if args.rate and run.lags and percentile(run.lags, 99) > 0.1:
        print(f"note: requests went out up to {percentile(run.lags, 99) * 1000:.0f} ms (p99) behind the Poisson schedule: "
              "the client could not keep up; add --processes or --gen-workers")
    if args.out:
        print(f"report: {args.out}")
    if plot:
        print(f"plot: {plot_written}" if plot_written else
              "no plot written: matplotlib is not installed (pip install 'qwen3vl-encoder-service[loadtest]')")

    if run.interrupted:
        return 130
    wrong = run.replay.wrong + (verifier.tally.wrong if verifier else 0)
    return 0 if summary.ok_requests > 0 and wrong == 0 and not run.client_errors else 1
