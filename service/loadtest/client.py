"""One load-test client: sends its share of the requests (closed or open loop), retries a request
that met a stale keep-alive connection, replays answered items from the store, and reports to the
parent in batches. A thread of the parent for one client, a process of its own for each of several."""

from __future__ import annotations

import asyncio
import math
import multiprocessing
import random
import signal
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx

from service.loadtest.checks import replay
from service.loadtest.media import ImageSpec, build_chat, build_payload, is_video_url, request_images
from service.loadtest.report import Result


async def post_encode(client: httpx.AsyncClient, payload: dict,
                      path: str = "/encode") -> tuple[httpx.Response | httpx.HTTPError, bool]:
    """POST /encode (or the chat route); returns (the response, or the error if none came back; whether it was
    retried). A request that met a stale keep-alive connection is sent once more (service/lm/client.py says when)."""
    from service.lm.client import apost

    try:
        return await apost(client, path, json=payload)
    except httpx.TransportError as e:
        return e, getattr(e, "sent_twice", False)


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
    chat: bool = False  # --api chat: POST /v1/chat/completions (build_chat) instead of /encode


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
        urls = [url for url, _ in images]
        t0 = time.monotonic()
        answer, retried = await (post_encode(client, build_chat(urls), "/v1/chat/completions") if cfg.chat
                                 else post_encode(client, build_payload(urls)))
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
        if cfg.chat:  # (a chat.completion names no keys: its prompt tokens are the media's)
            out.results.append(Result(200, t1 - t0, len(images) - videos, 0, t1, retried, videos=videos,
                                      tokens=int(answer.json()["usage"]["prompt_tokens"])))
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
