"""Fuzzing the HTTP API against a real server (in process, tiny model, loopback port).

Two sources of cases:
- schemathesis: cases generated from the OpenAPI document the service serves, schema-valid
  (positive) and schema-violating (negative), for every operation; its response checks compare the
  answers with the document (status codes, content types, the ErrorResponse schema).
- hypothesis strategies over /encode's shapes that a schema alone does not reach: valid and broken
  data URLs, base64 garbage, truncated / mutated / header-forged real images of every format, wrong
  JSON types, huge and negative numbers, unknown fields, hostile uuids, image URLs (loopback only:
  the allow-list names 127.0.0.1 and nothing else), raw bodies, multipart bodies with wrong fields,
  content types and boundaries, and other methods and paths.

Every answer: never a 5xx; every 4xx in the service's JSON error shape; 200s in the documented shape.
Afterwards the service still encodes a valid image and no /encode request answered 5xx.
Deterministic: hypothesis is derandomized (the cases depend only on the code), no example database.
"""

from __future__ import annotations

import base64
import json
import itertools
from collections import Counter
from urllib.parse import quote, urlsplit

import httpx
import requests
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from service.api.app import EncodeResponse, ErrorResponse
from service.config import Settings
from service.engine.loader import load_model
from service.store.keys import KEY_RE
from tests.support import imagedata as data
from tests.support.live import file_server, json_body, live_server

MAX_IMAGES = 8
MAX_IMAGE_BYTES = 200_000
MAX_REQUEST_BYTES = 1_000_000


def _fuzz_settings(n: int):
    return settings(max_examples=n, derandomize=True, database=None, deadline=None, print_blob=False,
                    suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def images():
    """Small valid images of every supported format and several modes: what mutations start from."""
    rgb = data.textured_rgb(40, 32, seed=77)
    return [data.encode(rgb, "PNG"), data.encode(rgb, "JPEG", quality=80), data.encode(rgb, "WEBP"),
            data.encode(rgb, "WEBP", lossless=True), data.encode(rgb, "BMP"), data.encode(rgb, "TIFF"),
            data.gif_bytes(), data.gif_bytes(animated=True), data.rgba_png(), data.gray_png(), data.la_png(),
            data.cmyk_jpeg(), data.exif_rotated("JPEG", 6), data.palette_transparent_png(), data.tiny_png(3, 2)]


@pytest.fixture(scope="module")
def fetch_server(images):
    """What allow-listed image URLs point at: a loopback HTTP server with a few kinds of answers."""
    bodies = {"/ok.png": images[0], "/ok.jpg": images[1], "/big": b"\0" * (MAX_IMAGE_BYTES + 1),
              "/text": b"not an image, and secret", "/empty": b""}
    with file_server(bodies, redirects={"/redirect": "/ok.png"}) as port:
        yield port


@pytest.fixture(scope="module")
def server(tmp_path_factory, fetch_server):
    s = Settings(model="tiny", device="cpu", store=tmp_path_factory.mktemp("fuzz") / "store", min_pixels=64 * 64, max_pixels=128 * 128,
                 decode_workers=1, max_wait_ms=1, max_images_per_request=MAX_IMAGES, max_image_bytes=MAX_IMAGE_BYTES,
                 max_request_bytes=MAX_REQUEST_BYTES, max_input_pixels=4_000_000, store_min_residency_s=0,
                 store_capacity_bytes=64 * 1024**2, url_timeout_s=5,
                 # the only host image URLs may name, and it is this machine (the fetch server above)
                 allowed_url_hosts="127.0.0.1", allow_private_url_addresses=True)
    with live_server(s, load_model(s)) as (url, app):
        yield url, app


def check(r, seen: Counter, images: int | None = None) -> None:
    """The properties every answer has, whatever was asked. `r`: an httpx response or schemathesis' own."""
    if isinstance(r, httpx.Response):
        method, path, headers = r.request.method, r.request.url.path, r.headers
    else:  # schemathesis: a requests.PreparedRequest, headers with lowercase keys and list values
        method, path = r.request.method, urlsplit(r.request.url).path
        headers = {k: v[0] for k, v in r.headers.items()}
    status, text = r.status_code, r.content.decode(errors="replace")
    seen[status] += 1
    what = f"{method} {path} -> {status}: {text[:400]!r}"
    # (504: a fuzzed deadline_ms the request could not meet, its work dropped: an answer, not a failure)
    assert status < 500 or (status == 504 and '"deadline_exceeded"' in text), what
    if method == "HEAD":
        return
    if status >= 400:
        code = ErrorResponse.model_validate_json(text).error.code  # {"error": {"code", "message", "index"?}}
        seen[code] += 1
        assert headers["content-type"].startswith("application/json"), what
        if status in (429, 503):
            assert int(headers["retry-after"]) >= 1, what
    elif status == 200 and path == "/encode":
        items = EncodeResponse.model_validate_json(text).items
        assert images is None or len(items) == images, what


def _summary(seen: Counter) -> str:
    """Answers by status, then by error code."""
    return ", ".join(f"{k}: {v}" for k, v in sorted(seen.items(), key=lambda kv: (isinstance(kv[0], str), str(kv[0]))))


_FRESH = itertools.count(1000)  # seeds of images no fuzz case sent


def check_still_serving(url: str, images: list[bytes]) -> None:
    fresh = data.encode(data.textured_rgb(48, 48, seed=next(_FRESH)), "PNG")
    r = httpx.post(url + "/encode", json=json_body(fresh), timeout=60)
    assert r.status_code == 200 and r.json()["items"][0]["cached"] is False, r.text
    assert httpx.get(url + "/health", timeout=10).status_code == 200
    m = httpx.get(url + "/metrics", timeout=10).text
    fives = [line for line in m.splitlines() if line.startswith('qve_requests_total{status="5')]
    assert not fives, fives


# ---- the schema-driven run ------------------------------------------------------------------------------
def test_schemathesis_cases_from_the_served_openapi_document(server, images):
    import schemathesis
    from schemathesis import GenerationMode
    from schemathesis.specs.openapi.checks import (
        content_type_conformance,
        response_schema_conformance,
        status_code_conformance,
    )

    url, _ = server
    schema = schemathesis.openapi.from_url(url + "/openapi.json")
    session = requests.Session()  # schemathesis sends with requests
    seen: Counter = Counter()
    ran = 0
    for result in schema.get_all_operations():
        op = result.ok()
        # GET operations take nothing, so nothing of theirs can violate the schema: positive cases only.
        modes = (GenerationMode.POSITIVE, GenerationMode.NEGATIVE) if op.path == "/encode" else (GenerationMode.POSITIVE,)
        for mode in modes:
            @_fuzz_settings(300 if op.path == "/encode" else 10)
            @given(case=op.as_strategy(generation_mode=mode))
            def run(case):
                nonlocal ran
                ran += 1
                r = case.call(base_url=url, session=session)
                check(r, seen)
                case.validate_response(r, checks=[status_code_conformance, content_type_conformance,
                                                  response_schema_conformance])

            run()
    session.close()
    print(f"schemathesis: {ran} cases, answers by status {_summary(seen)}")
    assert ran >= 600 and seen[200] and seen[400] and seen[422]
    check_still_serving(url, images)


# ---- hand-written strategies over /encode's shapes --------------------------------------------------------
def _mutations(images: list[bytes]):
    def overwrite(b: bytes, edits) -> bytes:
        out = bytearray(b)
        for pos, value in edits:
            out[pos % len(out)] = value
        return bytes(out)

    def mutate(b: bytes):
        return st.one_of(
            st.integers(0, len(b)).map(lambda n: b[:n]),  # truncated anywhere
            st.lists(st.tuples(st.integers(0, len(b)), st.integers(0, 255)), min_size=1, max_size=6)
            .map(lambda edits: overwrite(b, edits)),  # bytes overwritten (headers, tables, data)
            st.tuples(st.integers(0, len(b)), st.binary(min_size=1, max_size=32))
            .map(lambda t: b[:t[0]] + t[1] + b[t[0]:]),  # bytes inserted
            st.tuples(st.integers(0, len(b)), st.integers(1, 64)).map(lambda t: b[:t[0]] + b[t[0] + t[1]:]),  # cut out
        )

    return st.sampled_from(images).flatmap(mutate)


def _image_bytes(images: list[bytes]):
    dims = st.integers(0, 2**32 - 1) | st.integers(0, 5000)
    return st.one_of(
        st.sampled_from(images),
        _mutations(images),
        _mutations(images),
        st.builds(data.png_header_only, dims, dims),  # any declared size, 0 and 2^32-1 included
        st.builds(data.webp_declaring, st.integers(1, 16384), st.integers(1, 16384)),
        st.binary(max_size=200),
        st.tuples(st.sampled_from([b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff", b"GIF89a", b"RIFF\0\0\0\0WEBP", b"II*\0",
                                   b"BM\0\0\0\0\0\0\0\0"]), st.binary(max_size=100)).map(b"".join),
        st.sampled_from([b"", b"\0" * (MAX_IMAGE_BYTES + 1)]),
    )


_TEXT = st.text(st.characters(exclude_categories=("Cs",)), max_size=40)
_JSON = st.recursive(st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | _TEXT,
                     lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_TEXT, inner, max_size=4),
                     max_leaves=12)


def _uuid(json_types: bool = True):
    """Valid keys (a few, so they repeat: conflicts), hostile strings and, with `json_types`, non-strings."""
    return st.one_of(
        st.from_regex(KEY_RE, fullmatch=True),
        st.sampled_from(["a", "fuzz-key", ".", "..", "../x", "/etc/passwd", "x" * 129, "sha256+" + "0" * 64,
                         "sha256+" + "f" * 64, "key\n", "a b", "x" * 10_000]),
        _TEXT,
        *([_JSON] if json_types else []),
    )


def _url(images: list[bytes], port: int):
    b64 = base64.b64encode
    heads = st.sampled_from(["data:image/png;base64,", "data:image/jpeg;base64,", "data:;base64,",
                             "data:application/octet-stream;base64,", "data:image/png,", "data:image/png;base64",
                             "DATA:image/png;base64,", "data:image/png;charset=utf-8;base64,", "data:base64,"])
    host = st.sampled_from(["127.0.0.1", "localhost", "example.invalid", "[::1]", "[::1", "[zzz]", "127.0.0.1:99999",
                            "127.0.0.1:0", "", "user@127.0.0.1", "127.0.0.1\t"])
    path = st.sampled_from(["/ok.png", "/ok.jpg", "/big", "/text", "/empty", "/redirect", "/missing"]) | \
        _TEXT.map(lambda t: "/" + t)
    return st.one_of(
        st.tuples(heads, _image_bytes(images).map(lambda b: b64(b).decode())).map("".join),
        st.tuples(heads, st.text("ABCDEFabcdef0123456789+/=-_ \n\t@é\0", max_size=120)).map("".join),  # base64 garbage
        st.tuples(heads, _image_bytes(images).map(lambda b: b64(b).decode())).map(lambda t: "".join(t)[:-3]),
        st.tuples(st.sampled_from(["http", "https", "HTTP", "ftp", "file", "gopher"]), host, path)
        .map(lambda t: f"{t[0]}://{t[1]}{t[2]}"),
        path.map(lambda p: f"http://127.0.0.1:{port}{p}"),  # the fetch server's answers
        _TEXT,
    )


def _encode_json(images: list[bytes], port: int):
    """A JSON body (as a Python value) shaped like an /encode request, or not."""
    # Mostly well-formed parts: one malformed part fails the whole request before any image is looked at.
    part = st.fixed_dictionaries({"type": st.just("image_url"), "image_url": st.fixed_dictionaries({"url": _url(images, port)})},
                                 optional={"uuid": _uuid(json_types=False)})
    odd_part = st.fixed_dictionaries(
        {"image_url": st.fixed_dictionaries({"url": _url(images, port)}, optional={"detail": _JSON}) | _JSON},
        optional={"type": st.just("image_url") | _JSON, "uuid": _uuid(), "extra": _JSON},
    )
    return st.one_of(
        st.fixed_dictionaries({"images": st.lists(part, min_size=1, max_size=2)}),
        st.fixed_dictionaries({"images": st.lists(part, min_size=1, max_size=4)}),
        st.fixed_dictionaries({"images": st.lists(part, max_size=MAX_IMAGES + 2)}, optional={"model": _JSON}),
        st.fixed_dictionaries({"images": st.lists(part | odd_part | _JSON, max_size=3) | _JSON}),
        _JSON,
    )


@pytest.mark.timeout(300)
def test_hypothesis_json_bodies(server, images, fetch_server):
    url, _ = server
    client = httpx.Client(base_url=url, timeout=30)
    seen: Counter = Counter()
    ctypes = st.sampled_from(["application/json"] * 12 + ["application/json; charset=latin-1", "", "text/plain",
                                                           "application/JSON", "multipart/form-data"])

    @_fuzz_settings(1200)
    @given(body=_encode_json(images, fetch_server), ctype=ctypes, raw=st.sampled_from([None] * 12 + ["cut", "nan"]))
    def run(body, ctype, raw):
        content = json.dumps(body, allow_nan=True).encode()
        if raw == "cut":
            content = content[: len(content) // 2]
        headers = {"content-type": ctype} if ctype else {}
        r = client.post("/encode", content=content, headers=headers)
        well_formed = isinstance(body, dict) and isinstance(body.get("images"), list) and raw is None
        check(r, seen, images=len(body["images"]) if well_formed and r.status_code == 200 else None)

    run()
    client.close()
    print(f"json bodies: answers by status {_summary(seen)}")
    assert sum(seen.values()) >= 1200 and seen[200] and seen[400] and seen[413] and seen[422]
    check_still_serving(url, images)


def _multipart(parts: list[tuple[str, str | None, str | None, bytes]], boundary: bytes, close: bool) -> bytes:
    out = []
    for name, filename, ctype, payload in parts:
        disposition = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename is not None else "")
        out.append(b"--" + boundary + b"\r\nContent-Disposition: " + disposition.encode() + b"\r\n")
        if ctype is not None:
            out.append(b"Content-Type: " + ctype.encode() + b"\r\n")
        out.append(b"\r\n" + payload + b"\r\n")
    if close:
        out.append(b"--" + boundary + b"--\r\n")
    return b"".join(out)


@pytest.mark.timeout(300)
def test_hypothesis_multipart_bodies(server, images):
    url, _ = server
    client = httpx.Client(base_url=url, timeout=30)
    seen: Counter = Counter()
    name = st.sampled_from(["image"] * 12 + ["uuid"] * 3 + ["file", "images", ""]) | _TEXT
    filename = st.sampled_from(["a.png", "x.jpg", "", "../../etc/passwd", None]) | _TEXT
    ctype = st.sampled_from(["image/png", "application/octet-stream", "text/plain", None]) | _TEXT
    payload = _image_bytes(images) | _uuid().map(lambda u: str(u).encode())
    part = st.tuples(name, filename, ctype, payload)
    boundary = st.sampled_from([b"fuzzboundary", b"x", b"----WebKitFormBoundary7MA4YWxkTrZu0gW"])

    @_fuzz_settings(800)
    @given(parts=st.lists(part, max_size=MAX_IMAGES + 2), boundary=boundary, close=st.booleans(),
           header=st.sampled_from(["same"] * 12 + ["other", "none", "quoted"]))
    def run(parts, boundary, close, header):
        body = _multipart(parts, boundary, close)
        b = {"same": boundary, "other": b"different", "none": None, "quoted": b'"' + boundary + b'"'}[header]
        ctype = "multipart/form-data" + (f"; boundary={b.decode()}" if b is not None else "")
        check(client.post("/encode", content=body, headers={"content-type": ctype}), seen)

    run()
    client.close()
    print(f"multipart bodies: answers by status {_summary(seen)}")
    assert sum(seen.values()) >= 800 and seen[200] and seen[400] and seen[422]
    check_still_serving(url, images)


@pytest.mark.timeout(120)
def test_hypothesis_methods_paths_and_raw_bodies(server, images):
    url, _ = server
    client = httpx.Client(base_url=url, timeout=30)
    seen: Counter = Counter()
    path = st.sampled_from(["/encode", "/health", "/ready", "/metrics", "/docs", "/openapi.json", "/docs-assets/x.js",
                            "/docs-assets/../service/api/app.py", "/docs-assets/swagger-ui.css", "/", "/encode/"]) | \
        _TEXT.map(lambda t: "/" + quote(t))
    method = st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"])
    body = st.sampled_from([b"", b"[" * 100_000, b'{"images": ' * 50_000, b"\xff\xfe{}"]) | st.binary(max_size=300)

    @_fuzz_settings(400)
    @given(method=method, path=path, body=body)
    def run(method, path, body):
        check(client.request(method, path, content=body if method not in ("GET", "HEAD") else None), seen)

    run()
    client.close()
    print(f"methods, paths, raw bodies: answers by status {_summary(seen)}")
    assert sum(seen.values()) >= 400 and seen[404] and seen[405]
    check_still_serving(url, images)
