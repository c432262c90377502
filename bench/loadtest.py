"""Load generator for the encoder service: concurrent JSON /encode requests, bounded in count and time.

    python bench/loadtest.py --url http://127.0.0.1:8080 --concurrency 32 --requests 400 \
        --images-per-request 1 --sizes 448x448,1024x768 --unique --out results.json

--unique (default) gives every image distinct pixels, so nothing is a cache hit and every image costs a
full encode; --repeat cycles over one image per size, which measures the cache-hit path. Images are
built in memory (gradients, noise, or scikit-image's bundled photographs with --pattern photo) before
each request's clock starts, so latency is the service's alone. The run stops after --requests
requests or --duration-s seconds, whichever comes first (requests in flight then are still awaited).

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
import math
import multiprocessing
import os
import secrets
import sys
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from urllib.parse import urlsplit

import httpx
import numpy as np

PATTERNS = ("gradient", "noise", "photo")
# scikit-image's bundled colour photographs (no download needed).
PHOTOS = ("astronaut", "coffee", "chelsea", "rocket", "immunohistochemistry", "hubble_deep_field")


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


def data_url(data: bytes, mime: str) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode('ascii')}"


def build_payload(urls: list[str]) -> dict:
    """The JSON /encode body (OpenAI content-part shape) for a list of data URLs."""
    return {"images": [{"type": "image_url", "image_url": {"url": u}} for u in urls]}


@dataclass
class Result:
    status: int | str  # HTTP status, or "error:<ExceptionName>" when no response came back
    latency_s: float
    images: int
    cached: int = 0  # items the service answered from its store


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


def summarize(results: list[Result], wall_s: float) -> Summary:
    ok = [r for r in results if r.status == 200]
    lat = [r.latency_s * 1000 for r in ok]
    counts = Counter(str(r.status) for r in results)
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
    )


def format_table(s: Summary) -> str:
    lat = s.latency_ms
    rows = [
        ("wall time", f"{s.wall_s:.2f} s"),
        ("requests", f"{s.requests} ({s.ok_requests} ok, {s.rejected_429} rejected with 429)"),
        ("images ok", f"{s.ok_images} ({s.cached_images} cached)"),
        ("throughput", f"{s.images_per_s:.2f} images/s, {s.requests_per_s:.2f} requests/s"),
        ("latency ms", f"p50 {lat['p50']:.1f}  p90 {lat['p90']:.1f}  p99 {lat['p99']:.1f}  max {lat['max']:.1f}"),
        ("status", ", ".join(f"{k}: {v}" for k, v in s.status_counts.items()) or "-"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


# ---- the run ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ImageSpec:
    """What the images of a run look like (picklable: payloads are built in worker processes)."""

    sizes: tuple[tuple[int, int], ...]  # (width, height), cycled over the images
    images_per_request: int
    unique: bool
    pattern: str
    fmt: str
    run_seed: int  # fresh per run by default, so --unique images are not cache hits from an earlier run


def image_url(spec: ImageSpec, w: int, h: int, seed: int) -> str:
    return data_url(*encode_image(make_image(w, h, seed, spec.pattern, spec.run_seed), spec.fmt))


# --repeat sends the same few images over and over: build each once per worker process.
_repeated_image_url = functools.lru_cache(maxsize=16)(image_url)


def request_urls(spec: ImageSpec, i: int) -> list[str]:
    """The data URLs of request i. CPU-bound (~5-90 ms an image), hence run in a process pool."""
    urls = []
    for j in range(spec.images_per_request):
        seed = image_seed(i, j, spec.images_per_request, len(spec.sizes), spec.unique)
        w, h = spec.sizes[(i * spec.images_per_request + j) % len(spec.sizes)]
        urls.append((image_url if spec.unique else _repeated_image_url)(spec, w, h, seed))
    return urls


async def run(args: argparse.Namespace) -> tuple[list[Result], float]:
    spec = ImageSpec(
        tuple(parse_sizes(args.sizes)), args.images_per_request, args.unique, args.pattern, args.format, args.seed
    )
    results: list[Result] = []
    claimed = 0
    deadline = math.inf

    def claim() -> int | None:
        """The next request index, or None once the count or the time is used up."""
        nonlocal claimed
        if claimed >= args.requests or time.perf_counter() >= deadline:
            return None
        claimed += 1
        return claimed - 1

    loop = asyncio.get_running_loop()
    limits = httpx.Limits(max_connections=args.concurrency, max_keepalive_connections=args.concurrency)
    # NOTE: payloads are built in other processes so that image encoding neither holds the event loop's
    # GIL (which would inflate measured latencies) nor caps the request rate at one core's worth.
    with ProcessPoolExecutor(args.gen_workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        async with httpx.AsyncClient(base_url=args.url, timeout=args.timeout_s, limits=limits) as client:

            def prepare(i: int | None):
                return None if i is None else loop.run_in_executor(pool, request_urls, spec, i)

            async def worker(next_payload) -> None:
                # Double-buffered: the next payload is built while this request is in flight.
                while next_payload is not None:
                    urls = await next_payload
                    next_payload = prepare(claim())
                    if time.perf_counter() >= deadline:
                        break
                    t0 = time.perf_counter()
                    try:
                        r = await client.post("/encode", json=build_payload(urls))
                    except httpx.HTTPError as e:
                        results.append(Result(f"error:{type(e).__name__}", time.perf_counter() - t0, 0))
                        continue
                    latency = time.perf_counter() - t0
                    cached = sum(bool(it.get("cached")) for it in r.json()["items"]) if r.status_code == 200 else 0
                    results.append(Result(r.status_code, latency, spec.images_per_request, cached))

            # Before the clock starts: one ready payload per worker (this also starts the pool).
            first = [prepare(claim()) for _ in range(min(args.concurrency, args.requests))]
            await asyncio.gather(*first)
            start = time.perf_counter()
            deadline = start + args.duration_s
            await asyncio.gather(*(worker(f) for f in first))
            wall = time.perf_counter() - start
    return results, wall


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8080")
    p.add_argument("--concurrency", type=int, default=32, help="requests in flight")
    p.add_argument("--requests", type=int, default=400, help="stop after this many requests")
    p.add_argument("--duration-s", type=float, default=300.0, help="stop starting requests after this long")
    p.add_argument("--images-per-request", type=int, default=1)
    p.add_argument("--sizes", default="448x448", help="WIDTHxHEIGHT list, cycled over the images")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--unique", dest="unique", action="store_true", default=True, help="no two images alike (default)")
    mode.add_argument("--repeat", dest="unique", action="store_false", help="one image per size, repeated (cache hits)")
    p.add_argument("--pattern", choices=PATTERNS, default="gradient", help="photo needs scikit-image")
    p.add_argument("--format", choices=("png", "jpeg"), default="png")
    p.add_argument("--seed", type=int, default=None, help="image seed (default: a fresh one per run, recorded in --out)")
    p.add_argument("--timeout-s", type=float, default=300.0, help="per-request timeout")
    p.add_argument(
        "--gen-workers", type=int, default=max(1, min(8, (os.cpu_count() or 2) // 2)),
        help="processes that build the images (default: half the cores, at most 8)",
    )
    p.add_argument("--out", help="write the summary and settings as JSON here")
    p.add_argument("--allow-remote", action="store_true", help="allow a non-loopback --url (not for shared machines)")
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if not args.allow_remote and not is_loopback_url(args.url):
        p.error(f"{args.url} is not a loopback address; load tests target 127.0.0.1 (or pass --allow-remote)")
    if min(args.concurrency, args.requests, args.images_per_request, args.gen_workers) < 1 or args.duration_s <= 0:
        p.error("--concurrency, --requests, --images-per-request, --gen-workers and --duration-s must be positive")
    if args.pattern == "photo":
        try:
            import skimage.data  # noqa: F401
        except ImportError:
            p.error("--pattern photo needs scikit-image (pip install scikit-image)")
    try:
        parse_sizes(args.sizes)
    except ValueError as e:
        p.error(str(e))

    if args.seed is None:
        args.seed = secrets.randbits(32)
    results, wall = asyncio.run(run(args))
    summary = summarize(results, wall)
    print(format_table(summary))
    if args.out:
        with open(args.out, "w") as f:
            clean = json.loads(json.dumps(asdict(summary)).replace("NaN", "null"))  # strict JSON, no NaN
            json.dump({"settings": vars(args), "summary": clean}, f, indent=2)
            f.write("\n")
    return 0 if summary.ok_requests > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
