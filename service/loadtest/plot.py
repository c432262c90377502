"""The load test's plot: throughput and latency over the run, and the status counts, as a PNG.
matplotlib (the `loadtest` extra) is imported only here, when a plot is drawn."""

from __future__ import annotations

import math
from pathlib import Path


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
