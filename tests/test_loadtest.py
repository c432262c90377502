"""bench/loadtest.py: its pure helpers, the payloads it builds, the loopback guard, and one real run
against the service (tiny model, in process)."""

from __future__ import annotations

import base64
import io
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from service.config import Settings
from service.loader import load_model
from tests.live import live_server

BENCH = Path(__file__).resolve().parent.parent / "bench"


@pytest.fixture
def lt(monkeypatch):
    """bench/loadtest.py imported as the module `loadtest`, as `python bench/loadtest.py` would see it.

    bench/ stays on sys.path for the test, so the spawn-started image workers (which inherit the
    parent's sys.path) can unpickle `loadtest.request_urls` and `loadtest.ImageSpec` too."""
    monkeypatch.syspath_prepend(str(BENCH))
    monkeypatch.delitem(sys.modules, "loadtest", raising=False)
    import loadtest

    assert Path(loadtest.__file__).resolve() == BENCH / "loadtest.py"
    yield loadtest
    sys.modules.pop("loadtest", None)


def _decode_data_url(url: str) -> tuple[str, Image.Image]:
    head, sep, b64 = url.partition(",")
    assert sep and head.startswith("data:") and head.endswith(";base64"), head
    mime = head[len("data:") : -len(";base64")]
    img = Image.open(io.BytesIO(base64.b64decode(b64, validate=True)))
    img.load()
    return mime, img


# ---- pure helpers ----------------------------------------------------------------------------------
def test_parse_sizes(lt):
    assert lt.parse_sizes("448x448") == [(448, 448)]
    assert lt.parse_sizes("1024x768, 64X32 ,1x1") == [(1024, 768), (64, 32), (1, 1)]


@pytest.mark.parametrize("bad", ["", "448", "448x", "x448", "0x10", "10x0", "-1x5", "4.5x4", "axb", "448x448,", "3x4x5"])
def test_parse_sizes_rejects_bad_input(lt, bad):
    with pytest.raises(ValueError, match="WIDTHxHEIGHT"):
        lt.parse_sizes(bad)


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
def test_is_loopback_url(lt, url, loopback):
    assert lt.is_loopback_url(url) is loopback


def test_percentile_matches_numpy(lt):
    rng = np.random.default_rng(3)
    for n in (1, 2, 5, 100, 101):
        values = rng.exponential(10.0, size=n).tolist()
        shuffled = list(values)
        for q in (0, 1, 25, 50, 90, 99, 99.9, 100):
            assert lt.percentile(shuffled, q) == pytest.approx(float(np.percentile(values, q)), rel=1e-12, abs=1e-12)
        assert shuffled == values  # does not sort the caller's list in place
    assert lt.percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert math.isnan(lt.percentile([], 50))


def test_summarize_and_format_table(lt):
    R = lt.Result
    results = [
        R(200, 0.010, 2, cached=1),
        R(200, 0.030, 2),
        R(200, 0.020, 2, cached=2),
        R(429, 0.001, 2),
        R(429, 0.002, 2),
        R(500, 0.5, 2),
        R("error:ConnectError", 0.003, 0),
    ]
    s = lt.summarize(results, wall_s=2.0)
    assert (s.requests, s.ok_requests, s.ok_images, s.cached_images, s.rejected_429) == (7, 3, 6, 3, 2)
    assert s.images_per_s == pytest.approx(3.0) and s.requests_per_s == pytest.approx(1.5)
    lat = s.latency_ms  # of the 200 answers only: 10, 20, 30 ms
    assert lat["p50"] == pytest.approx(20.0) and lat["mean"] == pytest.approx(20.0) and lat["max"] == pytest.approx(30.0)
    assert lat["p90"] == pytest.approx(float(np.percentile([10, 20, 30], 90)))
    assert lat["p99"] == pytest.approx(float(np.percentile([10, 20, 30], 99)))
    assert s.status_counts == {"200": 3, "429": 2, "500": 1, "error:ConnectError": 1}

    table = lt.format_table(s)
    lines = table.splitlines()
    assert len(lines) == 6
    assert lines[0].split() == ["wall", "time", "2.00", "s"]
    assert "7 (3 ok, 2 rejected with 429)" in lines[1]
    assert "6 (3 cached)" in lines[2]
    assert "3.00 images/s, 1.50 requests/s" in lines[3]
    assert "p50 20.0  p90 28.0  p99 29.8  max 30.0" in lines[4]
    assert lines[5].endswith("200: 3, 429: 2, 500: 1, error:ConnectError: 1")
    # Values line up in one column.
    assert len({len(line) - len(line[len("throughput"):].lstrip()) for line in lines}) == 1


def test_summarize_with_no_successes(lt):
    s = lt.summarize([lt.Result(503, 0.1, 1)], wall_s=1.0)
    assert s.ok_requests == 0 and s.ok_images == 0 and s.images_per_s == 0.0
    assert all(math.isnan(v) for v in s.latency_ms.values())
    assert "nan" in lt.format_table(s)  # printable, no exception
    assert math.isnan(lt.summarize([], wall_s=0.0).images_per_s)


# ---- payloads ----------------------------------------------------------------------------------------
def _spec(lt, argv):
    args = lt.build_parser().parse_args(argv)
    return lt.ImageSpec(tuple(lt.parse_sizes(args.sizes)), args.images_per_request, args.unique, args.pattern,
                        args.format, 1234 if args.seed is None else args.seed)


@pytest.mark.parametrize("pattern", ["gradient", "noise"])
def test_build_payload_data_urls_decode_to_the_generated_images(lt, pattern):
    spec = _spec(lt, ["--sizes", "48x32,20x70", "--images-per-request", "3", "--pattern", pattern, "--seed", "7"])
    payload = lt.build_payload(lt.request_urls(spec, 1))
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
        expected = lt.make_image(w, h, seed=1 * 3 + j, pattern=pattern, run_seed=7)
        assert expected.shape == (h, w, 3) and expected.dtype == np.uint8
        np.testing.assert_array_equal(np.asarray(img), expected)  # PNG is lossless


def test_jpeg_format(lt):
    spec = _spec(lt, ["--sizes", "40x24", "--format", "jpeg", "--seed", "1"])
    (url,) = lt.request_urls(spec, 0)
    mime, img = _decode_data_url(url)
    assert mime == "image/jpeg" and img.format == "JPEG" and img.size == (40, 24)
    expected = lt.make_image(40, 24, 0, "gradient", 1).astype(np.int16)
    assert np.abs(np.asarray(img).astype(np.int16) - expected).mean() < 4  # lossy, but the same picture


def test_unique_images_are_distinct_and_repeat_images_identical(lt):
    unique = _spec(lt, ["--sizes", "32x32", "--images-per-request", "2", "--unique", "--seed", "5"])
    assert unique.unique is True
    urls = [u for i in range(4) for u in lt.request_urls(unique, i)]
    assert len(urls) == 8 and len(set(urls)) == 8
    pixels = [np.asarray(_decode_data_url(u)[1]) for u in urls]
    assert all(not np.array_equal(pixels[0], p) for p in pixels[1:])

    repeat = _spec(lt, ["--sizes", "32x32", "--images-per-request", "2", "--repeat", "--seed", "5"])
    assert repeat.unique is False
    urls = [u for i in range(4) for u in lt.request_urls(repeat, i)]
    assert len(set(urls)) == 1

    # --repeat with two sizes: one image per size, identical wherever that size comes round again.
    two = _spec(lt, ["--sizes", "32x32,24x16", "--repeat", "--seed", "5"])
    per_request = [lt.request_urls(two, i)[0] for i in range(4)]
    assert per_request[0] == per_request[2] and per_request[1] == per_request[3] and per_request[0] != per_request[1]
    assert _decode_data_url(per_request[1])[1].size == (24, 16)

    # The run seed changes every --unique image (no cache hits carried over from an earlier run).
    other_run = _spec(lt, ["--sizes", "32x32", "--seed", "6"])
    assert lt.request_urls(other_run, 0) != lt.request_urls(_spec(lt, ["--sizes", "32x32", "--seed", "5"]), 0)


def test_image_seed(lt):
    seeds = [lt.image_seed(i, j, 3, 2, unique=True) for i in range(4) for j in range(3)]
    assert seeds == list(range(12))
    assert [lt.image_seed(i, j, 3, 2, unique=False) for i in range(2) for j in range(3)] == [0, 1, 0, 1, 0, 1]


def test_bad_pattern_and_format(lt):
    with pytest.raises(ValueError, match="unknown pattern"):
        lt.make_image(8, 8, 0, "plaid")
    with pytest.raises(ValueError, match="unknown format"):
        lt.encode_image(np.zeros((4, 4, 3), np.uint8), "gif")


# ---- the command line ----------------------------------------------------------------------------------
def _no_traffic(monkeypatch, lt):
    """Make any attempt to run the load fail the test (and record it)."""
    calls = []

    async def forbidden_run(args):
        calls.append(args)
        raise AssertionError("the load run started")

    class ForbiddenClient:
        def __init__(self, *a, **kw):
            raise AssertionError("an HTTP client was created")

    monkeypatch.setattr(lt, "run", forbidden_run)
    monkeypatch.setattr(lt.httpx, "AsyncClient", ForbiddenClient)
    return calls


@pytest.mark.parametrize("url", ["http://10.0.0.1:8080", "http://example.com", "http://192.168.0.5:80"])
def test_remote_url_refused_without_allow_remote(lt, monkeypatch, capsys, tmp_path, url):
    calls = _no_traffic(monkeypatch, lt)
    out = tmp_path / "r.json"
    with pytest.raises(SystemExit) as exc:
        lt.main(["--url", url, "--requests", "1", "--out", str(out)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"{url} is not a loopback address" in err and "--allow-remote" in err
    assert calls == [] and not out.exists()


def test_allow_remote_lets_the_run_start(lt, monkeypatch, capsys):
    """The guard is what refused above: with --allow-remote the same URL reaches run() (stubbed here)."""
    seen = []

    async def fake_run(args):
        seen.append(args.url)
        return [], 1.0

    monkeypatch.setattr(lt, "run", fake_run)
    assert lt.main(["--url", "http://10.0.0.1:8080", "--allow-remote", "--requests", "1"]) == 1  # 0 ok requests
    assert seen == ["http://10.0.0.1:8080"]
    assert "0 ok" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--sizes", "64"], "bad size"),
        (["--concurrency", "0"], "must be positive"),
        (["--requests", "0"], "must be positive"),
        (["--duration-s", "0"], "must be positive"),
        (["--unique", "--repeat"], "not allowed with"),
    ],
)
def test_bad_arguments_refused(lt, monkeypatch, capsys, argv, message):
    calls = _no_traffic(monkeypatch, lt)
    with pytest.raises(SystemExit) as exc:
        lt.main(["--url", "http://127.0.0.1:9"] + argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err and calls == []


# ---- a real run against the service ------------------------------------------------------------------
def test_real_run_against_the_service(lt, tmp_path, capsys):
    settings = Settings(model="tiny", device="cpu", store=tmp_path / "store", max_pixels=256 * 256,
                        decode_workers=1, max_wait_ms=20)
    model = load_model(Settings(model="tiny", device="cpu"))
    out = tmp_path / "results.json"
    with live_server(settings, model) as (url, app):
        rc = lt.main(["--url", url, "--requests", "12", "--concurrency", "4", "--sizes", "64x64",
                      "--gen-workers", "1", "--timeout-s", "60", "--out", str(out)])
        stored = sorted(p.parent.name for p in (tmp_path / "store").glob("*/encoder_cache.safetensors"))
    assert rc == 0
    printed = capsys.readouterr().out
    assert "12 (12 ok, 0 rejected with 429)" in printed

    report = json.loads(out.read_text())  # strict JSON (no NaN)
    s = report["summary"]
    assert s["requests"] == 12 and s["ok_requests"] == 12 and s["ok_images"] == 12
    assert s["status_counts"] == {"200": 12} and s["rejected_429"] == 0
    assert s["cached_images"] == 0  # --unique (default): every image a fresh encode
    assert s["wall_s"] > 0 and s["images_per_s"] > 0 and s["requests_per_s"] > 0
    assert s["images_per_s"] == pytest.approx(12 / s["wall_s"])
    lat = s["latency_ms"]
    assert set(lat) == {"p50", "p90", "p99", "mean", "max"}
    assert all(isinstance(v, float) and v > 0 for v in lat.values())
    assert lat["p50"] <= lat["p90"] <= lat["p99"] <= lat["max"]
    assert lat["max"] <= s["wall_s"] * 1000

    settings_out = report["settings"]
    assert settings_out["url"] == url and settings_out["requests"] == 12 and settings_out["concurrency"] == 4
    assert settings_out["unique"] is True and isinstance(settings_out["seed"], int)  # recorded fresh seed
    assert len(stored) == 12  # twelve distinct images reached the store
