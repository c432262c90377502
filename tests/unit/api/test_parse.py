"""Request parsing (service/api/parse.py): what a client is told about base64 that does not decode, and
http(s) URLs fetched within their bounds (bytes, time, the client's presence)."""

import base64
import time

import httpx
import pytest

from service.api.parse import _decode_data_url
from service.config import Settings
from service.errors import RequestError
from tests.support.errors import raises_code
from tests.support.live import SlowServer, live_server, metric
from tests.support.processes import wait_for

DATA = bytes(range(256)) * 2 + b"xy"  # any bytes (not a multiple of 3: the text ends in padding)
GOOD = base64.b64encode(DATA).decode()


def _message(payload: str, video: bool = False) -> str:
    with raises_code(RequestError, "bad_request") as e:
        _decode_data_url(f"data:image/jpeg;base64,{payload}", 3, 1 << 20, video=video)
    return e.value.message


def test_good_base64_decodes():
    assert _decode_data_url(f"data:image/jpeg;base64,{GOOD}", 0, 1 << 20) == DATA


@pytest.mark.parametrize("payload, says", [
    # Issue 23's finding: a missing '=' padding read "Non-base64 digit found".
    (GOOD.rstrip("="), "is not a multiple of 4: is its '=' padding missing? (standard base64 with padding)"),
    (GOOD[:40] + "-" + GOOD[41:], "character '-' at position 40 (URL-safe base64: use + and /)"),
    (GOOD[:40] + "_" + GOOD[41:], "character '_' at position 40 (URL-safe base64: use + and /)"),
    (GOOD[:76] + "\n" + GOOD[76:], "character '\\n' at position 76 (whitespace is not allowed)"),
    ("é" + GOOD, "character 'é' at position 0 (not a base64 character)"),
    (GOOD[:8] + "=" + GOOD[9:], "'=' padding before its end"),
])
def test_bad_base64_is_a_400_that_says_what_to_fix(payload, says):
    message = _message(payload)
    assert message.startswith("images[3].image_url.url has invalid base64 data: "), message
    assert message.endswith(says), message
    assert "Non-base64 digit" not in message


# ---- http(s) URLs, fetched from a real slow or large server on loopback by a real server ---------------
@pytest.fixture(scope="module")
def tiny_model():
    from service.engine.loader import load_model

    return load_model(Settings(model="tiny", device="cpu"))


def _url_settings(tmp_path, **kw) -> Settings:
    return Settings(model="tiny", device="cpu", store=tmp_path / "store", decode_workers=1, max_wait_ms=20,
                    allowed_url_hosts="127.0.0.1", allow_private_url_addresses=True, **kw)


def _urls(*urls: str) -> dict:
    return {"images": [{"type": "image_url", "image_url": {"url": u}} for u in urls]}


def test_the_bytes_a_request_fetches_count_against_its_budget(tmp_path, tiny_model):
    """24 allow-listed 60 MiB URLs in a 1.9 KB body took 1.97 GB of an API process: each was bounded alone,
    the request not at all. Now what a request's URLs fetch counts with its body against
    --max-request-bytes, and the fetches stop at the limit."""
    with SlowServer(size=1_500_000, chunk=64 * 1024, pause_s=0) as big:
        s = _url_settings(tmp_path, max_image_bytes=2_000_000, max_request_bytes=3_200_000)
        with live_server(s, tiny_model) as (url, app):
            r = httpx.post(url + "/encode", json=_urls(*(big.url(i) for i in range(6))), timeout=60)
            assert r.status_code == 413, r.text
            err = r.json()["error"]
            assert err["code"] == "request_too_large" and "--max-request-bytes" in err["message"], err
            assert err["index"] == 2 and err["message"].startswith("images[2]: "), err
            assert big.requests == 3, big.requests  # the third is refused by its Content-Length; no fourth
        # One fetch alone is still bounded by its own limit: before its body is read when it declares its size.
        with live_server(s.model_copy(update={"max_image_bytes": 1_000_000}), tiny_model) as (url, app):
            r = httpx.post(url + "/encode", json=_urls(big.url(9)), timeout=60)
            assert r.status_code == 413 and r.json()["error"]["code"] == "image_too_large", r.text
            assert "is 1500000 bytes, over the limit of 1000000" in r.json()["error"]["message"]


def test_url_timeout_is_a_deadline_for_the_whole_fetch(tmp_path, tiny_model):
    """A URL dripping a byte at a time within each read's timeout was still being fetched minutes later."""
    with SlowServer(size=1000, chunk=1, pause_s=0.25) as drip:
        with live_server(_url_settings(tmp_path, url_timeout_s=2), tiny_model) as (url, app):
            t0 = time.monotonic()
            r = httpx.post(url + "/encode", json=_urls(drip.url()), timeout=30)
            took = time.monotonic() - t0
            assert r.status_code == 422, r.text
            err = r.json()["error"]
            assert err["code"] == "image_fetch_failed" and "--url-timeout-s" in err["message"], err
            assert 1.5 <= took < 10, took
            assert httpx.get(url + "/health").status_code == 200


def test_a_fetch_stops_when_its_client_leaves(tmp_path, tiny_model):
    """A fetch went on after its client had gone, until its own timeout (or for ever, dripping)."""
    with SlowServer(size=10_000, chunk=1, pause_s=0.25) as drip:
        with live_server(_url_settings(tmp_path, url_timeout_s=120), tiny_model) as (url, app):
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(url + "/encode", json=_urls(drip.url()), timeout=httpx.Timeout(30, read=1.5))
            wait_for(lambda: drip.cut == 1 and drip.active == 0, timeout=10, what="the fetch to be cut off")
            wait_for(lambda: metric(httpx.get(url + "/metrics").text, "qve_requests_total", 'status="499"') == 1,
                     timeout=10, what="the request counted as 499")


# ---- what an error calls a part -----------------------------------------------------------------------
def test_errors_name_a_part_as_the_request_does(tmp_path, tiny_model):
    """A part missing its image_url object was reported at 'images.0.image_url.image_url' (pydantic's path,
    its union tag included); a multipart video part was called images[0]."""
    png = data_png()
    with live_server(_url_settings(tmp_path), tiny_model) as (url, app):
        def message(**kw) -> str:
            r = httpx.post(url + "/encode", timeout=30, **kw)
            assert 400 <= r.status_code < 500, r.text
            return r.json()["error"]["message"]

        said = message(json={"images": [{"type": "image_url", "image_url": {"url": "data:,"}}, {"type": "image_url"}]})
        assert said.startswith("invalid request body at 'images[1].image_url': Field required"), said
        said = message(json={"images": [{"type": "video_url", "video_url": {}}]})
        assert said.startswith("invalid request body at 'images[0].video_url.url': Field required"), said
        said = message(files=[("image", ("a.png", png, "image/png")), ("video", ("b.mp4", b"not a video", "video/mp4"))])
        assert said.startswith("video part 1: "), said
        said = message(files=[("video", ("b.mp4", b"", "video/mp4"))])
        assert said.startswith("video part 0 is empty"), said
        said = message(files=[("image", ("a.png", b"not an image", "image/png"))])
        assert said.startswith("image part 0: "), said
        said = message(json={"images": [{"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}]})
        assert said.startswith("images[0]: "), said  # (JSON: the part's path in the body)


def data_png() -> bytes:
    from tests.support import imagedata

    return imagedata.encode(imagedata.textured_rgb(64, 48, seed=3), "PNG")
