"""Prometheus metrics. One registry per app instance (tests build several apps in one process)."""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from service.config import MULTIPROC_ENV

# In a supervised service (--api-processes) the API processes own these families and the engine
# process the others, so /metrics joins two texts that never repeat a series. The API processes run
# prometheus_client's multiprocess mode (its variable MULTIPROC_ENV, set by procs/api_process.py first):
# each process's values live in files of one directory, and any API process answers the sum of all.
API_FAMILIES = frozenset({"qve_requests", "qve_images", "qve_rejected", "qve_encode_latency_seconds",
                          "qve_arena_bytes_in_use", "qve_deadline_exceeded"})

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_PHASE_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("qve_requests", "HTTP encoding requests (/encode, /v1/chat/completions) by status code", ["status"], registry=r)
        self.images = Counter(
            "qve_images", "Images answered, by how: encoded, cached (store hit), coalesced (joined an in-flight encode)",
            ["outcome"], registry=r,
        )
        self.cache_hits = Counter("qve_cache_hits", "Images answered from the store without encoding", registry=r)
        self.coalesced = Counter("qve_coalesced", "Images that joined an identical in-flight encode", registry=r)
        self.dropped = Gauge("qve_dropped", "Queued images dropped because every client waiting for them left", registry=r)
        self.rejected = Counter("qve_rejected", "Images refused with 429 because the queue was full", registry=r)
        self.steps = Counter("qve_steps", "Step-loop steps run", ["result"], registry=r)
        self.step_tokens = Histogram(
            "qve_step_tokens", "Output tokens per step", buckets=(64, 256, 1024, 4096, 16384, 65536), registry=r
        )
        self.step_images = Histogram("qve_step_images", "Images per step", buckets=(1, 2, 4, 8, 16, 32, 64, 128), registry=r)
        self.step_seconds = Histogram(
            "qve_step_seconds", "Host time to stage and launch one step", buckets=_LATENCY_BUCKETS, registry=r
        )
        # Where the step loop's and the writer's time goes, per step (sum / count = the mean per step):
        #   loop:   idle (waiting for a batch), stage (into a pinned slot, its fence included), launch
        #           (the device work enqueued), output_wait (part of launch: every output buffer still held
        #           by the writer: the writer is behind)
        #   writer: reserve (its wait for the step's entries' files, reserved from the step's launch on),
        #           copy_wait (for the step's D2H copy: the device is behind), commit (the writes and answers)
        #   device: the step's own time on the device (CUDA events around its H2D copies and tower; image
        #           steps), so device / (time between steps) is how busy the device was; device_gap: its
        #           time with no step between one step's end and the next one's start (no work, or a late launch)
        # So the thread whose phases other than idle / copy_wait add up to the time between steps is the limit.
        self.gc_pause_seconds = Histogram(
            "qve_gc_pause_seconds", "Python garbage collections of generations 1 and 2 in the engine's process, by "
            "generation: every thread of it waits meanwhile (see watch_gc)", ["generation"],
            buckets=_PHASE_BUCKETS, registry=r,
        )
        self.step_phase_seconds = Histogram(
            "qve_step_phase_seconds", "Step loop and store writer time per step, by phase", ["phase"],
            buckets=_PHASE_BUCKETS, registry=r,
        )
        self.encode_latency = Histogram(
            "qve_encode_latency_seconds", "Time from request arrival to response, per /encode request",
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.queue_depth = Gauge("qve_queue_depth", "Images queued and not yet scheduled", registry=r)
        self.in_flight = Gauge("qve_in_flight", "Distinct images scheduled or queued", registry=r)
        self.store_bytes = Gauge("qve_store_bytes", "Bytes held by the embedding store", registry=r)
        self.store_items = Gauge("qve_store_items", "Items held by the embedding store", registry=r)
        self.store_evictions = Gauge("qve_store_evictions", "LRU evictions since start", registry=r)
        self.store_timeouts = Counter("qve_store_timeouts", "Store calls past their deadline (--mooncake-timeout-s), "
                                      "by call: a lookup's or a read's is a miss (encoded again), a write's a 503",
                                      ["call"], registry=r)
        self._store_timeouts_seen: dict[str, int] = {}
        self.arena_bytes = Gauge("qve_arena_bytes_in_use", "Pixel-arena bytes held for the engine (summed over "
                                 "the API processes; 0 in a single-process service)", registry=r,
                                 multiprocess_mode="livesum")  # a dead API process's cells are gone with it
        # The signals to scale on (docs/operations.md): the waiting work per priority level, how long the
        # longest-waiting image has waited, and the encode rate (rate() of the two counters).
        self.waiting_images = Gauge("qve_waiting_images", "Images waiting for a step: queued, or holding a queue "
                                    "place while decoded, by request priority (lower runs first)", ["priority"], registry=r)
        self.waiting_tokens = Gauge("qve_waiting_tokens", "Output tokens of the images waiting for a step, by request "
                                    "priority", ["priority"], registry=r)
        self.oldest_wait = Gauge("qve_oldest_wait_seconds", "How long the longest-waiting image (queued or being "
                                 "decoded) has waited", registry=r)
        self.encoded_images = Counter("qve_encoded_images", "Images (and video parts) run through the tower", registry=r)
        self.encoded_tokens = Counter("qve_encoded_tokens", "Output tokens run through the tower", registry=r)
        self.shed = Gauge("qve_shed", "Queued images answered 429 to make room for more urgent work (a full queue)",
                          registry=r)
        self.expired = Gauge("qve_expired", "Queued images' waiters answered 504: their deadline passed before the "
                             "step", registry=r)
        self.deadline_exceeded = Counter("qve_deadline_exceeded", "Requests answered 504 deadline_exceeded, by where "
                                         "their deadline passed: claim (before decode), decode (waiting for a "
                                         "decoder), submit (decoded too late), queue (before its step)", ["where"],
                                         registry=r)
        self.fence_waits = Gauge("qve_fence_waits", "Staging-slot acquires that had to wait on the slot's event", registry=r)

    def watch_gc(self) -> Callable[[], None]:
        """Observe this process's collections of generations 1 and 2 into gc_pause_seconds from now on (a
        generation-0 one takes microseconds and runs every few hundred allocations: not timed). Once per
        process (its entry point): gc.callbacks is the process's. Returns the function that stops it."""
        started: dict[int, float] = {}
        for gen in ("1", "2"):  # both series from the start, at 0 (a quiet engine may not collect for minutes)
            self.gc_pause_seconds.labels(generation=gen)

        def callback(phase: str, info: dict) -> None:
            gen = info["generation"]
            if gen == 0:
                return
            if phase == "start":
                started[gen] = time.perf_counter()
            elif (t0 := started.pop(gen, None)) is not None:
                self.gc_pause_seconds.labels(generation=str(gen)).observe(time.perf_counter() - t0)

        gc.callbacks.append(callback)
        return lambda: gc.callbacks.remove(callback)

    def exposition(self, api_side: bool | None = None) -> bytes:
        """Prometheus text of every family, or of one side of a supervised service (see API_FAMILIES)."""
        if api_side is None:
            return generate_latest(self.registry)
        registry = self.registry
        if api_side and os.environ.get(MULTIPROC_ENV):  # every API process's values, summed (counters of
            # processes that died and were restarted included: a counter never goes back)
            from prometheus_client.multiprocess import MultiProcessCollector

            registry = CollectorRegistry()
            MultiProcessCollector(registry, os.environ[MULTIPROC_ENV])
        # NOTE: not registry.restricted_registry: it finds nothing of a collector without describe()
        # (MultiProcessCollector). generate_latest only needs an object with collect().
        families = [mf for mf in registry.collect() if (mf.name in API_FAMILIES) == api_side]
        return generate_latest(_Families(families))

    def update_gauges(self, batcher, store) -> None:
        """Read the queue's and the store's state into their gauges (before an exposition)."""
        self.queue_depth.set(batcher.queue_depth())
        self.in_flight.set(batcher.in_flight())
        stats = store.stats()
        self.store_bytes.set(stats.bytes_used)
        self.store_items.set(stats.entries)
        self.store_evictions.set(stats.evictions)
        for call, n in stats.timeouts.items():  # (the store counts; the counter follows it)
            self.store_timeouts.labels(call=call).inc(n - self._store_timeouts_seen.get(call, 0))
            self._store_timeouts_seen[call] = n
        batch_stats = batcher.stats
        self.dropped.set(batch_stats.dropped)
        self.shed.set(batch_stats.shed)
        self.expired.set(batch_stats.expired)
        waiting = batcher.waiting()
        for gauge, per_level in ((self.waiting_images, waiting.images), (self.waiting_tokens, waiting.tokens)):
            gauge.clear()  # (a level that no longer waits leaves no stale series)
            gauge.labels(priority="0").set(0)  # always one series: the HPA's metric exists on an idle encoder
            for level, n in per_level.items():
                gauge.labels(priority=str(level)).set(n)
        self.oldest_wait.set(waiting.oldest_s)


def label_engines(texts: list[str]) -> str:
    """Several engines' expositions as one: each sample gets `engine="<i>"` (i: its position in `texts`),
    and each family is written once, so the joined text stays valid (no repeated family or series).
    Parsed and written again with prometheus_client rather than edited as text."""
    families: dict[str, object] = {}
    for i, text in enumerate(texts):
        for mf in text_string_to_metric_families(text):
            merged = families.setdefault(mf.name, mf)
            samples = [s._replace(labels={**s.labels, "engine": str(i)}) for s in mf.samples]
            if merged is mf:
                mf.samples = samples
            else:
                merged.samples.extend(samples)

    return generate_latest(_Families(list(families.values()))).decode()


class _Families:
    """Metric families already collected, in the shape generate_latest reads."""

    def __init__(self, families: list):
        self.families = families

    def collect(self):
        return self.families
