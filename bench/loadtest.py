"""Load test for the encoder service: distinct images over HTTP, live progress, a JSON report and a plot.

    python bench/loadtest.py                                  # a short run against http://127.0.0.1:8080
    python bench/loadtest.py --concurrency 64 --requests 20000 --processes 4 --out run.json   # + run.png
    python bench/loadtest.py --rate 50 --duration-s 60        # open loop: Poisson arrivals, 50 requests/s
    python bench/loadtest.py --replay-every 10 --verify --store-root /dev/shm/qwen3vl-encoder-cache

Load. Closed loop by default: --concurrency requests in flight, the next one sent as soon as one is
answered. `--rate R` is an open loop instead: requests arrive as a Poisson process at R per second
however long the answers take (what clients see under an offered load). `--processes N` spreads the
load over N client processes, for when one cannot saturate the server.

Images. Every image is distinct by default (a fresh seed per run, recorded in the report), so nothing
is a cache hit; helper processes build them before each request's clock starts, so latency is the
service's alone. `--repeat` cycles one image per size (the cache-hit path); `--images DIR` sends your
own files instead (cycled: from the second pass on they are cache hits).

Videos (issue 22). `--generated-videos N` puts N clips in each request, made here with PyAV (H.264 in
MP4, a pan across a generated picture: --video-size, --video-frames, --video-fps; distinct per request
unless --repeat), `--videos DIR` sends your files instead (--videos-per-request, cycled), after the
request's images (`--images-per-request 0`: videos only). The summary then gives videos/s, the
frames/s of the frames the encoder sampled (its answers' frames_indices) and tokens/s beside images/s.

Checks. `--replay-every N` reads every Nth answered image back from the store the way a consumer does
(vLLM's ECExampleConnector reads `<store root>/<key>/encoder_cache.safetensors`; here with the
project's reader, service.store.format.read_embeddings) and checks it against the answer: shape, grid_thw,
deepstack levels, dtype, finite values. `--verify` also compares those embeddings with float32 ones
computed here, on the CPU, by the service's own tower on the same weights (tests/engine/test_core.py and
tests/test_server.py hold that tower to transformers within 1e-5), as a relative L2 error.

Before any load, GET /ready must answer 200 (one clear line and exit status 2 otherwise). The run stops
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
import asyncio
import base64
import functools
import io
import ipaddress
import json
import logging
import math
import mimetypes
import multiprocessing
import os
import queue
import random
import secrets
import signal
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import numpy as np

# Run from anywhere without installing: `service` (the store reader, the reference tower) is this
# checkout's, not whatever an editable install elsewhere points at.
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(1, str(ROOT))

PATTERNS = ("gradient", "noise", "photo")
# scikit-image's bundled colour photographs (no download needed).
PHOTOS = ("astronaut", "coffee", "chelsea", "rocket", "immunohistochemistry", "hubble_deep_field")
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp", ".gif", ".bmp", ".tif", ".tiff")
VIDEO_SUFFIXES = (".mp4", ".webm", ".mkv", ".avi", ".mov", ".m4v")
# Relative L2 error allowed between a stored embedding and the float32 reference, by the server's dtype.
# float32: the same arithmetic (CPU: ~1e-7; CUDA float32 differs in summation order only). bfloat16:
# bench/RESULTS.md measured 8.4e-3 (compiled, graphs) and 1.05e-2 (eager) on photographs; the CUDA tests allow 2e-2.
# A wrong or torn embedding (another image's rows, garbage) is off by O(1), far above either.
VERIFY_TOLERANCE = {"float32": 1e-3, "bfloat16": 3e-2}
PROGRESS_EVERY_S = 5.0  # plain progress lines when stderr is not a terminal (CI logs)


# ---- pure helpers (importable, tested without a server) --------------------------------------------
def parse_sizes(text: str) -> list[tuple[int, int]]:
    """'448x448,1024x768' -> [(448, 448), (1024, 768)] as (width, height)."""
    sizes = []
    for part in text.split(","):
        w, sep, h = part.strip().lower().partition("x")
        if not sep or not w.isdigit() or not h.isdigit() or int(w) == 0 or int(h) == 0:
            raise ValueError(f"bad size {part!r}: expected WIDTHxHEIGHT, e.g. 448x448")
        sizes.append((int(w), int(h)))
    return sizes


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


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]) of unsorted values; NaN for no values."""
    if not values:
        return math.nan
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def image_seed(request_index: int, image_index: int, images_per_request: int, n_sizes: int, unique: bool) -> int:
    """Distinct per image when unique; otherwise one seed per size slot, so images repeat exactly."""
    flat = request_index * images_per_request + image_index
    return flat if unique else flat % n_sizes


def make_image(width: int, height: int, seed: int, pattern: str = "gradient", run_seed: int = 0) -> np.ndarray:
    """An RGB uint8 [height, width, 3] test image; different (run_seed, seed) give different pixels."""
    rng = np.random.default_rng([run_seed, seed])
    if pattern == "noise":
        return rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    if pattern == "gradient":
        y = np.linspace(0.0, 1.0, height, dtype=np.float32)[:, None, None]
        x = np.linspace(0.0, 1.0, width, dtype=np.float32)[None, :, None]
        a, b, c = (rng.uniform(0, 255, size=3).astype(np.float32) for _ in range(3))
        img = a * (1 - x) * (1 - y) + b * x + c * y * (1 - x)
        return np.clip(img, 0, 255).astype(np.uint8)
    if pattern == "photo":
        from PIL import Image
        from skimage import data as skdata  # optional: pip install scikit-image

        photo = getattr(skdata, PHOTOS[seed % len(PHOTOS)])()
        ph, pw = photo.shape[:2]
        # A seed-dependent crop (at least half of each side), resized: distinct, still natural content.
        ch, cw = int(rng.integers(ph // 2, ph + 1)), int(rng.integers(pw // 2, pw + 1))
        top, left = int(rng.integers(0, ph - ch + 1)), int(rng.integers(0, pw - cw + 1))
        crop = Image.fromarray(np.ascontiguousarray(photo[top : top + ch, left : left + cw, :3]))
        return np.asarray(crop.resize((width, height), Image.BICUBIC))
    raise ValueError(f"unknown pattern {pattern!r}; choose from {PATTERNS}")


def encode_image(pixels: np.ndarray, fmt: str = "png") -> tuple[bytes, str]:
    """Compress an RGB array; returns (bytes, MIME type)."""
    from PIL import Image

    buf = io.BytesIO()
    if fmt == "png":
        Image.fromarray(pixels).save(buf, format="PNG", compress_level=1)  # fast; size matters little here
        return buf.getvalue(), "image/png"
    if fmt == "jpeg":
        Image.fromarray(pixels).save(buf, format="JPEG", quality=90)
        return buf.getvalue(), "image/jpeg"
    raise ValueError(f"unknown format {fmt!r}; choose png or jpeg")


def make_video(width: int, height: int, frames: int, fps: int, seed: int, pattern: str = "gradient",
               run_seed: int = 0, x264_preset: str = "ultrafast") -> bytes:
    """An H.264 MP4 clip made with PyAV (no network): `frames` frames of a camera pan, each a width x height
    window one step further across a picture 1.5 times the size (make_image's, for this seed). `x264_preset`:
    libx264's speed preset (ultrafast: no B-frames, no CABAC; `fast` and slower encode as cameras and
    sites do, and decode slower)."""
    import av
    from fractions import Fraction

    big = make_image(width * 3 // 2, height * 3 // 2, seed, pattern, run_seed)
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as out:
        stream = out.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.time_base = Fraction(1, fps)
        stream.options = {"preset": x264_preset, "crf": "23"}
        for i in range(frames):
            x = (big.shape[1] - width) * i // max(1, frames - 1)
            y = (big.shape[0] - height) * i // max(1, frames - 1)
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(big[y : y + height, x : x + width]), format="rgb24")
            frame.pts = i
            out.mux(stream.encode(frame))
        out.mux(stream.encode(None))
    return buf.getvalue()


def data_url(data: bytes, mime: str) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode('ascii')}"


def is_video_url(url: str) -> bool:
    return url.startswith("data:video/")


def build_payload(urls: list[str]) -> dict:
    """The JSON /encode body (OpenAI content-part shapes) for a list of data URLs: `video_url` parts for
    data:video/... URLs, `image_url` parts for the others."""
    return {"images": [{"type": "video_url", "video_url": {"url": u}} if is_video_url(u)
                       else {"type": "image_url", "image_url": {"url": u}} for u in urls]}


@dataclass
class Result:
    """One request, as the client saw it."""

    status: int | str  # HTTP status, or "error:<ExceptionName>" when no response came back
    latency_s: float
    images: int
    cached: int = 0  # items the service answered from its store
    t_end: float = 0.0  # when the answer came: time.monotonic() in the client, seconds since the start in reports
    retried: bool = False  # sent twice: the first try met a stale keep-alive connection
    error: str | None = None  # the error answer's `error.code`, or the exception's message
    videos: int = 0  # of the request's parts, videos (`images` counts the image parts)
    frames: int = 0  # 200 answers: the frames the encoder sampled from the videos (their frames_indices)
    tokens: int = 0  # 200 answers: num_tokens over all items, images and videos


@dataclass
class Summary:
    wall_s: float
    requests: int
    ok_requests: int
    ok_images: int
    cached_images: int
    rejected_429: int
    images_per_s: float
    requests_per_s: float
    latency_ms: dict[str, float]  # of 200 answers: p50, p90, p99, mean, max
    status_counts: dict[str, int] = field(default_factory=dict)
    retries: int = 0  # requests sent a second time after a stale keep-alive connection
    errors: dict[str, int] = field(default_factory=dict)  # "429 overloaded", "error:ReadTimeout ..." -> count
    ok_videos: int = 0
    ok_frames: int = 0  # sampled frames of the videos answered
    ok_tokens: int = 0  # embedding rows answered, images and videos
    videos_per_s: float = 0.0
    frames_per_s: float = 0.0
    tokens_per_s: float = 0.0


def summarize(results: list[Result], wall_s: float) -> Summary:
    ok = [r for r in results if r.status == 200]
    lat = [r.latency_s * 1000 for r in ok]
    counts = Counter(str(r.status) for r in results)
    errors = Counter(f"{r.status} {r.error}" if r.error else str(r.status) for r in results if r.status != 200)
    return Summary(
        wall_s=wall_s,
        requests=len(results),
        ok_requests=len(ok),
        ok_images=sum(r.images for r in ok),
        cached_images=sum(r.cached for r in ok),
        rejected_429=counts.get("429", 0),
        images_per_s=sum(r.images for r in ok) / wall_s if wall_s > 0 else math.nan,
        requests_per_s=len(ok) / wall_s if wall_s > 0 else math.nan,
        latency_ms={
            "p50": percentile(lat, 50),
            "p90": percentile(lat, 90),
            "p99": percentile(lat, 99),
            "mean": sum(lat) / len(lat) if lat else math.nan,
            "max": max(lat) if lat else math.nan,
        },
        status_counts=dict(sorted(counts.items())),
        retries=sum(r.retried for r in results),
        errors=dict(errors.most_common()),
        ok_videos=sum(r.videos for r in ok),
        ok_frames=sum(r.frames for r in ok),
        ok_tokens=sum(r.tokens for r in ok),
        videos_per_s=sum(r.videos for r in ok) / wall_s if wall_s > 0 else math.nan,
        frames_per_s=sum(r.frames for r in ok) / wall_s if wall_s > 0 else math.nan,
        tokens_per_s=sum(r.tokens for r in ok) / wall_s if wall_s > 0 else math.nan,
    )


@dataclass
class Tally:
    """Outcomes of the replays (ok / missing / wrong) or of the verifications (ok / wrong / skipped)."""

    ok: int = 0
    missing: int = 0  # replays: the key was not in the store (evicted, or --store-root is not the server's)
    wrong: int = 0
    skipped: int = 0  # verifications still queued when the run was interrupted
    problems: list[str] = field(default_factory=list)  # the first few, verbatim
    worst_rel_err: float | None = None  # verifications: the largest relative L2 error seen

    def add(self, outcome: str, problem: str = "") -> None:
        setattr(self, outcome, getattr(self, outcome) + 1)
        if problem and len(self.problems) < 10:
            self.problems.append(problem)

    @property
    def total(self) -> int:
        return self.ok + self.missing + self.wrong


def format_table(s: Summary, replay: Tally | None = None, verify: Tally | None = None) -> str:
    lat = s.latency_ms
    rows = [
        ("wall time", f"{s.wall_s:.2f} s"),
        ("requests", f"{s.requests} ({s.ok_requests} ok, {s.rejected_429} rejected with 429)"),
        ("images ok", f"{s.ok_images} ({s.cached_images} cached)"),
        ("throughput", f"{s.images_per_s:.2f} images/s, {s.requests_per_s:.2f} requests/s (over the wall time)"),
        ("latency ms", f"p50 {lat['p50']:.1f}  p90 {lat['p90']:.1f}  p99 {lat['p99']:.1f}  max {lat['max']:.1f}"),
        ("status", ", ".join(f"{k}: {v}" for k, v in s.status_counts.items()) or "-"),
    ]
    if s.ok_tokens:
        rows[3] = ("throughput", rows[3][1] + f", {s.tokens_per_s:.1f} tokens/s")
    if s.ok_videos:
        rows.insert(3, ("videos ok", f"{s.ok_videos} ({s.ok_frames} frames sampled): {s.videos_per_s:.2f} videos/s, "
                                     f"{s.frames_per_s:.1f} frames/s"))
    if s.retries:
        rows.append(("retries", f"{s.retries} (stale keep-alive connections)"))
    if s.errors:
        rows.append(("errors", ", ".join(f"{k}: {v}" for k, v in list(s.errors.items())[:5])))
    if replay is not None:
        rows.append(("replayed", f"{replay.total}: {replay.ok} ok, {replay.missing} missing, {replay.wrong} wrong"))
    if verify is not None:
        worst = "-" if verify.worst_rel_err is None else f"{verify.worst_rel_err:.2e}"
        skipped = f", {verify.skipped} not checked (interrupted)" if verify.skipped else ""
        rows.append(("verified", f"{verify.total}: {verify.ok} ok, {verify.wrong} wrong; worst rel. error {worst}{skipped}"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def timeseries(results: list[Result], wall_s: float, bin_s: float | None = None) -> list[dict]:
    """Per time bin (t = the bin's end, seconds since the start): ok images/s, p50/p99 latency of the
    requests answered in the bin (None when there were none), and each status's count."""
    if wall_s <= 0:
        return []
    bin_s = bin_s or max(1.0, wall_s / 100)
    n = max(1, math.ceil(wall_s / bin_s))
    bins: list[list[Result]] = [[] for _ in range(n)]
    for r in results:
        bins[min(n - 1, max(0, int(r.t_end / bin_s)))].append(r)
    out = []
    for k, rs in enumerate(bins):
        width = min(bin_s, wall_s - k * bin_s) if k == n - 1 else bin_s  # the last bin may be shorter
        lat = [r.latency_s * 1000 for r in rs if r.status == 200]
        images = sum(r.images for r in rs if r.status == 200)
        out.append({
            "t": round(k * bin_s + width, 3),
            "images": images,  # exact: the rate's width may be a fraction of a millisecond in the last bin
            "images_per_s": images / width if width > 0 else 0.0,
            "p50_ms": percentile(lat, 50) if lat else None,
            "p99_ms": percentile(lat, 99) if lat else None,
            "status": dict(sorted(Counter(str(r.status) for r in rs).items())),
        })
    return out


def compare_embeddings(stored: np.ndarray, stored_grid, ref: np.ndarray, ref_grid, tolerance: float) -> tuple[bool, float | None, str]:
    """A stored embedding ([tokens, width], float32) against the reference: (ok, relative L2 error, problem)."""
    if tuple(stored_grid) != tuple(ref_grid):
        return False, None, (f"grid_thw {list(stored_grid)} != reference {list(ref_grid)} (does the reference use the "
                             "server's --min-pixels / --max-pixels?)")
    if stored.shape != ref.shape:
        return False, None, f"shape {list(stored.shape)} != reference {list(ref.shape)}"
    rel = float(np.linalg.norm(stored.astype(np.float64) - ref) / max(np.linalg.norm(ref.astype(np.float64)), 1e-30))
    if not rel <= tolerance:  # NaN fails too
        return False, rel, f"relative L2 error {rel:.3e} > {tolerance:g}"
    return True, rel, ""


def strict_json(obj):
    """NaN/inf -> None, so the report is strict JSON."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: strict_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [strict_json(v) for v in obj]
    return obj


# ---- images ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ImageSpec:
    """What the images of a run look like (picklable: payloads are built in worker processes)."""

    sizes: tuple[tuple[int, int], ...]  # (width, height), cycled over the images
    images_per_request: int
    unique: bool
    pattern: str
    fmt: str
    run_seed: int  # fresh per run by default, so --unique images are not cache hits from an earlier run
    files: tuple[str, ...] = ()  # --images DIR: these files, cycled, instead of generated images
    videos_per_request: int = 0  # after the images in each request
    video_files: tuple[str, ...] = ()  # --videos DIR: these files, cycled, instead of generated clips
    video_size: tuple[int, int] = (320, 240)  # generated clips: (width, height), frames, fps
    video_frames: int = 24
    video_fps: int = 8


def image_url(spec: ImageSpec, w: int, h: int, seed: int) -> str:
    return data_url(*encode_image(make_image(w, h, seed, spec.pattern, spec.run_seed), spec.fmt))


# --repeat sends the same few images over and over: build each once per worker process.
_repeated_image_url = functools.lru_cache(maxsize=16)(image_url)


def request_urls(spec: ImageSpec, i: int) -> list[str]:
    """The data URLs of request i (generated images)."""
    return [url for url, _ in request_images(spec, i)]


def request_images(spec: ImageSpec, i: int, keep_every: int = 0) -> list[tuple[str, bytes | None]]:
    """Request i's images as (data URL, the encoded bytes or None). The bytes are kept only for images
    whose flat index is a multiple of keep_every (those verified against the reference).
    CPU-bound (~5-90 ms an image), hence run in a process pool."""
    out = []
    for j in range(spec.images_per_request):
        flat = i * spec.images_per_request + j
        keep = keep_every > 0 and flat % keep_every == 0
        if spec.files:
            path = spec.files[flat % len(spec.files)]
            blob = Path(path).read_bytes()
            out.append((data_url(blob, mimetypes.guess_type(path)[0] or "image/jpeg"), blob if keep else None))
            continue
        seed = image_seed(i, j, spec.images_per_request, len(spec.sizes), spec.unique)
        w, h = spec.sizes[flat % len(spec.sizes)]
        if keep:
            blob, mime = encode_image(make_image(w, h, seed, spec.pattern, spec.run_seed), spec.fmt)
            out.append((data_url(blob, mime), blob))
        else:
            out.append(((image_url if spec.unique else _repeated_image_url)(spec, w, h, seed), None))
    for j in range(spec.videos_per_request):
        flat = i * spec.videos_per_request + j
        if spec.video_files:
            path = spec.video_files[flat % len(spec.video_files)]
            mime = mimetypes.guess_type(path)[0] or ""
            out.append((data_url(Path(path).read_bytes(), mime if mime.startswith("video/") else "video/mp4"), None))
        else:
            out.append(((video_url if spec.unique else _repeated_video_url)(spec, flat if spec.unique else 0), None))
    return out


def video_url(spec: ImageSpec, seed: int) -> str:
    w, h = spec.video_size
    return data_url(make_video(w, h, spec.video_frames, spec.video_fps, seed, spec.pattern, spec.run_seed), "video/mp4")


_repeated_video_url = functools.lru_cache(maxsize=4)(video_url)


def video_files(folder: Path) -> list[str]:
    """The video files directly in `folder` (by suffix), sorted: what --videos DIR sends."""
    return sorted(str(p) for p in folder.iterdir() if p.is_file() and p.suffix.lower() in VIDEO_SUFFIXES)


def image_files(folder: Path) -> list[str]:
    """The image files directly in `folder` (by suffix), sorted: what --images DIR sends."""
    return sorted(str(p) for p in folder.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)


# ---- the client: requests, retries, replays --------------------------------------------------------
async def post_encode(client: httpx.AsyncClient, payload: dict) -> tuple[httpx.Response | httpx.HTTPError, bool]:
    """POST /encode; returns (the response, or the error if none came back; whether it was retried).
    A request that met a stale keep-alive connection is sent once more (service/lm/client.py says when)."""
    from service.lm.client import apost

    try:
        return await apost(client, "/encode", json=payload)
    except httpx.TransportError as e:
        return e, getattr(e, "sent_twice", False)


def replay(root: Path, item: dict):
    """Read an answered item back from the store as a consumer does, and check it against the answer.

    Returns (outcome, problem, ec_cache): outcome "ok", "missing" (the key is not in the store:
    evicted, or `root` is not the server's store) or "wrong"; ec_cache is the stored
    [num_tokens, out_hidden * (1 + deepstack)] tensor when it could be read.
    """
    import torch

    from service.lm.consumer import check
    from service.store.format import FILE_NAME, StoreFormatError, read_embeddings

    key = item["key"]
    try:
        emb = read_embeddings(root, key)  # <root>/<key>/encoder_cache.safetensors, as ECExampleConnector
    except KeyError:
        return "missing", f"{key}: not in the store at {root}", None
    except StoreFormatError as e:
        return "wrong", f"{key}: {e}", None
    problems = check(item, emb, None)
    if item.get("path") != f"{key}/{FILE_NAME}":
        problems.append(f"answered path {item.get('path')!r} is not {key}/{FILE_NAME}, where consumers look")
    ec = torch.cat([emb.main, *emb.deepstack], dim=1)
    bad = int((~torch.isfinite(ec)).sum())
    if bad:
        problems.append(f"{bad} of {ec.numel()} values are not finite")
    return ("wrong" if problems else "ok"), (f"{key}: " + "; ".join(problems) if problems else ""), ec


@dataclass(frozen=True)
class ClientConfig:
    """One client's share of the run (picklable: sent to client processes)."""

    client_id: int
    url: str
    headers: dict[str, str]
    indices: range  # the request indices this client sends; clients' indices differ, so their images do
    concurrency: int  # closed loop: requests in flight (0 in --rate mode)
    rate: float  # open loop: mean arrivals per second (0 in closed-loop mode)
    max_in_flight: int  # open loop: arrivals wait beyond this many requests in flight
    duration_s: float
    timeout_s: float
    images: ImageSpec
    gen_workers: int
    replay_every: int  # 0: no replay
    verify_every: int  # every verify_every-th replay is sent to the parent for verification (0: none)
    store_root: str | None
    seed: int  # arrival times in --rate mode


def _ignore_sigint() -> None:
    # Ctrl-C reaches the whole process group; only the parent acts on it (and tells the clients).
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def client_main(cfg: ClientConfig, sink, stop, go, own_process: bool = True) -> None:
    """Run one client: send its requests, report to `sink` in batches, stop when `stop` is set.

    Messages: ("ready", id) once its first payloads are built; then it waits for `go`. ("batch", id,
    results, replays, lags), ("verify", key, image bytes, grid_thw, stored float32 array), and last
    ("done", id, {"cancelled": requests in flight at a stop, "error": a crash, or None}).
    """
    if own_process:
        _ignore_sigint()
    info = {"cancelled": 0, "error": None}
    try:
        asyncio.run(_client(cfg, sink, stop, go, info))
    except BaseException as e:  # reported to the parent, which says so in the summary
        info["error"] = f"{type(e).__name__}: {e}"
    finally:
        sink.put(("done", cfg.client_id, info))


class _Outbox:
    def __init__(self, cfg: ClientConfig, sink):
        self.cfg, self.sink = cfg, sink
        self.results: list[Result] = []
        self.replays: list[tuple[str, str]] = []
        self.lags: list[float] = []

    def flush(self) -> None:
        if self.results or self.replays or self.lags:
            self.sink.put(("batch", self.cfg.client_id, self.results, self.replays, self.lags))
            self.results, self.replays, self.lags = [], [], []


def _error_code(r: httpx.Response) -> str | None:
    try:
        return str(r.json()["error"]["code"])
    except Exception:  # not the service's JSON error shape (a proxy, another server): show its start
        return r.text[:60] or None


async def _client(cfg: ClientConfig, sink, stop, go, info: dict) -> None:
    loop = asyncio.get_running_loop()
    spec = cfg.images
    out = _Outbox(cfg, sink)
    root = Path(cfg.store_root) if cfg.store_root else None
    keep_every = cfg.replay_every * cfg.verify_every
    in_flight: set[asyncio.Task] = set()

    async def send(i: int, images: list[tuple[str, bytes | None]], lag: float | None) -> None:
        payload = build_payload([url for url, _ in images])
        t0 = time.monotonic()
        answer, retried = await post_encode(client, payload)
        t1 = time.monotonic()
        if lag is not None:
            out.lags.append(lag)
        videos = sum(is_video_url(url) for url, _ in images)
        if isinstance(answer, Exception):
            out.results.append(Result(f"error:{type(answer).__name__}", t1 - t0, 0, 0, t1, retried, str(answer)[:120] or None))
            return
        if answer.status_code != 200:
            out.results.append(Result(answer.status_code, t1 - t0, len(images) - videos, 0, t1, retried,
                                      _error_code(answer), videos=videos))
            return
        items = answer.json()["items"]
        frames = sum(len(it.get("frames_indices") or ()) for it in items if it.get("modality") == "video")
        out.results.append(Result(200, t1 - t0, len(images) - videos, sum(bool(it.get("cached")) for it in items), t1,
                                  retried, videos=videos, frames=frames,
                                  tokens=sum(int(it.get("num_tokens", 0)) for it in items)))
        for j, item in enumerate(items):
            flat = i * spec.images_per_request + j
            if not cfg.replay_every or flat % cfg.replay_every:
                continue
            outcome, problem, ec = await asyncio.to_thread(replay, root, item)
            out.replays.append((outcome, problem))
            blob = images[j][1]
            if outcome == "ok" and blob is not None:
                sink.put(("verify", item["key"], blob, tuple(item["grid_thw"]), ec.float().numpy()))

    def start_send(i, images, lag=None) -> asyncio.Task:
        task = asyncio.create_task(send(i, images, lag))
        in_flight.add(task)
        task.add_done_callback(in_flight.discard)
        return task

    # Payloads in order, at most `prefetch` built or being built ahead of the senders.
    prefetch = max(2 * cfg.gen_workers, cfg.concurrency, min(256, math.ceil(cfg.rate / 2)), 2)
    payloads: asyncio.Queue = asyncio.Queue(maxsize=prefetch)
    first: list[asyncio.Future] = []
    warm = min(prefetch, len(cfg.indices))

    async def produce() -> None:
        for i in cfg.indices:
            fut = loop.run_in_executor(pool, request_images, spec, i, keep_every)
            if len(first) < warm:
                first.append(fut)
            await payloads.put((i, fut))
        await payloads.put(None)

    async def next_payload():
        got = await payloads.get()
        if got is None:
            payloads.put_nowait(None)  # the end, for the other senders too
            return None
        i, fut = got
        return i, await fut

    async def closed_worker() -> None:
        while (got := await next_payload()) is not None:
            if time.monotonic() >= deadline:
                return
            await start_send(*got)

    async def closed_loop() -> None:
        workers = [asyncio.create_task(closed_worker()) for _ in range(cfg.concurrency)]
        try:
            for w in workers:
                await w
        finally:  # one failed or we were cancelled: the others stop too
            for w in workers:
                w.cancel()
            await asyncio.wait(workers)

    async def open_loop() -> None:
        rng = random.Random(cfg.seed)
        t_next = start
        while True:
            t_next += rng.expovariate(cfg.rate)
            if t_next >= deadline:
                break
            await asyncio.sleep(max(0.0, t_next - time.monotonic()))
            if (got := await next_payload()) is None:
                break
            if len(in_flight) >= cfg.max_in_flight:
                await asyncio.wait(set(in_flight), return_when=asyncio.FIRST_COMPLETED)
            start_send(*got, lag=time.monotonic() - t_next)  # > 0: the client could not keep to the schedule
        if in_flight:
            await asyncio.wait(set(in_flight))

    async def flush_every(seconds: float) -> None:
        while True:
            await asyncio.sleep(seconds)
            out.flush()

    limit = cfg.concurrency or cfg.max_in_flight
    limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
    # NOTE: payloads are built in other processes so that image encoding neither holds this event
    # loop's GIL (which would inflate measured latencies) nor caps the request rate at one core's worth.
    pool = ProcessPoolExecutor(cfg.gen_workers, mp_context=multiprocessing.get_context("spawn"), initializer=_ignore_sigint)
    try:
        async with httpx.AsyncClient(base_url=cfg.url, timeout=cfg.timeout_s, limits=limits, headers=cfg.headers) as client:
            producer = asyncio.create_task(produce())
            while len(first) < warm and not producer.done():
                await asyncio.sleep(0.01)
            if producer.done():
                producer.result()  # building images failed: say why instead of waiting forever
            await asyncio.gather(*first)  # one ready payload per sender before the clock starts
            if cfg.replay_every:  # import the store reader (and torch) now, not inside the first timed request
                await asyncio.to_thread(__import__, "service.lm.consumer")
            sink.put(("ready", cfg.client_id))
            while not go.is_set():
                if stop.is_set():
                    return
                await asyncio.sleep(0.005)
            start = time.monotonic()
            deadline = start + cfg.duration_s
            flusher = asyncio.create_task(flush_every(0.2))
            main = asyncio.create_task(open_loop() if cfg.rate else closed_loop())
            while not main.done():
                if producer.done() and not producer.cancelled() and producer.exception() is not None:
                    main.cancel()
                    producer.result()
                if stop.is_set():
                    info["cancelled"] = len(in_flight)
                    for task in (main, *in_flight):
                        task.cancel()
                    await asyncio.gather(main, *in_flight, return_exceptions=True)
                    break
                await asyncio.wait({main}, timeout=0.05)
            if main.done() and not main.cancelled():
                main.result()  # a bug in the loop itself surfaces here
            for task in (producer, flusher):
                task.cancel()
            await asyncio.gather(producer, flusher, return_exceptions=True)
    finally:
        out.flush()
        pool.shutdown(wait=True, cancel_futures=True)


# ---- the reference and the verifier (parent side) ---------------------------------------------------
class Reference:
    """Float32 embeddings of an image from the service's own tower on the CPU: the same weights as the
    server (a preset's seed, or the checkpoint directory), eager arithmetic that the tests hold to
    transformers' within 1e-5 (tests/engine/test_core.py, tests/test_server.py)."""

    def __init__(self, model: str, seed: int = 0, min_pixels: int | None = None, max_pixels: int | None = None,
                 device: str = "cpu"):
        import torch

        from service.config import Settings
        from service.engine.core import Engine
        from service.engine.loader import load_model
        from service.metrics import Metrics

        logging.getLogger("service.engine.loader").setLevel(logging.ERROR)  # its "RANDOM WEIGHTS" banner is for servers

        if device.startswith("cuda"):
            # A float32 reference means float32 matmuls: no TF32 (the patch embedding is a Linear here).
            torch.backends.cuda.matmul.allow_tf32 = False
            torch.backends.cudnn.allow_tf32 = False
        self.settings = Settings(model=model, seed=seed, device=device, dtype="float32", min_pixels=min_pixels,
                                 max_pixels=max_pixels, compile=False, cuda_graphs=False, pool_slots=2)
        self.model = load_model(self.settings)
        # Eager, on its own (no compile, no graphs): no compile cache to set up.
        self.engine = Engine(self.model, store=None, batcher=None, options=self.settings.runner_options(),
                             metrics=Metrics())
        self.model_id = self.model.model_id

    def encode(self, blob: bytes) -> tuple[tuple[int, int, int], np.ndarray]:
        """(grid_thw, [tokens, out_hidden * (1 + deepstack)] float32) of one encoded image."""
        from service.media.images import prepare_image

        prepared = prepare_image(blob, self.model.params, self.settings.image_limits)
        (out,) = self.engine.encode_sync([prepared])
        return tuple(prepared.grid_thw), out.float().numpy()


def reference_model_from_id(model_id: str) -> tuple[str, int] | None:
    """'preset:tiny:seed3' (what /ready says of a preset) -> ('tiny', 3); None for a checkpoint."""
    parts = model_id.split(":")
    if len(parts) == 3 and parts[0] == "preset" and parts[2].startswith("seed") and parts[2][4:].isdigit():
        return parts[1], int(parts[2][4:])
    return None


class Verifier:
    """Compares replayed embeddings with the reference, on a thread of the parent process (the reference
    model is loaded once, not once per client process)."""

    def __init__(self, reference: Reference, tolerance: float):
        self.reference, self.tolerance = reference, tolerance
        self.tally = Tally()
        self.jobs: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._work, name="verifier", daemon=True)
        self.thread.start()

    def submit(self, key: str, blob: bytes, grid, stored: np.ndarray) -> None:
        self.jobs.put((key, blob, grid, stored))

    def pending(self) -> int:
        return self.jobs.qsize()

    def _work(self) -> None:
        while (job := self.jobs.get()) is not None:
            key, blob, grid, stored = job
            try:
                ref_grid, ref = self.reference.encode(blob)
            except Exception as e:  # the server encoded an image the reference could not: a finding, not a crash
                self.tally.add("wrong", f"{key}: the reference could not encode it: {type(e).__name__}: {e}")
                continue
            ok, rel, problem = compare_embeddings(stored, grid, ref, ref_grid, self.tolerance)
            if rel is not None:
                self.tally.worst_rel_err = max(rel, self.tally.worst_rel_err or 0.0)
            self.tally.add("ok" if ok else "wrong", f"{key}: {problem}" if problem else "")

    def finish(self, skip_pending: bool) -> None:
        """Wait for the queued verifications, or (after Ctrl-C) count them as skipped."""
        if skip_pending:
            while True:
                try:
                    if self.jobs.get_nowait() is not None:
                        self.tally.skipped += 1
                except queue.Empty:
                    break
        self.jobs.put(None)
        self.thread.join()


# ---- pre-flight --------------------------------------------------------------------------------------
class NotReady(Exception):
    """The server cannot be load-tested now; the message is one line saying what to do."""


def preflight(url: str, headers: dict[str, str], wait_ready_s: float = 0.0) -> dict:
    """GET /ready until it answers 200 (or wait_ready_s passes); returns its JSON (model, device, dtype)."""
    deadline = time.monotonic() + wait_ready_s
    while True:
        try:
            r = httpx.get(url.rstrip("/") + "/ready", timeout=5, headers=headers)
        except httpx.ConnectError as e:
            why = "connection refused" if "refused" in str(e).lower() else str(e)
            problem = (f"cannot reach the encoder service at {url} ({why}): start one (`make run`, or `make serve-tiny` "
                       "for a quick one) or pass --url")
        except httpx.HTTPError as e:
            problem = f"cannot reach the encoder service at {url} ({type(e).__name__}: {e})"
        else:
            if r.status_code == 200:
                try:
                    return r.json()
                except ValueError:
                    raise NotReady(f"{url}/ready answered 200 but not JSON: is this the encoder service?") from None
            if r.status_code == 503:
                problem = (f"the encoder service at {url} is not ready (/ready answered 503): it may still be loading "
                           "its model; wait, or pass --wait-ready SECONDS")
            else:
                raise NotReady(f"{url}/ready answered HTTP {r.status_code}: is this the encoder service?")
        if time.monotonic() >= deadline:
            raise NotReady(problem)
        time.sleep(0.5)


# ---- the parent: clients, progress, summary ---------------------------------------------------------
@dataclass
class Run:
    """Everything a run produced, as the parent collected it."""

    results: list[Result] = field(default_factory=list)
    replay: Tally = field(default_factory=Tally)
    lags: list[float] = field(default_factory=list)  # --rate: how late each request was sent, seconds
    wall_s: float = 0.0
    interrupted: bool = False
    cancelled: int = 0  # requests in flight when Ctrl-C stopped the run (not in the results)
    client_errors: list[str] = field(default_factory=list)
    start: float | None = None  # time.monotonic() when the clients were told to go
    status_counts: Counter = field(default_factory=Counter)  # kept as results arrive, for the live display
    retries: int = 0

    def add(self, results: list[Result]) -> None:
        for r in results:
            r.t_end -= self.start  # the clients' time.monotonic() -> seconds since the start
            self.status_counts[str(r.status)] += 1
            self.retries += r.retried
        self.results.extend(results)


class Progress:
    """Live progress on stderr: a rich bar on a terminal, a plain line every few seconds elsewhere
    (CI logs), nothing with --quiet."""

    def __init__(self, args, quiet: bool):
        self.args, self.quiet = args, quiet
        self.live = None
        self.last_line = self.last_update = 0.0
        if quiet:
            return
        try:
            from rich.console import Console
            from rich.progress import BarColumn, Progress as RichProgress, TextColumn, TimeElapsedColumn
        except ImportError:  # the `loadtest` extra is not installed: plain lines
            return
        console = Console(stderr=True)
        if console.is_terminal:
            self.live = RichProgress(TimeElapsedColumn(), BarColumn(bar_width=24), TextColumn("{task.fields[stats]}"),
                                     console=console, transient=False)
            self.task = self.live.add_task("load", total=1.0, stats="starting clients...")
            self.live.start()

    def update(self, run: Run, verifier: Verifier | None, force: bool = False) -> None:
        now = time.monotonic()
        # At most 4 times a second: with one client, its requests share this process's GIL.
        if self.quiet or run.start is None or (now - self.last_update < 0.25 and not force):
            return
        self.last_update = now
        elapsed = now - run.start
        done = max(len(run.results) / self.args.requests, min(1.0, elapsed / self.args.duration_s))
        text = self.stats_line(run, verifier, now)
        if self.live is not None:
            self.live.update(self.task, completed=done, stats=text)
        elif force or now - self.last_line >= PROGRESS_EVERY_S:
            self.last_line = now
            print(f"[{elapsed:6.1f} s] {text}", file=sys.stderr, flush=True)

    def stats_line(self, run: Run, verifier: Verifier | None, now: float) -> str:
        """Requests so far; img/s (and frames/s, tokens/s with videos) and p50/p99 of the last 5 s (or the last
        2,000 answers); status counts."""
        t = now - run.start
        recent = [r for r in run.results[-5000:] if r.t_end >= t - 5.0 and r.status == 200]
        window = min(5.0, t)
        rate = sum(r.images for r in recent) / window if window > 0 else 0.0
        lat = [r.latency_s * 1000 for r in run.results[-2000:] if r.status == 200]
        parts = [f"{len(run.results)} req", f"{rate:.1f} img/s ({'last 5 s' if window >= 5.0 else 'so far'})",
                 f"p50 {percentile(lat, 50):.0f} ms" if lat else "p50 -", f"p99 {percentile(lat, 99):.0f} ms" if lat else "p99 -",
                 " ".join(f"{k}:{v}" for k, v in sorted(run.status_counts.items())) or "-"]
        if window > 0 and any(r.videos for r in recent):  # a video run: its frames and tokens at the same rate
            parts[2:2] = [f"{sum(r.frames for r in recent) / window:.1f} frames/s",
                          f"{sum(r.tokens for r in recent) / window:.0f} tokens/s"]
        if run.retries:
            parts.append(f"retries {run.retries}")
        if self.args.replay_every:
            parts.append(f"replay {run.replay.ok} ok/{run.replay.missing} missing/{run.replay.wrong} wrong")
        if verifier is not None:
            parts.append(f"verify {verifier.tally.ok} ok/{verifier.tally.wrong} wrong")
        return "  ".join(parts)

    def stop(self) -> None:
        if self.live is not None:
            self.live.stop()
            self.live = None


def client_configs(args, spec: ImageSpec, headers: dict[str, str]) -> list[ClientConfig]:
    """The run split over --processes clients: request i goes to client i % N; concurrency and rate split evenly."""
    n = args.processes
    return [
        ClientConfig(
            client_id=c, url=args.url, headers=headers, indices=range(c, args.requests, n),
            concurrency=0 if args.rate else args.concurrency // n + (c < args.concurrency % n),
            rate=args.rate / n if args.rate else 0.0, max_in_flight=args.max_in_flight,
            duration_s=args.duration_s, timeout_s=args.timeout_s, images=spec,
            gen_workers=max(1, args.gen_workers // n), replay_every=args.replay_every,
            verify_every=args.verify_every if args.verify else 0,
            store_root=str(args.store_root) if args.replay_every else None, seed=args.seed * 1000 + c,
        )
        for c in range(n)
    ]


def run_load(args, verifier: Verifier | None, quiet: bool = False) -> Run:
    """Start the clients (a thread for one, processes for more), collect what they report, show progress.
    The first Ctrl-C stops the clients (their requests in flight are cancelled) and returns what was
    collected; a second one stops waiting for them."""
    vw, vh = parse_sizes(args.video_size)[0]
    spec = ImageSpec(tuple(parse_sizes(args.sizes)), args.images_per_request, args.unique, args.pattern, args.format,
                     args.seed, tuple(image_files(Path(args.images))) if args.images else (),
                     videos_per_request=run_videos(args),
                     video_files=tuple(video_files(Path(args.videos))) if args.videos else (),
                     video_size=(vw, vh), video_frames=args.video_frames, video_fps=args.video_fps)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    configs = client_configs(args, spec, headers)
    run = Run()
    if args.processes == 1:  # in this process: no start-up cost, and the parent stays a plain program
        sink, stop, go = queue.Queue(), threading.Event(), threading.Event()
        workers = [threading.Thread(target=client_main, args=(configs[0], sink, stop, go, False), daemon=True)]
    else:
        ctx = multiprocessing.get_context("spawn")
        sink, stop, go = ctx.Queue(), ctx.Event(), ctx.Event()
        # Not daemonic: a client starts processes of its own (the image builders).
        workers = [ctx.Process(target=client_main, args=(c, sink, stop, go)) for c in configs]

    def on_sigint(signum, frame):
        if stop.is_set():
            raise KeyboardInterrupt  # a second Ctrl-C: stop waiting for the clients
        run.interrupted = True
        stop.set()

    previous = signal.signal(signal.SIGINT, on_sigint) if threading.current_thread() is threading.main_thread() else None
    progress = Progress(args, quiet)
    ready, done = set(), set()
    try:
        for w in workers:
            w.start()
        while len(done) < len(workers):
            try:
                msg = sink.get(timeout=0.1)
            except queue.Empty:
                msg = None
            if msg is not None:
                kind = msg[0]
                if kind == "ready":
                    ready.add(msg[1])
                elif kind == "batch":
                    _, _, results, replays, lags = msg
                    run.add(results)
                    for outcome, problem in replays:
                        run.replay.add(outcome, problem)
                    run.lags.extend(lags)
                elif kind == "verify":
                    if verifier is not None:
                        verifier.submit(*msg[1:])
                elif kind == "done":
                    done.add(msg[1])
                    run.cancelled += msg[2]["cancelled"]
                    if msg[2]["error"]:
                        run.client_errors.append(f"client {msg[1]}: {msg[2]['error']}")
            if run.start is None and len(ready | done) == len(workers):
                run.start = time.monotonic()
                go.set()
            for w in workers:  # a client process killed from outside never says "done"
                if isinstance(w, multiprocessing.process.BaseProcess) and not w.is_alive() and w.exitcode not in (0, None):
                    cid = workers.index(w)
                    if cid not in done:
                        done.add(cid)
                        run.client_errors.append(f"client process {cid} exited with status {w.exitcode}")
            progress.update(run, verifier)
        progress.update(run, verifier, force=True)
    except KeyboardInterrupt:
        run.interrupted = True
        stop.set()
    finally:
        end = time.monotonic()
        progress.stop()
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
        for w in workers:
            w.join(timeout=10)
            if isinstance(w, multiprocessing.process.BaseProcess) and w.is_alive():
                w.terminate()
                w.join(5)
    run.wall_s = end - run.start if run.start is not None else 0.0
    return run


def build_report(args, server: dict, summary: Summary, run: Run, verifier: Verifier | None, plot: str | None) -> dict:
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "api_key"}
    report = {
        "settings": settings,
        "server": server,
        "summary": asdict(summary),
        "interrupted": run.interrupted,
        "cancelled_in_flight": run.cancelled,
        "client_errors": run.client_errors,
        "timeseries": timeseries(run.results, run.wall_s),
        "plot": plot,
    }
    if args.rate:
        report["schedule_lag_ms"] = {"p50": percentile([x * 1000 for x in run.lags], 50),
                                     "p99": percentile([x * 1000 for x in run.lags], 99),
                                     "max": max(run.lags) * 1000 if run.lags else None}
    if args.replay_every:
        report["replay"] = {"every": args.replay_every, "store_root": str(args.store_root), **asdict(run.replay)}
        report["replay"].pop("worst_rel_err")
        report["replay"].pop("skipped")
    if verifier is not None:
        report["verify"] = {"every_nth_replay": args.verify_every, "tolerance": verifier.tolerance,
                            "reference": verifier.reference.model_id, "reference_device": "cpu",
                            "reference_dtype": "float32", **asdict(verifier.tally)}
        report["verify"].pop("missing")
    return strict_json(report)


def _ms(value: float | None) -> str:
    """A latency for the plot's title: '-' for none, whole milliseconds from 100 ms up."""
    if value is None or not math.isfinite(value):
        return "-"
    return f"{value:.0f} ms" if value >= 100 else f"{value:.1f} ms"


def plot_totals(summary: dict) -> str:
    """The run's totals in one line, for the plot's title: what the summary table says, so that the
    per-bin rates on the plot cannot be mistaken for the run's throughput."""
    def n(count: int, noun: str) -> str:
        return f"{count} {noun}" + ("" if count == 1 else "s")

    errors = summary["requests"] - summary["ok_requests"]
    line = (f"{n(summary['ok_images'], 'image')} in {n(summary['requests'], 'request')}, {summary['wall_s']:.2f} s: "
            f"{summary['images_per_s'] or 0.0:.3g} img/s overall; "
            f"p50 {_ms(summary['latency_ms']['p50'])}, p99 {_ms(summary['latency_ms']['p99'])}; errors {errors}")
    if errors:
        line += " (" + ", ".join(f"{k}: {v}" for k, v in list(summary.get("errors", {}).items())[:3]) + ")"
    return line


def plot_figure(report: dict, title: str):
    """The plot as a matplotlib Figure (matplotlib must be importable): throughput and p50/p99 latency
    on one time axis, the whole run (0 to its wall time), and the status counts; `title` and the run's
    totals (plot_totals) above them.

    NOTE: the throughput panel's bars are per time bin (images answered in the bin / the bin's width),
    a burst measure: slow requests answered together land in one bin (4 requests in 120 s on the 2B
    preset: 3 answers in one 1.2 s bin read 2.5 img/s) while the run averaged 0.03 img/s. The dashed
    line is that average, the summary's figure; the bars' time-weighted mean equals it.
    """
    import matplotlib.pyplot as plt

    ts, s = report["timeseries"], report["summary"]
    wall = s["wall_s"] or 0.0
    ends = [p["t"] for p in ts]
    starts = [0.0, *ends[:-1]]
    widths = [b - a for a, b in zip(starts, ends)]
    mids = [a + w / 2 for a, w in zip(starts, widths)]
    fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(9, 9), gridspec_kw={"height_ratios": [3, 3, 2]})
    ax2.sharex(ax1)  # one time axis for throughput and latency (the status panel is not over time)

    bin_label = f"{widths[0]:.3g} s" if widths else "-"
    ax1.bar(starts, [p["images_per_s"] for p in ts], width=widths, align="edge", color="tab:blue", alpha=0.55,
            edgecolor="white", linewidth=0.5, label=f"per {bin_label} bin: images answered in it / its width")
    overall = s["ok_images"] / wall if wall > 0 else 0.0
    ax1.axhline(overall, color="black", linestyle="--", linewidth=1.2,
                label=f"overall: {s['ok_images']} images / {wall:.2f} s = {overall:.3g} img/s")
    ax1.set_ylabel("images/s (200 answers)")
    top = max([p["images_per_s"] for p in ts] + [overall]) or 1.0
    ax1.set_ylim(0, top * 1.35)  # headroom: the legend sits above the bars, not over them
    ax1.grid(alpha=0.3)
    ax1.legend(loc="upper left", fontsize=8)

    def series(key):
        return [p[key] if p[key] is not None else float("nan") for p in ts]

    # p99 first, as hollow circles on a thin line; p50 over it, filled and on top: in a bin with one
    # answer the two are equal, and p50 shows inside p99's circle instead of hiding under it.
    ax2.plot(mids, series("p99_ms"), color="tab:red", linewidth=1, marker="o", markersize=8,
             markerfacecolor="none", zorder=2, label="p99")
    ax2.plot(mids, series("p50_ms"), color="tab:green", linewidth=2, marker=".", markersize=9, zorder=3,
             label="p50")
    ax2.set_ylabel("latency (ms) of answers in the bin")
    ax2.set_xlabel("seconds since start")
    ax2.margins(y=0.1)  # the highest point's circle not cut by the frame
    ax2.set_ylim(bottom=0)
    ax2.grid(alpha=0.3)
    ax2.legend(loc="upper left", fontsize=8)
    ax1.set_xlim(0, wall if wall > 0 else 1.0)  # the whole run, shared: not autoscaled to where data fell

    bars = dict(s["status_counts"])
    if s.get("retries"):
        bars["retries"] = s["retries"]
    for name in ("replay", "verify"):
        if name in report:
            bars[f"{name} ok"] = report[name]["ok"]
            bars[f"{name} wrong"] = report[name]["wrong"]
    colors = ["tab:green" if k == "200" or k.endswith(" ok") else "tab:orange" if k in ("429", "retries") else "tab:red"
              for k in bars]
    rects = ax3.bar(list(bars), list(bars.values()), color=colors)
    ax3.bar_label(rects)
    ax3.margins(y=0.25)  # room for the labels above the bars
    ax3.set_ylabel("count")
    ax3.set_title("status of every request; replay and verify outcomes", fontsize=9)
    fig.suptitle(f"{title}\n{plot_totals(s)}", fontsize=10)
    fig.tight_layout()
    return fig


def write_plot(path: Path, report: dict, title: str) -> str | None:
    """plot_figure as a PNG. None (and no file) when matplotlib is missing: it is an optional
    dependency (the `loadtest` extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig = plot_figure(report, title)
    fig.savefig(path, format="png", dpi=100)
    plt.close(fig)
    return str(path)


# ---- the command line --------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8080", help="the encoder service (loopback unless --allow-remote)")
    p.add_argument("--api-key", default=(os.environ.get("QVE_API_KEY") or "").split(",")[0] or None,
                   help="sent as Authorization: Bearer (default: the first of $QVE_API_KEY)")
    load = p.add_argument_group("load")
    load.add_argument("--concurrency", type=int, default=4, help="closed loop: requests in flight")
    load.add_argument("--rate", type=float, default=0.0, help="open loop instead: Poisson arrivals, requests/s")
    load.add_argument("--max-in-flight", type=int, default=1024, help="--rate: arrivals wait beyond this many in flight")
    load.add_argument("--requests", type=int, default=200, help="stop after this many requests")
    load.add_argument("--duration-s", type=float, default=10.0, help="stop starting requests after this long")
    load.add_argument("--processes", type=int, default=1, help="client processes (when one cannot saturate the server)")
    load.add_argument("--timeout-s", type=float, default=300.0, help="per-request timeout")
    load.add_argument("--wait-ready", type=float, default=0.0, metavar="SECONDS", help="wait this long for /ready")
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
            p.error("videos need PyAV (pip install av, or the project's `video` extra)")


def run_videos(args) -> int:
    return args.generated_videos or (args.videos_per_request if args.videos else 0)


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    check_args(p, args)
    if args.seed is None:
        args.seed = secrets.randbits(32)
    if args.replay_every and args.store_root is None:
        from service.config import default_store_dir

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
        print(f"plot: {plot_written}" if plot_written else "no plot written: matplotlib is not installed (pip install matplotlib)")

    if run.interrupted:
        return 130
    wrong = run.replay.wrong + (verifier.tally.wrong if verifier else 0)
    return 0 if summary.ok_requests > 0 and wrong == 0 and not run.client_errors else 1


if __name__ == "__main__":
    # NOTE: run as the module `loadtest` (bench/ is sys.path[0] for `python bench/loadtest.py`), not as
    # __main__: what client processes send back (Result, ...) then unpickles under one name everywhere.
    import loadtest

    sys.exit(loadtest.main())
