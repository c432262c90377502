"""An OTLP/HTTP trace receiver for tests: what an OpenTelemetry collector does with `POST /v1/traces`
(protobuf), keeping every span it is sent. Bound to 127.0.0.1 on a free port; `url` is what
--otlp-endpoint takes."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass(frozen=True)
class Span:
    service: str  # the sending process's service.name
    name: str
    trace_id: str  # hex
    span_id: str
    parent_id: str  # "" for a root span
    start_ns: int
    end_ns: int
    attributes: dict = field(default_factory=dict, compare=False, hash=False)


class Collector:
    def __init__(self):
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (ExportTraceServiceRequest,
                                                                              ExportTraceServiceResponse)

        self.spans: list[Span] = []
        self._lock = threading.Lock()
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                if self.path != "/v1/traces":
                    self.send_error(404)
                    return
                request = ExportTraceServiceRequest.FromString(body)
                got = []
                for rs in request.resource_spans:
                    service = next((a.value.string_value for a in rs.resource.attributes if a.key == "service.name"), "")
                    for ss in rs.scope_spans:
                        for s in ss.spans:
                            attrs = {a.key: _value(a.value) for a in s.attributes}
                            got.append(Span(service, s.name, s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(),
                                            s.start_time_unix_nano, s.end_time_unix_nano, attrs))
                with collector._lock:
                    collector.spans += got
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args):
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def trace(self, trace_id: str) -> list[Span]:
        with self._lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def wait_for(self, trace_id: str, names: set[tuple[str, str]], timeout: float = 60,
                 counts: dict[tuple[str, str], int] | None = None, settle_s: float = 1.0) -> list[Span]:
        """The trace's spans once every (service, name) in `names` has arrived (at least `counts[pair]` of a
        pair given there) and no other span of the trace for `settle_s` (deadline: TimeoutError).

        NOTE: why settle: each process exports its spans in batches of its own, on its own clock; a fresh-clone
        run on a loaded machine saw the trace's first 'encode request' while the second, and the spans
        between it and its caller, were still on their way."""
        deadline = time.monotonic() + timeout
        last, since = -1, time.monotonic()
        while True:
            spans = self.trace(trace_id)
            have = [(s.service, s.name) for s in spans]
            if len(spans) != last:
                last, since = len(spans), time.monotonic()
            complete = names <= set(have) and all(have.count(k) >= n for k, n in (counts or {}).items())
            if complete and time.monotonic() - since >= settle_s:
                return spans
            if time.monotonic() > deadline:
                raise TimeoutError(f"spans {sorted(names - set(have))} (counts {counts}) of trace {trace_id} "
                                   f"never arrived; got {sorted(have)}")
            time.sleep(0.1)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def _value(v):
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


class DrippingCollector:
    """A collector that takes each export's body, then answers it one byte a second (a Content-Length of a
    kilobyte): an export that never ends, though no read ever times out. `posts`: the exports it got."""

    def __init__(self):
        self.posts = 0
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (http.server's name)
                self.rfile.read(int(self.headers.get("content-length", 0)))
                collector.posts += 1
                try:
                    self.send_response(200)
                    self.send_header("content-type", "application/x-protobuf")
                    self.send_header("content-length", "1000")
                    self.end_headers()
                    for _ in range(1000):
                        self.wfile.write(b"\0")
                        self.wfile.flush()
                        time.sleep(1)
                except OSError:  # the exporter gave up
                    pass

            def log_message(self, *args):
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
