"""OpenTelemetry tracing (service/tracing.py): off by default; with --otlp-endpoint one trace per request,
from the client's traceparent through the API process to the engine process's spans, seen by a real
OTLP/HTTP receiver (tests/support/otlp.py)."""

from __future__ import annotations

import subprocess
import sys
import time

import httpx
import pytest

from service import tracing
from service.config import Settings
from service.procs.preflight import check_tracing
from service.errors import StartupError
from tests.support import imagedata as data
from tests.support.live import ServiceProcess, json_body

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"


def test_off_by_default_nothing_is_recorded_or_passed_on():
    assert not tracing.enabled()
    with tracing.server_span("x", {"traceparent": f"00-{TRACE}-{PARENT}-01"}) as span:
        assert span is None and tracing.traceparent() is None
        assert tracing.outgoing({"a": "b"}) == {"a": "b"}


def test_the_endpoint_must_be_an_http_url_and_needs_the_sdk(monkeypatch):
    assert Settings(otlp_endpoint="http://127.0.0.1:4318").otlp_endpoint == "http://127.0.0.1:4318"
    with pytest.raises(ValueError, match="must be an http"):
        Settings(otlp_endpoint="127.0.0.1:4318")
    check_tracing(None)
    check_tracing("http://127.0.0.1:4318")  # (installed here: the dev extras include tracing)
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(StartupError, match=r"\[tracing\]"):
        check_tracing("http://127.0.0.1:4318")


def test_serve_refuses_a_bad_endpoint_in_one_line(tmp_path):
    r = subprocess.run([sys.executable, "-m", "service", "serve", "--model", "tiny", "--device", "cpu", "--store",
                        str(tmp_path / "s"), "--otlp-endpoint", "localhost:4318"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and "must be an http(s) URL" in r.stderr, r.stderr


def _ancestors(span, spans) -> list[str]:
    """The span ids above `span`, nearest first, ending with its root's parent id ("" if it has none)."""
    ids = {s.span_id: s for s in spans}
    out = [span.parent_id]
    while out[-1] in ids:
        out.append(ids[out[-1]].parent_id)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("api_processes", [1, 0], ids=["api-and-engine-processes", "one-process"])
def test_one_trace_from_the_request_through_the_api_process_to_the_engine(tmp_path, api_processes):
    from tests.support.otlp import Collector

    collector = Collector()
    server = ServiceProcess(["serve", "--model", "tiny", "--device", "cpu", "--store", str(tmp_path / "store"),
                             "--api-processes", str(api_processes), "--otlp-endpoint", collector.url],
                            tmp_path / "server.log")
    try:
        blob = data.encode(data.textured_rgb(96, 64, seed=7), "PNG")
        r = httpx.post(server.url + "/encode", json=json_body(blob), timeout=60,
                       headers={"traceparent": f"00-{TRACE}-{PARENT}-01"})
        assert r.status_code == 200, r.text
        api, engine = "qwen3vl-encoder", "qwen3vl-encoder-engine" if api_processes else "qwen3vl-encoder"
        spans = collector.wait_for(TRACE, {(api, n) for n in ("encode request", "parse", "keys", "admit", "decode",
                                                             "encode")} | {(engine, n) for n in ("queue", "step",
                                                                                                  "store write")})
        by_name = {s.name: s for s in spans}
        request = by_name["encode request"]
        # The client's span is its ancestor (through the web framework's own span where it makes one): one
        # trace across the tiers.
        assert PARENT in _ancestors(request, spans)
        assert request.attributes["http.response.status_code"] == 200
        phases = [by_name[n] for n in ("parse", "keys", "admit", "decode", "encode")]
        assert all(p.parent_id == request.span_id for p in phases)
        ms = 1_000_000  # (the phases' times are converted from another clock: microseconds of slack)
        assert request.start_ns <= phases[0].start_ns + ms and phases[-1].end_ns <= request.end_ns + ms
        assert all(a.end_ns == b.start_ns for a, b in zip(phases, phases[1:]))  # one after the other
        # The engine's spans, in the engine process, under the request's span (carried in the Submit).
        queue, step, write = by_name["queue"], by_name["step"], by_name["store write"]
        assert {queue.parent_id, step.parent_id, write.parent_id} == {request.span_id}
        key = r.json()["items"][0]["key"]
        assert queue.attributes["key"] == step.attributes["key"] == write.attributes["key"] == key
        assert queue.end_ns == step.start_ns and step.end_ns == write.start_ns and queue.start_ns <= write.end_ns
        # The store write starts before the answer; it may end after it: the store answers once the entry is
        # published and then tidies (unlinks what it evicted, unmaps), which the span covers.
        assert request.start_ns <= queue.start_ns and write.start_ns <= request.end_ns + ms
        # A request without a traceparent starts a trace of its own.
        r2 = httpx.post(server.url + "/encode", json=json_body(data.encode(data.textured_rgb(96, 64, seed=8), "PNG")),
                        timeout=60)
        assert r2.status_code == 200
        other = lambda: [s for s in collector.spans if s.name == "encode request" and s.trace_id != TRACE]  # noqa: E731
        deadline = time.monotonic() + 30
        while not other() and time.monotonic() < deadline:
            time.sleep(0.1)
        (second,) = other()
        assert _ancestors(second, collector.trace(second.trace_id))[-1] == ""  # its trace's root is the server's
    finally:
        server.stop()
        collector.close()


@pytest.mark.slow  # a server of its own, stopped
def test_a_collector_that_drips_its_answer_does_not_hold_the_stop(tmp_path):
    """The last spans' export waited up to 30 s for a collector that answered a byte at a time (its reads
    never timed out): SIGTERM's shutdown took as long. The export at shutdown is bounded."""
    from tests.support.otlp import DrippingCollector

    collector = DrippingCollector()
    server = ServiceProcess(["serve", "--model", "tiny", "--device", "cpu", "--store", str(tmp_path / "store"),
                             "--otlp-endpoint", collector.url], tmp_path / "server.log")
    try:
        r = httpx.post(server.url + "/encode", json=json_body(data.encode(data.textured_rgb(96, 64, seed=9), "PNG")),
                       timeout=60)
        assert r.status_code == 200, r.text
        deadline = time.monotonic() + 30
        while collector.posts == 0:  # an export in progress, dripping
            assert time.monotonic() < deadline, "no export reached the collector"
            time.sleep(0.1)
        t0 = time.monotonic()
        assert server.stop(timeout=60)
        took = time.monotonic() - t0
    finally:
        server.stop()
        collector.close()
    assert took < 12, f"the stop took {took:.1f} s"
    assert "tracing: the last spans' export did not finish" in server.log.read_text()


@pytest.mark.slow  # an encoder (API and engine processes), an LM consumer and a router, as real processes
def test_one_trace_spans_router_encoder_engine_and_consumer_for_a_chat_with_an_image(tmp_path, tiny_checkpoint):
    """Issue 23: one chat request with an image, sent to the router, whose LM server is the bundled consumer:
    the router encodes the image, the consumer encodes it again (a hit) and generates; every process's spans
    are in the client's trace."""
    from tests.support.lm_reference import chat_messages
    from tests.support.otlp import Collector

    collector = Collector()
    store = tmp_path / "store"
    otlp = ["--otlp-endpoint", collector.url]
    encoder = ServiceProcess(["serve", "--model", str(tiny_checkpoint), "--device", "cpu", "--dtype", "float32",
                              "--store", str(store), "--api-processes", "1", *otlp], tmp_path / "enc.log", wait=False)
    started = [encoder]
    try:
        encoder.wait_ready(bound_only=True)
        consumer = ServiceProcess(["consume", "--model", str(tiny_checkpoint), "--encoder-url", encoder.url,
                                   "--store", str(store), *otlp], tmp_path / "lm.log", wait=False)
        started.append(consumer)
        consumer.wait_ready(bound_only=True)
        router = ServiceProcess(["route", "--encoder-url", encoder.url, "--vllm-url", consumer.url, *otlp],
                                tmp_path / "router.log", ready_path="/health")
        started.append(router)
        encoder.wait_ready()
        consumer.wait_ready()
        messages = chat_messages([data.photo("astronaut.png", max_side=400)], "describe the image")
        messages[1]["content"][0]["uuid"] = "astronaut-1"  # (the router forwards it; the consumer's /encode is a hit)
        r = httpx.post(router.url + "/v1/chat/completions", timeout=300, headers={"traceparent": f"00-{TRACE}-{PARENT}-01"},
                       json={"messages": messages, "max_tokens": 3})
        assert r.status_code == 200, r.text
        spans = collector.wait_for(TRACE, {("qwen3vl-router", "POST /v1/chat/completions"),
                                           ("qwen3vl-encoder", "encode request"), ("qwen3vl-encoder", "decode"),
                                           ("qwen3vl-encoder-engine", "queue"), ("qwen3vl-encoder-engine", "step"),
                                           ("qwen3vl-encoder-engine", "store write"),
                                           ("qwen3vl-consumer", "POST /v1/chat/completions"),
                                           ("qwen3vl-consumer", "generation")},
                                   counts={("qwen3vl-encoder", "encode request"): 2})
        named = lambda service, name: [s for s in spans if (s.service, s.name) == (service, name)]  # noqa: E731
        (routed,) = named("qwen3vl-router", "POST /v1/chat/completions")
        assert routed.parent_id == PARENT
        # Two encode requests (the router's, then the consumer's hit), each under its caller's span.
        encodes = named("qwen3vl-encoder", "encode request")
        assert len(encodes) == 2
        (chat,) = named("qwen3vl-consumer", "POST /v1/chat/completions")
        assert {routed.span_id, chat.span_id} <= {a for e in encodes for a in _ancestors(e, spans)}
        assert routed.span_id in _ancestors(chat, spans)  # the consumer's request came from the router's
        (generation,) = named("qwen3vl-consumer", "generation")
        assert chat.span_id in _ancestors(generation, spans) and generation.attributes["completion_tokens"] == 3
        # The image was encoded once, in the engine, under the router's encode request.
        (step,) = named("qwen3vl-encoder-engine", "step")
        assert routed.span_id in _ancestors(step, spans) and step.attributes["key"] == "astronaut-1"
        assert all(s.start_ns <= s.end_ns for s in spans)
    finally:
        for p in reversed(started):
            p.stop()
        collector.close()
