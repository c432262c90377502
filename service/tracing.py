"""OpenTelemetry tracing: off unless an OTLP endpoint is given (`--otlp-endpoint`, every command).

One trace per request across the tier: the W3C `traceparent` header is taken from each request and
passed on (router -> encoder -> consumer), and across the API/engine process boundary in the Submit
message. Spans:

    router       route                              (lm/router.py)
    encoder      encode request -> parse, keys, admit, decode, encode   (api/app.py, from its Server-Timing phases)
    engine       queue, step, store write           (per image, under its submitting request; engine/writer.py)
    consumer     chat -> generation                 (lm/chat/app.py)

The engine's spans are recorded after the fact, with the times the step loop and the writer noted
(`Stamps`): nothing is started or ended on the step loop's thread, and with tracing off nothing is
recorded at all. Exported over OTLP/HTTP (protobuf) in batches by the SDK's own thread.

NOTE: OpenTelemetry's tracer provider is process-wide by design (as logging is): `setup` installs it
once, in each process's entry point; everything else asks `enabled()` first.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

log = logging.getLogger(__name__)

TRACEPARENT = "traceparent"
# How long a finished span waits for its batch to be exported: short, so that a trace is complete within a
# second of its request (a collector, a test) while spans still go in batches under load.
EXPORT_DELAY_MS = 500
# How long a process's stop waits for its last spans to be exported. The SDK's own shutdown waits up to 30 s
# for an export in progress, and an export's timeout bounds each read, not the export: a collector that
# answers a byte at a time held a stop for those 30 s. Past this the spans left are dropped, and said so.
SHUTDOWN_TIMEOUT_S = 3.0

_provider = None  # the SDK's TracerProvider once setup() ran with an endpoint (see the NOTE above)


class TracingUnavailable(RuntimeError):
    """An OTLP endpoint was given but OpenTelemetry's SDK and exporter are not installed."""


def setup(service_name: str, endpoint: str | None) -> None:
    """Export this process's spans to `endpoint` (an OTLP/HTTP collector's base URL, e.g.
    http://127.0.0.1:4318) as `service_name`; nothing when `endpoint` is None."""
    global _provider
    if not endpoint or _provider is not None:
        return
    try:
        from opentelemetry import trace
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as e:
        raise TracingUnavailable(f"--otlp-endpoint needs OpenTelemetry's SDK and OTLP exporter ({e}): pip install "
                                 "'qwen3vl-encoder-service[tracing]'") from None
    # (shutdown_on_exit=False: the SDK's own exit hook is the unbounded shutdown; ours is registered instead)
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}), shutdown_on_exit=False)
    exporter = OTLPSpanExporter(endpoint=endpoint.rstrip("/") + "/v1/traces", timeout=5)
    provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=EXPORT_DELAY_MS))
    trace.set_tracer_provider(provider)
    _provider = provider
    atexit.register(shutdown)
    log.info("tracing: spans of %s go to %s (OTLP/HTTP)", service_name, endpoint)


def enabled() -> bool:
    return _provider is not None


def shutdown(timeout_s: float = SHUTDOWN_TIMEOUT_S) -> None:
    """Export what is left, for at most `timeout_s` (a process's last act: uvicorn's re-raised SIGTERM skips
    atexit handlers, so the servers call it themselves; it runs at exit too, once only)."""
    global _provider
    provider, _provider = _provider, None
    if provider is None:
        return
    # NOTE: in a daemon thread, given up on after the timeout: the SDK's export cannot be interrupted, and a
    # daemon thread stuck in a read does not keep the process alive.
    done = threading.Thread(target=provider.shutdown, name="tracing-shutdown", daemon=True)
    done.start()
    done.join(timeout_s)
    if done.is_alive():
        log.warning("tracing: the last spans' export did not finish within %.0f s; the spans left are dropped "
                    "(is the collector at --otlp-endpoint answering?)", timeout_s)


def _tracer():
    from opentelemetry import trace

    return trace.get_tracer("qwen3vl-encoder")


def _context(traceparent: str | None):
    """The OpenTelemetry context whose parent is `traceparent` (None: a new trace)."""
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator().extract({TRACEPARENT: traceparent} if traceparent else {})


@contextmanager
def server_span(name: str, headers: Mapping[str, str], **attributes) -> Iterator[object | None]:
    """A request's span, the current one while the block runs. Yields the span (None with tracing off).

    Its parent: the framework's own request span where there is one (FastAPI >= 0.165 makes one, from
    the same `traceparent`, once a tracer provider is set), else the request's `traceparent` header."""
    if not enabled():
        yield None
        return
    from opentelemetry import trace
    from opentelemetry.trace import SpanKind

    if trace.get_current_span().get_span_context().is_valid:
        context, kind = None, SpanKind.INTERNAL
    else:
        context, kind = _context(headers.get(TRACEPARENT)), SpanKind.SERVER
    with _tracer().start_as_current_span(name, context=context, kind=kind, attributes=attributes) as span:
        yield span


@contextmanager
def span(name: str, **attributes) -> Iterator[object | None]:
    """A child of the current span while the block runs (None with tracing off)."""
    if not enabled():
        yield None
        return
    with _tracer().start_as_current_span(name, attributes=attributes) as s:
        yield s


def traceparent() -> str | None:
    """The current span's `traceparent` (to pass on to the next process), or None."""
    if not enabled():
        return None
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier)
    return carrier.get(TRACEPARENT)


def outgoing(headers: Mapping[str, str] | None = None) -> dict[str, str]:
    """`headers` plus the current span's `traceparent` (when tracing is on and a span is current)."""
    out = dict(headers or {})
    if (tp := traceparent()) is not None:
        out[TRACEPARENT] = tp
    return out


def record(name: str, parent: str | None, start_ns: int, end_ns: int, **attributes) -> None:
    """A span that already happened (epoch nanoseconds), child of the `parent` traceparent."""
    if not enabled() or not parent or end_ns < start_ns:
        return
    s = _tracer().start_span(name, context=_context(parent), start_time=start_ns, attributes=attributes)
    s.end(end_time=end_ns)


def record_phases(phases: list[tuple[str, float]], started: float, **attributes) -> None:
    """Child spans of the current span, one per phase (name, seconds) in order, the first beginning at
    `started` (a time.perf_counter() reading): a request's Server-Timing phases as spans."""
    if not enabled():
        return
    parent = traceparent()
    at = time.time_ns() - int((time.perf_counter() - started) * 1e9)  # `started` on the epoch clock
    for name, seconds in phases:
        end = at + int(seconds * 1e9)
        record(name, parent, at, end, **attributes)
        at = end


@dataclass
class Stamps:
    """When an engine did what to one traced item (epoch ns): the queue, step and store-write spans are
    recorded from these, under the submitting request's `traceparent`."""

    traceparent: str
    submitted: int
    staged: int = 0  # its (first) step began staging
    computed: int = 0  # its (last) step's output copy was done

    def record(self, stored: int, **attributes) -> None:
        record("queue", self.traceparent, self.submitted, self.staged or self.submitted, **attributes)
        record("step", self.traceparent, self.staged, self.computed, **attributes)
        record("store write", self.traceparent, self.computed, stored, **attributes)


def now_ns() -> int:
    return time.time_ns()
