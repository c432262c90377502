"""The load test (service/loadtest/, `qwen3vl-encoder loadtest`): its pure helpers, the payloads it builds,
the loopback guard, the pre-flight check, the stale-connection retry, and real runs against the service
(tiny model): closed loop, --rate, --processes, --images DIR, replays that catch a corrupted store file,
Ctrl-C, the report and the plot."""

from __future__ import annotations

import argparse
import asyncio
import base64
import http.server
import io
import json
import math
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

import numpy as np
import pytest
from PIL import Image

from service.config import Settings
from service.engine.loader import load_model
from service.loadtest import cli
from service.loadtest.checks import Tally, compare_embeddings, reference_model_from_id
from service.loadtest.client import post_encode
from service.loadtest.driver import Progress
from service.loadtest.media import (ImageSpec, build_payload, encode_image, image_files, image_seed, is_video_url,
                                    make_image, make_video, parse_sizes, request_images, request_urls)
from service.loadtest.plot import plot_figure, plot_totals, write_plot
from service.loadtest.report import Result, Run, format_table, percentile, strict_json, summarize, timeseries
from tests.support.live import RawHTTPServer, ServiceProcess, live_server, refused_port
from tests.support.proctree import alive, descendants

ROOT = Path(__file__).resolve().parents[3]


def _decode_data_url(url: str) -> tuple[str, Image.Image]:
    head, sep, b64 = url.partition(",")
    assert sep and head.startswith("data:") and head.endswith(";base64"), head
    mime = head[len("data:") : -len(";base64")]
    img = Image.open(io.BytesIO(base64.b64decode(b64, validate=True)))
    img.load()
    return mime, img


# ---- pure helpers ----------------------------------------------------------------------------------
def test_parse_sizes():
    assert parse_sizes("448x448") == [(448, 448)]
    assert parse_sizes("1024x768, 64X32 ,1x1") == [(1024, 768), (64, 32), (1, 1)]


@pytest.mark.parametrize("bad", ["", "448", "448x", "x448", "0x10", "10x0", "-1x5", "4.5x4", "axb", "448x448,", "3x4x5"])
def test_parse_sizes_rejects_bad_input(bad):
    with pytest.raises(ValueError, match="WIDTHxHEIGHT"):
        parse_sizes(bad)


@pytest.mark.parametrize(
    "url, loopback",
    [
        ("http://127.0.0.1:8080", True),
        ("http://127.3.4.5", True),  # all of 127.0.0.0/8
        ("http://localhost:8080/x", True),
        ("http://LOCALHOST", True),
        ("http://api.localhost:1", True),
        ("http://[::1]:8080", True),
        ("http://10.0.0.1:8080", False),
        ("http://192.168.1.1", False),
        ("http://0.0.0.0:8080", False),
        ("http://example.com", False),
        ("http://localhost.example.com", False),
        ("http://127.0.0.1.example.com", False),
        ("http://[::2]:80", False),
        ("not a url", False),
        ("", False),
    ],
)
def test_is_loopback_url(url, loopback):
    assert cli.is_loopback_url(url) is loopback


def test_percentile_matches_numpy():
    rng = np.random.default_rng(3)
    for n in (1, 2, 5, 100, 101):
        values = rng.exponential(10.0, size=n).tolist()
        shuffled = list(values)
        for q in (0, 1, 25, 50, 90, 99, 99.9, 100):
            assert percentile(shuffled, q) == pytest.approx(float(np.percentile(values, q)), rel=1e-12, abs=1e-12)
        assert shuffled == values  # does not sort the caller's list in place
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert math.isnan(percentile([], 50))


def test_summarize_and_format_table():
    R = Result
    results = [
        R(200, 0.010, 2, cached=1),
        R(200, 0.030, 2, retried=True),
        R(200, 0.020, 2, cached=2),
        R(429, 0.001, 2, error="overloaded"),
        R(429, 0.002, 2, error="overloaded"),
        R(500, 0.5, 2, error="backend_error"),
        R("error:ConnectError", 0.003, 0, retried=True, error="All connection attempts failed"),
    ]
    s = summarize(results, wall_s=2.0)
    assert (s.requests, s.ok_requests, s.ok_images, s.cached_images, s.rejected_429) == (7, 3, 6, 3, 2)
    assert s.images_per_s == pytest.approx(3.0) and s.requests_per_s == pytest.approx(1.5)
    lat = s.latency_ms  # of the 200 answers only: 10, 20, 30 ms
    assert lat["p50"] == pytest.approx(20.0) and lat["mean"] == pytest.approx(20.0) and lat["max"] == pytest.approx(30.0)
    assert lat["p90"] == pytest.approx(float(np.percentile([10, 20, 30], 90)))
    assert lat["p99"] == pytest.approx(float(np.percentile([10, 20, 30], 99)))
    assert s.status_counts == {"200": 3, "429": 2, "500": 1, "error:ConnectError": 1}
    assert s.retries == 2
    assert s.errors == {"429 overloaded": 2, "500 backend_error": 1,
                        "error:ConnectError All connection attempts failed": 1}

    replay, verify = Tally(), Tally()
    for outcome in ("ok", "ok", "missing", "wrong"):
        replay.add(outcome, "k: bad" if outcome == "wrong" else "")
    verify.add("ok")
    verify.worst_rel_err = 3.5e-7
    table = format_table(s, replay, verify)
    lines = table.splitlines()
    assert len(lines) == 10
    assert lines[0].split() == ["wall", "time", "2.00", "s"]
    assert "7 (3 ok, 2 rejected with 429)" in lines[1]
    assert "6 (3 cached)" in lines[2]
    assert "3.00 images/s, 1.50 requests/s" in lines[3]
    assert "p50 20.0  p90 28.0  p99 29.8  max 30.0" in lines[4]
    assert lines[5].endswith("200: 3, 429: 2, 500: 1, error:ConnectError: 1")
    assert lines[6].endswith("2 (stale keep-alive connections)")
    assert lines[7].startswith("errors") and "429 overloaded: 2" in lines[7]
    assert lines[8].endswith("4: 2 ok, 1 missing, 1 wrong") and replay.problems == ["k: bad"]
    assert lines[9].endswith("1: 1 ok, 0 wrong; worst rel. error 3.50e-07")
    # Values line up in one column.
    assert len({len(line) - len(line[len("throughput"):].lstrip()) for line in lines}) == 1
    # Without retries, errors or checks: the six basic rows only.
    assert len(format_table(summarize(results[:1], 1.0)).splitlines()) == 6


def test_summarize_with_no_successes():
    s = summarize([Result(503, 0.1, 1)], wall_s=1.0)
    assert s.ok_requests == 0 and s.ok_images == 0 and s.images_per_s == 0.0
    assert all(math.isnan(v) for v in s.latency_ms.values())
    assert "nan" in format_table(s)  # printable, no exception
    assert math.isnan(summarize([], wall_s=0.0).images_per_s)


# ---- payloads ----------------------------------------------------------------------------------------
def _spec(argv):
    args = cli.build_parser().parse_args(argv)
    return ImageSpec(tuple(parse_sizes(args.sizes)), args.images_per_request, args.unique, args.pattern,
                     args.format, 1234 if args.seed is None else args.seed)


@pytest.mark.parametrize("pattern", ["gradient", "noise"])
def test_build_payload_data_urls_decode_to_the_generated_images(pattern):
    spec = _spec(["--sizes", "48x32,20x70", "--images-per-request", "3", "--pattern", pattern, "--seed", "7"])
    payload = build_payload(request_urls(spec, 1))
    payload = json.loads(json.dumps(payload))  # it is what goes over the wire as JSON
    parts = payload["images"]
    assert len(parts) == 3 and set(payload) == {"images"}
    sizes = [(48, 32), (20, 70)]
    for j, part in enumerate(parts):
        assert part["type"] == "image_url" and set(part) == {"type", "image_url"}
        mime, img = _decode_data_url(part["image_url"]["url"])
        assert mime == "image/png" and img.format == "PNG" and img.mode == "RGB"
        w, h = sizes[(1 * 3 + j) % 2]  # sizes cycle over the flat image index
        assert img.size == (w, h)
        expected = make_image(w, h, seed=1 * 3 + j, pattern=pattern, run_seed=7)
        assert expected.shape == (h, w, 3) and expected.dtype == np.uint8
        np.testing.assert_array_equal(np.asarray(img), expected)  # PNG is lossless


def test_jpeg_format():
    spec = _spec(["--sizes", "40x24", "--format", "jpeg", "--seed", "1"])
    (url,) = request_urls(spec, 0)
    mime, img = _decode_data_url(url)
    assert mime == "image/jpeg" and img.format == "JPEG" and img.size == (40, 24)
    expected = make_image(40, 24, 0, "gradient", 1).astype(np.int16)
    assert np.abs(np.asarray(img).astype(np.int16) - expected).mean() < 4  # lossy, but the same picture


def test_unique_images_are_distinct_and_repeat_images_identical():
    unique = _spec(["--sizes", "32x32", "--images-per-request", "2", "--unique", "--seed", "5"])
    assert unique.unique is True
    urls = [u for i in range(4) for u in request_urls(unique, i)]
    assert len(urls) == 8 and len(set(urls)) == 8
    pixels = [np.asarray(_decode_data_url(u)[1]) for u in urls]
    assert all(not np.array_equal(pixels[0], p) for p in pixels[1:])

    repeat = _spec(["--sizes", "32x32", "--images-per-request", "2", "--repeat", "--seed", "5"])
    assert repeat.unique is False
    urls = [u for i in range(4) for u in request_urls(repeat, i)]
    assert len(set(urls)) == 1

    # --repeat with two sizes: one image per size, identical wherever that size comes round again.
    two = _spec(["--sizes", "32x32,24x16", "--repeat", "--seed", "5"])
    per_request = [request_urls(two, i)[0] for i in range(4)]
    assert per_request[0] == per_request[2] and per_request[1] == per_request[3] and per_request[0] != per_request[1]
    assert _decode_data_url(per_request[1])[1].size == (24, 16)

    # The run seed changes every --unique image (no cache hits carried over from an earlier run).
    other_run = _spec(["--sizes", "32x32", "--seed", "6"])
    assert request_urls(other_run, 0) != request_urls(_spec(["--sizes", "32x32", "--seed", "5"]), 0)


def test_image_seed():
    seeds = [image_seed(i, j, 3, 2, unique=True) for i in range(4) for j in range(3)]
    assert seeds == list(range(12))
    assert [image_seed(i, j, 3, 2, unique=False) for i in range(2) for j in range(3)] == [0, 1, 0, 1, 0, 1]


def test_bad_pattern_and_format():
    with pytest.raises(ValueError, match="unknown pattern"):
        make_image(8, 8, 0, "plaid")
    with pytest.raises(ValueError, match="unknown format"):
        encode_image(np.zeros((4, 4, 3), np.uint8), "gif")


def test_timeseries_bins():
    R = Result
    results = [R(200, 0.1, 2, t_end=0.5), R(200, 0.3, 2, t_end=0.9), R(429, 0.01, 2, t_end=1.2), R(200, 0.2, 1, t_end=2.4)]
    ts = timeseries(results, wall_s=2.5, bin_s=1.0)
    assert [p["t"] for p in ts] == [1.0, 2.0, 2.5]  # the last bin ends with the run
    assert [p["images_per_s"] for p in ts] == [4.0, 0.0, pytest.approx(2.0)]  # 1 image in a 0.5 s bin
    assert ts[0]["p50_ms"] == pytest.approx(200.0) and ts[0]["p99_ms"] == pytest.approx(298.0)
    assert ts[1]["p50_ms"] is None and ts[1]["status"] == {"429": 1}
    assert ts[2]["status"] == {"200": 1} and ts[2]["p99_ms"] == pytest.approx(200.0)
    assert timeseries([], 0.0) == []
    assert len(timeseries(results, wall_s=500.0)) == 100  # default: about 100 bins


def test_compare_embeddings():
    rng = np.random.default_rng(0)
    ref = rng.standard_normal((8, 12)).astype(np.float32)
    assert compare_embeddings(ref.copy(), (1, 4, 8), ref, (1, 4, 8), 1e-3) == (True, 0.0, "")
    noisy = ref + 1e-4 * rng.standard_normal(ref.shape).astype(np.float32)
    ok, rel, problem = compare_embeddings(noisy, [1, 4, 8], ref, (1, 4, 8), 1e-3)
    assert ok and 1e-5 < rel < 1e-3 and problem == ""
    ok, rel, problem = compare_embeddings(ref[::-1].copy(), (1, 4, 8), ref, (1, 4, 8), 1e-3)  # rows of another image
    assert not ok and rel > 0.5 and problem.startswith("relative L2 error")
    nan = ref.copy()
    nan[0, 0] = np.nan
    assert compare_embeddings(nan, (1, 4, 8), ref, (1, 4, 8), 1.0)[0] is False
    ok, rel, problem = compare_embeddings(ref, (1, 8, 4), ref, (1, 4, 8), 1e-3)
    assert (ok, rel) == (False, None) and "--max-pixels" in problem
    ok, rel, problem = compare_embeddings(ref[:4], (1, 4, 8), ref, (1, 4, 8), 1e-3)
    assert (ok, rel) == (False, None) and problem == "shape [4, 12] != reference [8, 12]"


def test_reference_model_from_id_and_strict_json():
    assert reference_model_from_id("preset:tiny:seed0") == ("tiny", 0)
    assert reference_model_from_id("preset:qwen3-vl-4b:seed12") == ("qwen3-vl-4b", 12)
    assert reference_model_from_id("Qwen3-VL-4B@0123abcd") is None
    assert reference_model_from_id("preset:tiny:x") is None
    assert strict_json({"a": [math.nan, 1.5, (math.inf, 2)], "b": "NaN"}) == {"a": [None, 1.5, [None, 2]], "b": "NaN"}


def test_image_files_and_folder_payloads(tmp_path):
    for name in ("b.png", "a.JPG", "notes.txt", "c.webp"):
        (tmp_path / name).write_bytes(b"x")
    (tmp_path / "sub.png").mkdir()
    files = image_files(tmp_path)
    assert [Path(f).name for f in files] == ["a.JPG", "b.png", "c.webp"]
    spec = ImageSpec(((8, 8),), 2, True, "gradient", "png", 0, tuple(files))
    images = request_images(spec, 1, keep_every=3)  # flat indices 2 and 3: files c, a
    assert [url.split(",")[0] for url, _ in images] == ["data:image/webp;base64", "data:image/jpeg;base64"]
    assert [blob for _, blob in images] == [None, b"x"]  # bytes kept for flat index 3 only


# ---- the command line ----------------------------------------------------------------------------------
def _no_traffic(monkeypatch):
    """Make any attempt to reach a server or run the load fail the test (and record it)."""
    calls = []

    def forbidden(*args, **kwargs):
        calls.append(args)
        raise AssertionError("the server was contacted or the load started")

    monkeypatch.setattr(cli, "preflight", forbidden)
    monkeypatch.setattr(cli, "run_load", forbidden)
    return calls


@pytest.mark.parametrize("url", ["http://10.0.0.1:8080", "http://example.com", "http://192.168.0.5:80"])
def test_remote_url_refused_without_allow_remote(monkeypatch, capsys, tmp_path, url):
    calls = _no_traffic(monkeypatch)
    out = tmp_path / "r.json"
    with pytest.raises(SystemExit) as exc:
        cli.main(["--url", url, "--requests", "1", "--out", str(out)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"{url} is not a loopback address" in err and "--allow-remote" in err
    assert calls == [] and not out.exists()


def test_allow_remote_lets_the_run_start(monkeypatch, capsys):
    """The guard is what refused above: with --allow-remote the same URL reaches the load (stubbed here)."""
    seen = []
    monkeypatch.setattr(cli, "preflight", lambda url, headers, wait: seen.append(url) or {"model": "m"})
    monkeypatch.setattr(cli, "run_load", lambda args, verifier, quiet: Run(wall_s=1.0))
    assert cli.main(["--url", "http://10.0.0.1:8080", "--allow-remote", "--requests", "1"]) == 1  # 0 ok requests
    assert seen == ["http://10.0.0.1:8080"]
    assert "0 ok" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--sizes", "64"], "bad size"),
        (["--concurrency", "0"], "must be positive"),
        (["--requests", "0"], "must be positive"),
        (["--duration-s", "0"], "must be positive"),
        (["--processes", "0"], "must be positive"),
        (["--rate", "-1"], "not negative"),
        (["--unique", "--repeat"], "not allowed with"),
        (["--concurrency", "2", "--processes", "3"], "each process needs one"),
        (["--verify"], "give --replay-every N too"),
        (["--images", "/nonexistent/dir"], "not a directory with image files"),
    ],
)
def test_bad_arguments_refused(monkeypatch, capsys, argv, message):
    calls = _no_traffic(monkeypatch)
    with pytest.raises(SystemExit) as exc:
        cli.main(["--url", "http://127.0.0.1:9"] + argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err and calls == []


# ---- pre-flight -----------------------------------------------------------------------------------------
def test_unreachable_server_is_one_clear_line_and_exit_2(capsys, tmp_path):
    out = tmp_path / "r.json"
    with refused_port() as port:  # nothing listens there
        url = f"http://127.0.0.1:{port}"
        t0 = time.monotonic()
        assert cli.main(["--url", url, "--out", str(out)]) == 2
        assert time.monotonic() - t0 < 10  # fails fast, no load started
    captured = capsys.readouterr()
    assert captured.out == ""  # no table of NaNs
    lines = captured.err.strip().splitlines()
    assert lines == [f"error: cannot reach the encoder service at {url} (connection refused): start one (`make run`, "
                     "or `make serve-tiny` for a quick one) or pass --url"]
    assert not out.exists()


def test_a_server_still_starting_is_waited_for_by_default(tmp_path, capsys):
    """`make loadtest` right after `make serve-tiny` exited 2, "not ready": the load test now waits for /ready
    (--wait-ready, 60 s by default), saying so, as `make try` does."""
    server = ServiceProcess(["serve", "--model", "tiny", "--device", "cpu", "--store", str(tmp_path / "store"),
                             "--decode-workers", "1"], tmp_path / "server.log", wait=False)
    try:
        server.wait_ready(bound_only=True)  # bound, its model still loading
        assert httpx.get(server.url + "/ready", timeout=30).status_code == 503
        assert cli.main(["--url", server.url, "--requests", "4", "--concurrency", "2", "--sizes", "64x64",
                         "--gen-workers", "1", "--timeout-s", "60"]) == 0
        captured = capsys.readouterr()
        assert f"waiting for the encoder service at {server.url} to be ready (phase: " in captured.err
        assert "4 (4 ok, 0 rejected with 429)" in captured.out
    finally:
        assert server.stop()


class _FixedAnswer(http.server.BaseHTTPRequestHandler):
    status = 503

    def do_GET(self):  # noqa: N802 (http.server's naming)
        body = b'{"ready": false}'
        self.send_response(self.status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("status, message", [
    (503, "is not ready (/ready answered 503, phase: starting) after 1 s: it may still be loading its model; wait, "
          "or pass --wait-ready SECONDS"),
    (404, "/ready answered HTTP 404: is this the encoder service?"),
])
def test_a_server_that_is_not_ready_or_not_ours(capsys, status, message):
    handler = type("Handler", (_FixedAnswer,), {"status": status})
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{httpd.server_address[1]}"
        t0 = time.monotonic()
        assert cli.main(["--url", url, "--wait-ready", "1"]) == 2
        assert time.monotonic() - t0 >= (1 if status == 503 else 0)  # 503 is retried for --wait-ready, 404 is not
    finally:
        httpd.shutdown()
        httpd.server_close()
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert captured.out == "" and message in lines[-1] and lines[-1].startswith("error: "), lines
    assert lines[:-1] == ([f"waiting for the encoder service at {url} to be ready (phase: starting)"]
                          if status == 503 else [])


# ---- the stale keep-alive retry -------------------------------------------------------------------------
def _post_twice(script):
    async def scenario():
        server = RawHTTPServer(script)
        tcp = await asyncio.start_server(server.handle, "127.0.0.1", 0)
        port = tcp.sockets[0].getsockname()[1]
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
                first = await post_encode(client, build_payload(["data:image/png;base64,AA=="]))
                second = await post_encode(client, build_payload(["data:image/png;base64,AA=="]))
        finally:
            tcp.close()
            await tcp.wait_closed()
        return first, second, server

    return asyncio.run(scenario())


def test_post_encode_retries_once_on_a_stale_keep_alive_connection():
    # Connection 1 answers its first request, then closes on the second: the client sent it on a
    # reused connection, so it is sent again, on connection 2, and answered.
    (r1, retried1), (r2, retried2), server = _post_twice(lambda conn, req: not (conn == 1 and req == 2))
    assert isinstance(r1, httpx.Response) and r1.status_code == 200 and retried1 is False
    assert isinstance(r2, httpx.Response) and r2.status_code == 200 and retried2 is True
    assert (server.connections, server.requests) == (2, 3)


def test_post_encode_does_not_retry_on_a_fresh_connection():
    # Every connection closes on its first request: that says something about the server, not about a
    # stale connection, so it is reported as is (one request each, no retry).
    (r1, retried1), (r2, retried2), server = _post_twice(lambda conn, req: False)
    assert isinstance(r1, httpx.RemoteProtocolError) and retried1 is False
    assert isinstance(r2, httpx.RemoteProtocolError) and retried2 is False
    assert (server.connections, server.requests) == (2, 2)


# ---- real runs against the service -------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_model():
    return load_model(Settings(model="tiny", device="cpu"))


def _serve(tmp_path, model):
    settings = Settings(model="tiny", device="cpu", store=tmp_path / "store", decode_workers=1, max_wait_ms=20)
    return live_server(settings, model)


def _entries(store: Path) -> list[str]:
    return sorted(p.parent.name for p in store.glob("*/encoder_cache.safetensors"))


def test_real_run_report_and_plot(tmp_path, capsys, tiny_model):
    out = tmp_path / "results.json"
    with _serve(tmp_path, tiny_model) as (url, app):
        rc = cli.main(["--url", url, "--requests", "12", "--concurrency", "4", "--sizes", "64x64", "--gen-workers", "1",
                       "--timeout-s", "60", "--replay-every", "3", "--verify", "--store-root", str(tmp_path / "store"),
                       "--out", str(out)])
        stored = _entries(tmp_path / "store")
    assert rc == 0
    printed = capsys.readouterr().out
    assert "12 (12 ok, 0 rejected with 429)" in printed
    assert "replayed    4: 4 ok, 0 missing, 0 wrong" in printed
    assert f"report: {out}" in printed and f"plot: {out.with_suffix('.png')}" in printed

    report = json.loads(out.read_text())  # strict JSON (no NaN)
    assert set(report) == {"settings", "server", "summary", "interrupted", "cancelled_in_flight", "client_errors",
                           "timeseries", "plot", "replay", "verify"}
    assert report["server"]["model"] == "preset:tiny:seed0" and report["server"]["dtype"] == "float32"
    assert report["interrupted"] is False and report["cancelled_in_flight"] == 0 and report["client_errors"] == []
    s = report["summary"]
    assert s["requests"] == 12 and s["ok_requests"] == 12 and s["ok_images"] == 12
    assert s["status_counts"] == {"200": 12} and s["rejected_429"] == 0 and s["retries"] == 0 and s["errors"] == {}
    assert s["cached_images"] == 0  # --unique (default): every image a fresh encode
    assert s["wall_s"] > 0 and s["images_per_s"] == pytest.approx(12 / s["wall_s"])
    lat = s["latency_ms"]
    assert set(lat) == {"p50", "p90", "p99", "mean", "max"}
    assert all(isinstance(v, float) and v > 0 for v in lat.values())
    assert lat["p50"] <= lat["p90"] <= lat["p99"] <= lat["max"] <= s["wall_s"] * 1000

    # Every request lands in one time bin; the bins' images add up to the total.
    ts = report["timeseries"]
    assert ts and [p["t"] for p in ts] == sorted(p["t"] for p in ts) and ts[-1]["t"] == pytest.approx(s["wall_s"], abs=1e-3)
    assert sum(sum(p["status"].values()) for p in ts) == 12
    assert sum(p["images"] for p in ts) == 12
    # The rate is images / bin width (every bin but the last, which may be shorter, is t[0] wide). The
    # last bin can be a fraction of a millisecond: its rate is not rebuilt from t's 3 decimals (that
    # failed CI once with 12.015 images for 12).
    for p in ts[:-1]:
        assert p["images_per_s"] == pytest.approx(p["images"] / ts[0]["t"], rel=1e-2)

    # Replays: flat images 0, 3, 6, 9; each verified against the float32 reference.
    assert report["replay"] == {"every": 3, "store_root": str(tmp_path / "store"), "ok": 4, "missing": 0, "wrong": 0,
                                "problems": []}
    v = report["verify"]
    assert (v["ok"], v["wrong"], v["skipped"], v["reference"]) == (4, 0, 0, "preset:tiny:seed0")
    assert v["tolerance"] == 1e-3 and 0 <= v["worst_rel_err"] <= 1e-5  # same arithmetic: float32 on the CPU

    settings_out = report["settings"]
    assert settings_out["url"] == url and settings_out["requests"] == 12 and settings_out["concurrency"] == 4
    assert settings_out["unique"] is True and isinstance(settings_out["seed"], int)  # recorded fresh seed
    assert len(stored) == 12  # twelve distinct images reached the store

    png = Path(report["plot"])
    assert png == out.with_suffix(".png") and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with Image.open(png) as img:
        assert img.format == "PNG" and img.size == (900, 900)
    # The same figure from this real report: one time axis, the totals in the title, the overall rate
    # images / wall time.
    import matplotlib.pyplot as plt

    fig = plot_figure(report, "real run")
    try:
        got = _plot_properties(fig)
        assert got["xlim_rate"] == got["xlim_lat"] == (0.0, s["wall_s"])
        assert got["overall"].get_ydata()[0] == pytest.approx(12 / s["wall_s"], rel=1e-12)
        assert got["title"].splitlines()[1].startswith(
            f"12 images in 12 requests, {s['wall_s']:.2f} s: {12 / s['wall_s']:.3g} img/s overall; p50 ")
        assert got["title"].endswith("; errors 0")
        assert sum(b.get_height() * b.get_width() for b in got["bars"]) == pytest.approx(12, rel=1e-2)
    finally:
        plt.close(fig)


def _plot_report(results, wall_s: float) -> dict:
    """The parts of a report the plot reads, built as build_report builds them (strict JSON)."""
    from dataclasses import asdict

    return strict_json({"summary": asdict(summarize(results, wall_s)), "timeseries": timeseries(results, wall_s)})


def _plot_properties(fig) -> dict:
    """What the throughput and latency panels show, read back from the figure."""
    import matplotlib.patches

    ax_rate, ax_lat = fig.axes[0], fig.axes[1]
    bars = [b for b in ax_rate.patches if isinstance(b, matplotlib.patches.Rectangle)]
    (overall,) = [line for line in ax_rate.get_lines() if line.get_linestyle() == "--"]
    lines = {line.get_label(): line for line in ax_lat.get_lines()}
    return {"xlim_rate": ax_rate.get_xlim(), "xlim_lat": ax_lat.get_xlim(), "bars": bars, "overall": overall,
            "p50": lines["p50"], "p99": lines["p99"], "title": fig._suptitle.get_text(),
            "legend": [t.get_text() for t in ax_rate.get_legend().get_texts()]}


def test_plot_of_a_sparse_slow_run_one_time_axis_totals_and_rates_that_agree():
    """The issue's run, rebuilt: 4 slow requests (the 2B preset on two cores) answered at ~85 s and at
    120 s, and one 429. Before, the latency panel autoscaled to the two bins with answers while the
    throughput panel spanned the run, p99 covered p50 (one answer per bin: equal), and a bin's burst
    (2 images in a 1.2 s bin) was the only rate on the plot, 50 times the run's 0.033 img/s."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    R = Result
    results = [R(200, 84.9, 1, t_end=84.9), R(200, 85.2, 1, t_end=85.2), R(200, 85.6, 1, t_end=85.6),
               R(429, 0.01, 1, t_end=3.0, error="overloaded"), R(200, 119.9, 1, t_end=119.9)]
    report = _plot_report(results, 120.0)
    fig = plot_figure(report, "preset:qwen3-vl-2b on cpu")
    try:
        got = _plot_properties(fig)
        # One time axis, the whole run, on both panels.
        assert got["xlim_rate"] == got["xlim_lat"] == (0.0, 120.0)
        # The overall rate is images / wall time (the summary's figure), drawn and named in the legend.
        assert list(got["overall"].get_ydata()) == [4 / 120.0] * 2
        assert "overall: 4 images / 120.00 s = 0.0333 img/s" in got["legend"]
        assert any(label.startswith("per 1.2 s bin") for label in got["legend"])  # 120 s / 100 bins
        # The bars are per bin: they tile [0, 120] s, the burst is 2 images in one 1.2 s bin, and their
        # time-weighted mean is the overall rate (the two figures agree by construction).
        bars = got["bars"]
        assert bars[0].get_x() == 0.0 and bars[-1].get_x() + bars[-1].get_width() == pytest.approx(120.0)
        assert max(b.get_height() for b in bars) == pytest.approx(2 / 1.2)
        assert sum(b.get_height() * b.get_width() for b in bars) / 120.0 == pytest.approx(4 / 120.0)
        # The totals are in the title: images, requests, wall time, the overall rate, p50/p99, errors.
        title = got["title"].splitlines()
        assert title[0] == "preset:qwen3-vl-2b on cpu"
        assert title[1] == ("4 images in 5 requests, 120.00 s: 0.0333 img/s overall; p50 85400 ms, p99 118871 ms; "
                            "errors 1 (429 overloaded: 1)")
        # p50 is drawn over p99 and in another style, so where they are equal (one answer in a bin) p50
        # still shows: the bin at 85.2 s holds one answer, 84.9 s.
        p50, p99 = got["p50"], got["p99"]
        assert p50.get_zorder() > p99.get_zorder() and p99.get_markerfacecolor() == "none"
        k = next(i for i, x in enumerate(p50.get_xdata()) if x == pytest.approx(85.2 - 0.6))
        assert p50.get_ydata()[k] == p99.get_ydata()[k] == pytest.approx(84900.0)
    finally:
        plt.close(fig)


def test_plot_of_an_empty_run_still_draws(tmp_path):
    # No answers at all (every request refused): no rate, no latency, a title that says so.
    report = _plot_report([Result(503, 0.1, 1, t_end=0.4, error="not_ready")], 0.5)
    assert write_plot(tmp_path / "p.png", report, "t") == str(tmp_path / "p.png")
    assert plot_totals(report["summary"]) == ("0 images in 1 request, 0.50 s: 0 img/s overall; p50 -, p99 -; "
                                              "errors 1 (503 not_ready: 1)")
    # Interrupted before the clients started: no time series at all.
    assert write_plot(tmp_path / "q.png", _plot_report([], 0.0), "t") == str(tmp_path / "q.png")


def test_without_matplotlib_no_plot_is_written(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    report = {"timeseries": [], "summary": {"status_counts": {}, "retries": 0}}
    assert write_plot(tmp_path / "p.png", report, "t") is None
    assert not (tmp_path / "p.png").exists()


def test_rate_mode_follows_the_poisson_schedule(tmp_path, tiny_model):
    out = tmp_path / "rate.json"
    with _serve(tmp_path, tiny_model) as (url, app):
        rc = cli.main(["--url", url, "--rate", "5", "--requests", "20", "--seed", "3", "--sizes", "64x64",
                       "--gen-workers", "1", "--out", str(out), "--quiet"])
    assert rc == 0
    report = json.loads(out.read_text())
    s = report["summary"]
    assert s["ok_requests"] == 20 and report["settings"]["rate"] == 5
    # The arrival times are seeded (--seed 3, client 0): the 20th request cannot go out before its
    # scheduled time, so the run lasts at least that long. A closed loop would be done in ~0.5 s here.
    rng = random.Random(3 * 1000 + 0)
    last_arrival = sum(rng.expovariate(5) for _ in range(20))
    assert last_arrival > 3.0  # this seed's schedule (3.84 s) is far from a closed loop's
    assert last_arrival <= s["wall_s"] < last_arrival + 10
    lag = report["schedule_lag_ms"]
    assert set(lag) == {"p50", "p99", "max"} and 0 <= lag["p50"] <= lag["p99"] <= lag["max"]


@pytest.mark.slow  # two client processes (spawned, each importing the tool) and a reference tower
def test_processes_split_the_requests_without_overlap(tmp_path, tiny_model):
    out = tmp_path / "p.json"
    with _serve(tmp_path, tiny_model) as (url, app):
        rc = cli.main(["--url", url, "--processes", "2", "--concurrency", "2", "--requests", "8", "--sizes", "64x64",
                       "--replay-every", "2", "--verify", "--store-root", str(tmp_path / "store"), "--out", str(out),
                       "--quiet"])
        stored = _entries(tmp_path / "store")
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["summary"]["ok_images"] == 8 and report["summary"]["cached_images"] == 0
    assert len(stored) == 8  # the two processes sent different images
    assert (report["replay"]["ok"], report["verify"]["ok"], report["verify"]["wrong"]) == (4, 4, 0)


def test_verify_resizes_like_a_server_with_its_own_pixel_bounds(tmp_path):
    # A server whose --max-pixels shrinks every 96x96 image: the reference must take the bounds from
    # /ready, or its grids (and embeddings) differ from the server's and every verification fails.
    settings = Settings(model="tiny", device="cpu", store=tmp_path / "store", decode_workers=1, max_wait_ms=20,
                        min_pixels=1024, max_pixels=2048)
    out = tmp_path / "v.json"
    with live_server(settings, load_model(settings)) as (url, app):
        rc = cli.main(["--url", url, "--concurrency", "2", "--requests", "4", "--sizes", "96x96", "--gen-workers", "1",
                       "--replay-every", "1", "--verify", "--store-root", str(tmp_path / "store"), "--out", str(out),
                       "--quiet"])
    report = json.loads(out.read_text())
    assert report["server"]["max_pixels"] == 2048 and report["server"]["min_pixels"] == 1024
    assert rc == 0 and (report["verify"]["ok"], report["verify"]["wrong"]) == (4, 0), report["verify"]


def test_images_dir_is_sent_and_cycled(tmp_path, tiny_model):
    folder = tmp_path / "mine"
    folder.mkdir()
    for k in range(3):
        Image.fromarray(make_image(48, 40, k, "noise")).save(folder / f"img{k}.png")
    (folder / "readme.txt").write_text("not an image")
    out = tmp_path / "d.json"
    with _serve(tmp_path, tiny_model) as (url, app):
        rc = cli.main(["--url", url, "--images", str(folder), "--requests", "6", "--concurrency", "1", "--out", str(out),
                       "--quiet"])
        stored = _entries(tmp_path / "store")
    assert rc == 0
    s = json.loads(out.read_text())["summary"]
    assert (s["ok_images"], s["cached_images"]) == (6, 3)  # the second pass over the folder: cache hits
    assert len(stored) == 3


def _data_offset(path: Path) -> int:
    return 8 + int.from_bytes(path.read_bytes()[:8], "little")  # safetensors: u64 header length, header, data


def test_replay_and_verify_catch_corrupted_store_files(tmp_path, capsys, tiny_model):
    store = tmp_path / "store"
    argv = ["--requests", "6", "--concurrency", "2", "--sizes", "64x64", "--seed", "11", "--replay-every", "1",
            "--verify", "--store-root", str(store), "--quiet"]
    with _serve(tmp_path, tiny_model) as (url, app):
        assert cli.main(["--url", url, *argv, "--out", str(tmp_path / "clean.json")]) == 0
        clean = json.loads((tmp_path / "clean.json").read_text())
        assert (clean["replay"]["ok"], clean["verify"]["ok"], clean["verify"]["wrong"]) == (6, 6, 0)
        keys = _entries(store)
        assert len(keys) == 6
        files = [store / k / "encoder_cache.safetensors" for k in keys]
        # 0: the data overwritten with 0xFF bytes (NaN as float32): a consumer would read garbage.
        raw = bytearray(files[0].read_bytes())
        raw[_data_offset(files[0]):] = b"\xff" * (len(raw) - _data_offset(files[0]))
        files[0].write_bytes(bytes(raw))
        # 1: garbage over the header: the file no longer parses.
        raw = bytearray(files[1].read_bytes())
        raw[8:40] = b"!" * 32
        files[1].write_bytes(bytes(raw))
        # 2: another image's embeddings (same shape, finite): only the comparison with the reference sees it.
        other = files[3].read_bytes()
        raw = bytearray(files[2].read_bytes())
        raw[_data_offset(files[2]):] = other[_data_offset(files[3]):]
        files[2].write_bytes(bytes(raw))
        capsys.readouterr()
        # The same six images again (same --seed): cache hits, each replayed from the store.
        rc = cli.main(["--url", url, *argv, "--out", str(tmp_path / "bad.json")])
    assert rc == 1
    bad = json.loads((tmp_path / "bad.json").read_text())
    assert bad["summary"]["cached_images"] == 6 and bad["summary"]["ok_images"] == 6
    r, v = bad["replay"], bad["verify"]
    assert (r["ok"], r["missing"], r["wrong"]) == (4, 0, 2)
    assert sorted(p.split(":")[0] for p in r["problems"]) == sorted(keys[:2])
    assert any("values are not finite" in p for p in r["problems"] if p.startswith(keys[0]))
    assert any(p.startswith(keys[1]) for p in r["problems"])
    assert (v["ok"], v["wrong"]) == (3, 1)  # the four whose replay passed; one of them is another image's
    assert len(v["problems"]) == 1 and v["problems"][0].startswith(f"{keys[2]}: relative L2 error")
    printed = capsys.readouterr().out
    assert "replayed    6: 4 ok, 0 missing, 2 wrong" in printed and f"wrong: {keys[0]}" in printed


@pytest.mark.slow  # the tool as its own process groups, under load until interrupted
@pytest.mark.parametrize("processes, to_group", [(1, False), (1, True), (2, True)],
                         ids=["sigint-to-the-tool", "ctrl-c-one-client", "ctrl-c-two-client-processes"])
def test_ctrl_c_prints_the_partial_summary(tmp_path, tiny_model, processes, to_group):
    """SIGINT to the tool (or, as a terminal's Ctrl-C does, to its whole process group, client and image
    processes included): the partial summary and report, exit status 130, no traceback, no process left."""
    out = tmp_path / "int.json"
    store = tmp_path / "store"
    with _serve(tmp_path, tiny_model) as (url, app):
        proc = subprocess.Popen(
            [sys.executable, "-m", "service", "loadtest", "--url", url, "--requests", "100000", "--duration-s", "300",
             "--concurrency", "2", "--processes", str(processes), "--sizes", "64x64", "--gen-workers", "1",
             "--out", str(out)],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=to_group)
        try:
            deadline = time.monotonic() + 90
            while len(_entries(store)) < 10:  # the load is really under way
                assert proc.poll() is None, proc.communicate()
                assert time.monotonic() < deadline, "the load never got going"
                time.sleep(0.1)
            children = descendants(proc.pid)
            assert len(children) >= processes  # image builders (and client processes)
            if to_group:
                os.killpg(proc.pid, signal.SIGINT)
            else:
                proc.send_signal(signal.SIGINT)
            stdout, stderr = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert proc.returncode == 130, (stdout, stderr)
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr
    assert "Traceback" not in stdout
    lines = stdout.splitlines()
    assert lines[0].startswith("interrupted: partial results (") and lines[0].endswith("requests in flight were cancelled)")
    report = json.loads(out.read_text())
    s = report["summary"]
    assert report["interrupted"] is True and report["client_errors"] == []
    assert s["requests"] >= 10 and s["ok_requests"] == s["requests"] and s["status_counts"] == {"200": s["requests"]}
    assert f"requests    {s['requests']} ({s['requests']} ok, 0 rejected with 429)" in stdout
    assert 0 <= report["cancelled_in_flight"] <= 2
    assert s["wall_s"] > 0 and s["images_per_s"] > 0
    # Nothing the tool started outlives it.
    deadline = time.monotonic() + 15
    while any(alive(p) for p in children):
        assert time.monotonic() < deadline, [p for p in children if alive(p)]
        time.sleep(0.1)


def test_help_shows_every_default():
    # Issue 11: a newcomer reads the defaults in --help. Every option that has a default says it.
    parser = cli.build_parser()
    text = " ".join(parser.format_help().split())
    for action in parser._actions:
        if action.option_strings and action.default not in (None, False, argparse.SUPPRESS) and action.dest != "help":
            assert f"(default: {action.default})" in text, action.option_strings
    assert "(default: http://127.0.0.1:8080)" in text


# ---- videos (issue 22): against a stub that answers /encode as the contract says ----------------------
class _VideoEncoder(http.server.BaseHTTPRequestHandler):
    """/ready, and /encode answering each part as the encoder does once it takes video: a video's item has
    modality, grid_thw, num_tokens, frames_indices, fps and timestamps, from this project's own header read
    and sampling (media/video.py) of the clip it was sent; an image's, a fixed 1x8x8 grid. Every body kept."""

    bodies: list = []

    def _answer(self, status: int, doc: dict) -> None:
        body = json.dumps(doc).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):  # noqa: N802
        self._answer(200, {"ready": True, "model": "stub", "device": "cpu", "dtype": "float32"})

    def do_POST(self):  # noqa: N802
        from service.media.params import VideoLimits, VideoParams
        from service.media.video import clip_size, read_header, sample_indices, timestamps

        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).bodies.append(body)
        items = []
        for p in body["images"]:
            if p["type"] == "video_url":
                blob = base64.b64decode(p["video_url"]["url"].partition(",")[2])
                header = read_header(blob, VideoLimits())
                params = VideoParams()
                idx = sample_indices(header.frames, header.fps, params)
                h, w = clip_size(len(idx), header.height, header.width, params)
                grid = [-(-len(idx) // 2), h // 16, w // 16]
                items.append({"key": f"v{len(items)}", "modality": "video", "grid_thw": grid,
                              "num_tokens": grid[0] * grid[1] * grid[2] // 4, "frames_indices": idx, "fps": header.fps,
                              "timestamps": timestamps(idx, header.fps, 2), "cached": False})
            else:
                items.append({"key": f"i{len(items)}", "modality": "image", "grid_thw": [1, 8, 8], "num_tokens": 16,
                              "cached": False})
        self._answer(200, {"items": items})

    def log_message(self, *args):
        pass


@pytest.fixture
def video_stub():
    pytest.importorskip("av", reason="PyAV makes and reads the clips (a base dependency)")
    handler = type("Handler", (_VideoEncoder,), {"bodies": []})
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", handler.bodies
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_generated_videos_are_real_clips_distinct_per_request():
    from service.media.params import VideoLimits
    from service.media.video import read_header

    spec = ImageSpec(((64, 64),), 0, True, "gradient", "png", 7, videos_per_request=2, video_size=(160, 120),
                     video_frames=12, video_fps=6)
    urls = request_urls(spec, 0) + request_urls(spec, 1)
    assert len(urls) == 4 and len(set(urls)) == 4 and all(is_video_url(u) for u in urls)
    header = read_header(base64.b64decode(urls[0].partition(",")[2]), VideoLimits())
    assert (header.codec, header.width, header.height, header.fps, header.frames) == ("h264", 160, 120, 6.0, 12)
    repeat = ImageSpec(((64, 64),), 1, False, "gradient", "png", 7, videos_per_request=1)
    assert request_urls(repeat, 0)[1] == request_urls(repeat, 5)[1]  # --repeat: one clip, cache hits
    payload = build_payload(request_urls(repeat, 0))
    assert [p["type"] for p in payload["images"]] == ["image_url", "video_url"]
    assert payload["images"][1]["video_url"]["url"].startswith("data:video/mp4;base64,")


def test_a_video_run_reports_videos_frames_and_tokens_per_second(tmp_path, capsys, video_stub):
    url, bodies = video_stub
    out = tmp_path / "v.json"
    rc = cli.main(["--url", url, "--generated-videos", "2", "--images-per-request", "0", "--video-size", "160x120", "--video-frames", "24",
                   "--video-fps", "8", "--requests", "5", "--concurrency", "2", "--gen-workers", "1", "--quiet",
                   "--out", str(out)])
    assert rc == 0
    assert len(bodies) == 5 and all([p["type"] for p in b["images"]] == ["video_url"] * 2 for b in bodies)  # no images
    s = json.loads(out.read_text())["summary"]
    # 24 frames at 8 fps: 6 sampled frames, grid 3 x 8 x 12 (clip_size raises 120x160 to 128x192): 72 tokens each
    assert (s["ok_requests"], s["ok_images"], s["ok_videos"], s["ok_frames"], s["ok_tokens"]) == (5, 0, 10, 60, 720)
    assert s["frames_per_s"] == pytest.approx(60 / s["wall_s"]) and s["tokens_per_s"] == pytest.approx(720 / s["wall_s"])
    assert s["videos_per_s"] == pytest.approx(10 / s["wall_s"])
    printed = capsys.readouterr().out
    assert "videos ok   10 (60 frames sampled)" in printed and "frames/s" in printed and "tokens/s" in printed


def test_videos_dir_with_images_mixed_and_bad_video_arguments(tmp_path, capsys, video_stub, monkeypatch):
    url, bodies = video_stub
    folder = tmp_path / "clips"
    folder.mkdir()
    for k in range(2):
        (folder / f"c{k}.mp4").write_bytes(make_video(96, 64, 10, 5, k))
    (folder / "notes.txt").write_text("not a video")
    out = tmp_path / "d.json"
    rc = cli.main(["--url", url, "--videos", str(folder), "--sizes", "64x64",
                   "--requests", "4", "--concurrency", "1", "--gen-workers", "1", "--quiet", "--out", str(out)])
    assert rc == 0
    sent = [[p.get("video_url", p.get("image_url"))["url"] for p in b["images"]] for b in bodies]
    assert all(b[0].startswith("data:image/png") and b[1].startswith("data:video/mp4") for b in sent)
    assert len({b[1] for b in sent}) == 2  # the folder's two files, cycled
    s = json.loads(out.read_text())["summary"]
    assert (s["ok_images"], s["ok_videos"]) == (4, 4) and s["ok_frames"] == 4 * 4  # 10 frames at 5 fps: min_frames 4
    capsys.readouterr()
    calls = _no_traffic(monkeypatch)
    for argv, message in [(["--videos", str(tmp_path)], "not a directory with video files"),
                          (["--generated-videos", "1", "--video-size", "161x120"], "even"),
                          (["--generated-videos", "1", "--videos", str(folder)], "not allowed with"),
                          (["--images-per-request", "0"], "(0 with videos)")]:
        with pytest.raises(SystemExit) as exc:
            cli.main(["--url", "http://127.0.0.1:9"] + argv)
        assert exc.value.code == 2 and message in capsys.readouterr().err, argv
    assert calls == []


def test_the_live_line_shows_frames_and_tokens_per_second_in_a_video_run():
    import types

    run = Run(start=0.0)
    run.add([Result(200, 0.1, 0, t_end=t, videos=2, frames=12, tokens=144) for t in (5.5, 7.0, 9.0)])
    line = Progress.stats_line(types.SimpleNamespace(args=types.SimpleNamespace(replay_every=0)), run, None, 10.0)
    assert "0.0 img/s (last 5 s)  7.2 frames/s  86 tokens/s  p50 100 ms" in line, line  # 36 frames, 432 tokens in 5 s
    images_only = Run(start=0.0)
    images_only.add([Result(200, 0.1, 2, t_end=9.0, tokens=32)])
    assert "frames/s" not in Progress.stats_line(types.SimpleNamespace(args=types.SimpleNamespace(replay_every=0)),
                                                 images_only, None, 10.0)


def test_the_chat_api_posts_what_vllms_proxy_posts_and_stores_every_image(tmp_path, tiny_model):
    """--api chat: the encoder's /v1/chat/completions as vLLM's EPD proxy calls it (the media as parts of a
    user message, max_tokens 1); the summary counts the images and their tokens from the answers' usage."""
    out = tmp_path / "chat.json"
    with _serve(tmp_path, tiny_model) as (url, app):
        rc = cli.main(["--url", url, "--api", "chat", "--images-per-request", "2", "--sizes", "64x48,40x40",
                       "--requests", "3", "--concurrency", "1", "--out", str(out), "--quiet"])
        stored = _entries(tmp_path / "store")
    assert rc == 0
    s = json.loads(out.read_text())["summary"]
    assert (s["ok_requests"], s["ok_images"]) == (3, 6), s
    assert len(stored) == 6  # each distinct image in the store, under its key
    from service.store.format import read_embeddings

    rows = sum(read_embeddings(tmp_path / "store", k).main.shape[0] for k in stored)
    assert s["ok_tokens"] == rows  # the answers' prompt tokens are the stored images' rows
    from service.loadtest.media import build_chat

    body = build_chat(["data:image/png;base64,AAAA"])
    assert body["max_tokens"] == 1 and body["stream"] is False
    assert [p["type"] for p in body["messages"][0]["content"]] == ["image_url", "text"]


def test_the_chat_api_cannot_replay(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["loadtest"])
    with pytest.raises(SystemExit):
        cli.main(["--api", "chat", "--replay-every", "2"])
    assert "a chat answer names none" in capsys.readouterr().err
