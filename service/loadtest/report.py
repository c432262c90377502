"""What a run produced and how it reads: each request's Result, the summary table, the time series
and the JSON report (strict JSON: no NaN)."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

from service.loadtest.checks import Tally, Verifier


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]) of unsorted values; NaN for no values."""
    if not values:
        return math.nan
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


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


def strict_json(obj):
    """NaN/inf -> None, so the report is strict JSON."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: strict_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [strict_json(v) for v in obj]
    return obj


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


def build_report(args, server: dict, summary: Summary, run: Run, verifier: Verifier | None, plot: str | None) -> dict:
    """The JSON report: the flags (not the API key), /ready's answer, the summary, the time series, and the
    replays' and verifications' tallies."""
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
