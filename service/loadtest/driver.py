"""The load test's parent: the pre-flight check of /ready, then the clients started and their reports
collected, with live progress on stderr, until the run ends or Ctrl-C stops it."""

from __future__ import annotations

import multiprocessing
import queue
import signal
import sys
import threading
import time
from pathlib import Path

import httpx

from service.loadtest.checks import Verifier
from service.loadtest.client import ClientConfig, client_main
from service.loadtest.media import ImageSpec, image_files, parse_sizes, video_files
from service.loadtest.report import Run, percentile


PROGRESS_EVERY_S = 5.0  # plain progress lines when stderr is not a terminal (CI logs)


class NotReady(Exception):
    """The server cannot be load-tested now; the message is one line saying what to do."""


def preflight(url: str, headers: dict[str, str], wait_ready_s: float = 0.0) -> dict:
    """GET /ready until it answers 200 (or wait_ready_s passes, saying once per phase that it waits on stderr);
    returns its JSON (model, device, dtype). Nothing listening is refused at once: there is nothing to wait for."""
    deadline = time.monotonic() + wait_ready_s
    said = None
    while True:
        try:
            r = httpx.get(url.rstrip("/") + "/ready", timeout=5, headers=headers)
        except httpx.ConnectError as e:
            why = "connection refused" if "refused" in str(e).lower() else str(e)
            raise NotReady(f"cannot reach the encoder service at {url} ({why}): start one (`make run`, or `make "
                           "serve-tiny` for a quick one) or pass --url") from None
        except httpx.TimeoutException:  # bound, still importing: the connection waits in the backlog
            phase, problem = "starting", f"the encoder service at {url} did not answer /ready"
        except httpx.HTTPError as e:
            raise NotReady(f"cannot reach the encoder service at {url} ({type(e).__name__}: {e})") from None
        else:
            if r.status_code == 200:
                try:
                    return r.json()
                except ValueError:
                    raise NotReady(f"{url}/ready answered 200 but not JSON: is this the encoder service?") from None
            if r.status_code != 503:
                raise NotReady(f"{url}/ready answered HTTP {r.status_code}: is this the encoder service?")
            try:
                phase = r.json().get("phase", "starting")
            except (ValueError, AttributeError):
                phase = "starting"
            problem = f"the encoder service at {url} is not ready (/ready answered 503, phase: {phase})"
        if time.monotonic() >= deadline:
            raise NotReady(f"{problem} after {wait_ready_s:g} s: it may still be loading its model; wait, or pass "
                           "--wait-ready SECONDS")
        if phase != said:
            print(f"waiting for the encoder service at {url} to be ready (phase: {phase})", file=sys.stderr, flush=True)
            said = phase
        time.sleep(0.5)


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
            chat=args.api == "chat",
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


def run_videos(args) -> int:
    """Videos in each request: --generated-videos N, or --videos-per-request with --videos DIR."""
    return args.generated_videos or (args.videos_per_request if args.videos else 0)
