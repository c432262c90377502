"""The HTTP service in process, under a real uvicorn on a loopback port: contracts, dedupe, overload,
disconnects, hostile keys, bad input, failed steps and metrics."""

import hashlib
import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from service.config import Settings
from service.engine.loader import load_model
from service.store.format import read_embeddings
from tests.support import imagedata as data
from tests.support.live import Gate, file_server, local_host, json_body, live_server, metric, server_timing


@pytest.fixture(scope="module")
def tiny_model():
    return load_model(Settings(model="tiny", device="cpu"))


def _settings(tmp_path, **kw):
    base = dict(model="tiny", device="cpu", store=tmp_path / "store", max_pixels=256 * 256, decode_workers=1,
                max_wait_ms=20)
    base.update(kw)
    return Settings(**base)


def _png(seed: int, w: int = 96, h: int = 64) -> bytes:
    return data.encode(data.textured_rgb(w, h, seed=seed), "PNG")


def _wait_for(pred, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def test_encode_json_multipart_and_cache_hit(tmp_path, tiny_model):
    blob = data.valid_images()["coffee.png"]
    with live_server(_settings(tmp_path), tiny_model) as (url, app):
        t0 = time.perf_counter()
        r = httpx.post(url + "/encode", json=json_body(blob, blob, uuids=[None, "client-key_1.a"]), timeout=30)
        wall = time.perf_counter() - t0
        assert r.status_code == 200, r.text
        # Where the time went: two images encoded (the tiny tower on the CPU takes a step of a few ms at least)
        timing = server_timing(r, wall)
        assert timing["encode"] > 0.1 and timing["decode"] > 0, timing
        first, named = r.json()["items"]
        assert first["cached"] is False and named["key"] == "client-key_1.a"
        # a content key: "sha256+" and 64 hex digits, outside the uuid alphabet (no client can take it)
        assert first["key"].startswith("sha256+") and int(first["key"][7:], 16) >= 0 and len(first["key"]) == 71
        stored = read_embeddings(tmp_path / "store", first["key"])
        n = first["num_tokens"]
        t, h, w = first["grid_thw"]
        assert n == t * h * w // 4 == stored.main.shape[0]
        assert first["shape"] == [n, 48 * 3] and first["dtype"] == "float32"
        assert first["path"] == f"{first['key']}/encoder_cache.safetensors"
        assert (tmp_path / "store" / first["path"]).is_file()
        assert list(stored.grid_thw) == first["grid_thw"] and len(stored.deepstack) == 2
        assert torch.equal(read_embeddings(tmp_path / "store", "client-key_1.a").main, stored.main)

        t0 = time.perf_counter()
        r = httpx.post(url + "/encode", json=json_body(blob), timeout=30)
        hit = server_timing(r, time.perf_counter() - t0)
        again = r.json()["items"][0]
        assert again["cached"] is True and again["key"] == first["key"]
        assert hit["encode"] < timing["encode"], (hit, timing)  # a cache hit waits for no step
        multi = httpx.post(url + "/encode", files=[("image", ("c.png", blob, "image/png"))], timeout=30)
        assert multi.status_code == 200 and multi.json()["items"][0] == again
        m = httpx.get(url + "/metrics").text
        assert metric(m, "qve_cache_hits_total") == 2
        assert metric(m, "qve_images_total", 'outcome="encoded"') == 2


def test_twenty_identical_concurrent_requests_encode_once(tmp_path, tiny_model):
    blob = _png(1)
    with live_server(_settings(tmp_path, max_wait_ms=200), tiny_model) as (url, app):
        def post(_):
            return httpx.post(url + "/encode", json=json_body(blob), timeout=60)

        with ThreadPoolExecutor(20) as pool:
            responses = list(pool.map(post, range(20)))
        assert [r.status_code for r in responses] == [200] * 20
        keys = {r.json()["items"][0]["key"] for r in responses}
        assert len(keys) == 1
        m = httpx.get(url + "/metrics").text
        assert metric(m, "qve_images_total", 'outcome="encoded"') == 1
        assert metric(m, "qve_steps_total", 'result="ok"') == 1
        joined = metric(m, "qve_images_total", 'outcome="coalesced"') + metric(m, "qve_images_total", 'outcome="cached"')
        assert joined == 19


def test_overload_answers_429_with_retry_after_and_recovers(tmp_path, tiny_model):
    with live_server(_settings(tmp_path, max_queue_images=2, max_batch_images=1), tiny_model) as (url, app):
        gate = Gate(local_host(app.state.rt).engine)
        with ThreadPoolExecutor(8) as pool:
            first = pool.submit(httpx.post, url + "/encode", json=json_body(_png(100)), timeout=60)
            assert gate.entered.wait(10)  # image 100 is in the step loop, held
            queued = [pool.submit(httpx.post, url + "/encode", json=json_body(_png(101 + i)), timeout=60) for i in range(2)]
            _wait_for(lambda: local_host(app.state.rt).batcher.queue_depth() == 2)
            over = httpx.post(url + "/encode", json=json_body(_png(200)), timeout=60)
            assert over.status_code == 429
            assert over.headers["retry-after"] == "1"
            assert over.json()["error"]["code"] == "overloaded" and "queue is full" in over.json()["error"]["message"]
            gate.release.set()
            assert [f.result().status_code for f in [first, *queued]] == [200, 200, 200]
        assert httpx.post(url + "/encode", json=json_body(_png(200)), timeout=60).status_code == 200
        m = httpx.get(url + "/metrics").text
        assert metric(m, "qve_requests_total", 'status="429"') == 1 and metric(m, "qve_rejected_total") == 1


def test_client_that_disconnects_is_dropped_before_running(tmp_path, tiny_model):
    with live_server(_settings(tmp_path, max_batch_images=1), tiny_model) as (url, app):
        rt = app.state.rt
        gate = Gate(local_host(rt).engine)
        with ThreadPoolExecutor(2) as pool:
            held = pool.submit(httpx.post, url + "/encode", json=json_body(_png(300)), timeout=60)
            assert gate.entered.wait(10)
            with pytest.raises(httpx.ReadTimeout):  # this client gives up while its image is queued
                httpx.post(url + "/encode", json=json_body(_png(301)), timeout=httpx.Timeout(60, read=1.0))
            _wait_for(lambda: local_host(rt).batcher.stats.dropped == 1)
            assert local_host(rt).batcher.queue_depth() == 0
            gate.release.set()
            assert held.result().status_code == 200
        _wait_for(lambda: local_host(rt).batcher.in_flight() == 0)
        assert len(local_host(rt).store) == 1  # the abandoned image was never encoded
        m = httpx.get(url + "/metrics").text
        assert metric(m, "qve_dropped") == 1 and metric(m, "qve_steps_total", 'result="ok"') == 1


def test_a_client_that_leaves_while_its_scan_bomb_decodes_gives_its_queue_place_back_at_once(tmp_path, tiny_model):
    """Issue 23: clients of scan bombs that left after 5 s kept their queue places while the bombs decoded
    (the whole --max-queue-tokens: everyone else got 429). The place goes back when the client leaves; the
    decode itself ends at its deadline."""
    bomb = data.scan_bomb(data.progressive_photo(4096, smooth=True), 2000)  # 9 s to decode in full
    settings = _settings(tmp_path, max_jpeg_scans=10**6, decode_timeout_s=6)
    with live_server(settings, tiny_model) as (url, app):
        batcher = local_host(app.state.rt).batcher
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "/encode", json=json_body(bomb), timeout=httpx.Timeout(60, read=1.0))
        left = time.monotonic()  # its decode goes on, for up to 6 s
        _wait_for(lambda: batcher.reserved() == 0, timeout=10)
        assert time.monotonic() - left < 2.5, "the place went back only when the decode ended"
        assert httpx.post(url + "/encode", json=json_body(_png(310)), timeout=60).status_code == 200


@pytest.mark.parametrize("bad", [
    "../escape", "..", ".", "/etc/passwd", "a/b", "a\\b", "", "x" * 129, ".hidden", "key\x00nul", "ключ",
    "a b", "~root", "key\n",
])
def test_uuids_that_try_to_leave_the_store_are_rejected(tmp_path, tiny_model, bad, request):
    # one server for all parametrized cases would be faster, but each case must see a clean tree
    with live_server(_settings(tmp_path), tiny_model) as (url, app):
        before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
        r = httpx.post(url + "/encode", json=json_body(_png(5), uuids=[bad]), timeout=30)
        assert r.status_code == 422, r.text
        assert r.json()["error"]["code"] == "invalid_key"
        assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
        assert not (tmp_path.parent / "escape").exists()


def test_bad_requests_get_clear_4xx_and_good_ones_in_the_same_step_succeed(tmp_path, tiny_model):
    bad_images = data.bad_images()
    with live_server(_settings(tmp_path, max_wait_ms=300, max_image_bytes=2_000_000, max_input_pixels=4_000_000),
                     tiny_model) as (url, app):
        cases = {name: json_body(blob) for name, (blob, _, _) in bad_images.items()}
        with ThreadPoolExecutor(16) as pool:
            goods = [pool.submit(httpx.post, url + "/encode", json=json_body(_png(400 + i)), timeout=60) for i in range(4)]
            bads = {n: pool.submit(httpx.post, url + "/encode", json=body, timeout=60) for n, body in cases.items()}
            for name, fut in bads.items():
                r = fut.result()
                assert 400 <= r.status_code < 500, (name, r.status_code, r.text)
                err = r.json()["error"]
                assert err["code"] == bad_images[name][1] and err["index"] == 0, name
                assert err["message"].startswith("images[0]")
            assert [g.result().status_code for g in goods] == [200] * 4
        # malformed requests of every other kind
        post = lambda **kw: httpx.post(url + "/encode", timeout=30, **kw)  # noqa: E731
        checks = [
            (post(content=b"{not json", headers={"content-type": "application/json"}), 400, "bad_request"),
            (post(json={"images": []}), 400, "bad_request"),
            (post(json={"imgs": []}), 400, "bad_request"),
            (post(json={"images": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}]}), 400, "bad_request"),
            (post(json={"images": [{"type": "image_url", "image_url": {"url": "ftp://x/y.png"}}]}), 400, "bad_request"),
            (post(json={"images": [{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}), 422, "image_fetch_failed"),
            (post(json={"images": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,"}}]}), 422, "empty_image"),
            (post(content=b"x", headers={"content-type": "text/plain"}), 400, "bad_request"),
            (post(files=[("file", ("a.png", _png(1), "image/png"))]), 400, "bad_request"),
            (post(json=json_body(*[_png(1)] * 65)), 400, "bad_request"),
            (post(json=json_body(b"\0" * 2_100_000)), 413, "image_too_large"),
            (post(files=[("image", ("big.png", b"\0" * 2_100_000, "image/png"))]), 413, "image_too_large"),
        ]
        for i, (r, status, code) in enumerate(checks):
            assert (r.status_code, r.json()["error"]["code"]) == (status, code), (i, r.text)
        assert httpx.get(url + "/health").status_code == 200
        assert httpx.post(url + "/encode", json=json_body(_png(499)), timeout=30).status_code == 200


def test_failed_step_fails_only_its_requests_and_the_loop_lives_on(tmp_path, tiny_model):
    with live_server(_settings(tmp_path, max_batch_images=1), tiny_model) as (url, app):
        engine = local_host(app.state.rt).engine
        real_run, calls = engine.runner.run, []

        def flaky(staged):
            calls.append(1)
            if len(calls) == 1:
                raise RuntimeError("injected device fault")
            return real_run(staged)

        engine.runner.run = flaky
        bad = httpx.post(url + "/encode", json=json_body(_png(600)), timeout=30)
        assert bad.status_code == 500 and bad.json()["error"]["code"] == "backend_error"
        # The client is told which step failed, not the device's or allocator's text (issue 23: a CPU OOM's
        # "DefaultCPUAllocator: ... you tried to allocate 34359738368 bytes" came back in the body).
        assert "injected device fault" not in bad.json()["error"]["message"]
        assert "failed on the device (RuntimeError)" in bad.json()["error"]["message"]
        good = httpx.post(url + "/encode", json=json_body(_png(600)), timeout=30)  # same image again: now it works
        assert good.status_code == 200 and good.json()["items"][0]["cached"] is False
        assert httpx.get(url + "/health").status_code == 200
        m = httpx.get(url + "/metrics").text
        assert metric(m, "qve_steps_total", 'result="failed"') == 1 and metric(m, "qve_steps_total", 'result="ok"') == 1


def test_metrics_move_as_requests_are_served(tmp_path, tiny_model):
    with live_server(_settings(tmp_path), tiny_model) as (url, app):
        m0 = httpx.get(url + "/metrics").text
        assert metric(m0, "qve_requests_total", 'status="200"') == 0
        tokens = 0
        for i in range(3):
            r = httpx.post(url + "/encode", json=json_body(_png(700 + i), _png(700)), timeout=30)
            assert r.status_code == 200
            tokens += r.json()["items"][0]["num_tokens"]
        m1 = httpx.get(url + "/metrics").text
        assert metric(m1, "qve_requests_total", 'status="200"') == 3
        assert metric(m1, "qve_encode_latency_seconds_count") == 3
        assert metric(m1, "qve_images_total", 'outcome="encoded"') == 3  # 700, 701, 702
        assert metric(m1, "qve_cache_hits_total") == 2  # 700 again in requests 2 and 3
        assert tokens > 0 and metric(m1, "qve_step_tokens_sum") == tokens
        assert metric(m1, "qve_step_tokens_count") == 3
        assert metric(m1, "qve_store_items") == 3 and metric(m1, "qve_store_bytes") > tokens * 144 * 4
        assert metric(m1, "qve_queue_depth") == 0 and metric(m1, "qve_in_flight") == 0


def test_eviction_at_capacity_through_http(tmp_path, tiny_model):
    tokens = 70  # a 96x64 image upscaled to min_pixels (65536): grid 14x20 -> 70 tokens
    one = tokens * 144 * 4  # x 144 float32 columns
    with live_server(_settings(tmp_path, store_capacity_bytes=3 * one + 3 * 1024, store_min_residency_s=0),
                     tiny_model) as (url, app):
        keys = [httpx.post(url + "/encode", json=json_body(_png(800 + i)), timeout=30).json()["items"][0]["key"]
                for i in range(6)]
        m = httpx.get(url + "/metrics").text
        assert metric(m, "qve_store_evictions") == 3 and metric(m, "qve_store_items") == 3
        with pytest.raises(KeyError):
            read_embeddings(tmp_path / "store", keys[0])
        assert read_embeddings(tmp_path / "store", keys[-1]).main.shape == (tokens, 48)


def test_answered_keys_stay_readable_for_the_residency_window_and_a_full_store_answers_503(tmp_path, tiny_model):
    tokens = 70
    one = tokens * 144 * 4
    with live_server(_settings(tmp_path, store_capacity_bytes=3 * one + 3 * 1024, store_min_residency_s=600),
                     tiny_model) as (url, app):
        answered = [httpx.post(url + "/encode", json=json_body(_png(850 + i)), timeout=30) for i in range(3)]
        keys = [r.json()["items"][0]["key"] for r in answered]
        # Store pressure: a fourth image would need an eviction, but every entry was answered moments ago.
        r = httpx.post(url + "/encode", json=json_body(_png(860)), timeout=30)
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "store_full" and 1 <= int(r.headers["Retry-After"]) <= 600
        for key in keys:  # what /encode told clients is still there
            assert read_embeddings(tmp_path / "store", key).main.shape == (tokens, 48)
        m = httpx.get(url + "/metrics").text
        assert metric(m, "qve_store_evictions") == 0 and metric(m, "qve_store_items") == 3
        # A cache hit is answered from the store as before, and the service keeps serving.
        again = httpx.post(url + "/encode", json=json_body(_png(850)), timeout=30)
        assert again.status_code == 200 and again.json()["items"][0]["cached"] is True
        assert httpx.get(url + "/health").status_code == 200


def test_keys_cannot_be_poisoned_a_uuid_names_one_image(tmp_path, tiny_model):
    x, v, other = _png(870), _png(871), _png(872)
    with live_server(_settings(tmp_path, max_batch_images=1), tiny_model) as (url, app):
        post = lambda body: httpx.post(url + "/encode", json=body, timeout=30)  # noqa: E731
        # A client cannot take a content key: posting X under V's would-be key is refused, nothing stored.
        plain_v = "sha256+" + "0" * 64
        r = post(json_body(x, uuids=[plain_v]))
        assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_key"
        r = post(json_body(v))
        assert r.status_code == 200 and r.json()["items"][0]["cached"] is False
        v_key = r.json()["items"][0]["key"]
        assert post(json_body(x, uuids=[v_key])).status_code == 422  # not even V's real content key
        assert post(json_body(v)).json()["items"][0]["cached"] is True  # V still answers V's embeddings

        # A uuid, once bound to an image, is not answered for other bytes.
        assert post(json_body(x, uuids=["u1"])).status_code == 200
        r = post(json_body(other, uuids=["u1"]))
        assert r.status_code == 409 and r.json()["error"] == {
            "code": "key_conflict", "index": 0, "message": r.json()["error"]["message"]}
        assert "already bound to other image bytes (in the store)" in r.json()["error"]["message"]
        assert post(json_body(x, uuids=["u1"])).json()["items"][0]["cached"] is True  # the right bytes still work

        # Two different images with one uuid in one request: the second is the conflict.
        r = post(json_body(x, other, uuids=["u2", "u2"]))
        assert r.status_code == 409 and r.json()["error"]["index"] == 1
        assert post(json_body(x, x, uuids=["u2", "u2"])).status_code == 200  # the same image twice is fine

        # While the uuid's first image is still being encoded, other bytes under it are refused too.
        gate = Gate(local_host(app.state.rt).engine)
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(post, json_body(x, uuids=["u3"]))
            assert gate.entered.wait(10)
            r = post(json_body(other, uuids=["u3"]))
            assert r.status_code == 409 and "being encoded for another request" in r.json()["error"]["message"]
            gate.release.set()
            assert first.result().status_code == 200
        stored = read_embeddings(tmp_path / "store", "u3")
        assert stored.metadata["content_sha256"] == hashlib.sha256(x).hexdigest()


def test_unknown_paths_and_methods_answer_the_json_error_shape(tmp_path, tiny_model):
    with live_server(_settings(tmp_path), tiny_model) as (url, app):
        r = httpx.get(url + "/nope")
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found" and "/nope" in r.json()["error"]["message"]
        r = httpx.get(url + "/" + "a" * 10_000)  # not echoed whole (issue 23: a 10 KB path came back)
        assert r.status_code == 404 and len(r.content) < 400 and "(10001 characters)" in r.json()["error"]["message"]
        r = httpx.get(url + "/encode")
        assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
        assert "POST" in r.headers["allow"]
        assert "detail" not in r.json()


def test_api_key_guards_encode_and_metrics_but_not_health_or_ready(tmp_path, tiny_model, monkeypatch):
    monkeypatch.setenv("QVE_API_KEY", "old-key, new-key")  # several keys: rotation without downtime
    s = _settings(tmp_path)
    assert s.api_key == ["old-key", "new-key"] and "new-key" not in repr(s)
    with live_server(s, tiny_model) as (url, app):
        body = json_body(_png(880))
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic new-key"},
                        {"Authorization": "Bearer new-ke"}):
            r = httpx.post(url + "/encode", json=body, headers=headers, timeout=30)
            assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized", headers
            assert r.headers["www-authenticate"] == "Bearer"
        for key in ("old-key", "new-key"):
            r = httpx.post(url + "/encode", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=30)
            assert r.status_code == 200, r.text
        assert httpx.get(url + "/health").status_code == 200 and httpx.get(url + "/ready").status_code == 200
        # /ready's details (store path, PIDs, device) only with the key; without it, just whether it is ready.
        assert httpx.get(url + "/ready").json() == {"ready": True}
        full = httpx.get(url + "/ready", headers={"Authorization": "Bearer new-key"}).json()
        assert full["ready"] is True and len(full) > 1 and str(tmp_path) in json.dumps(full)
        assert httpx.get(url + "/metrics").status_code == 401
        assert httpx.get(url + "/metrics", headers={"Authorization": "Bearer old-key"}).status_code == 200
    with live_server(s.model_copy(update={"api_key_metrics": False}), tiny_model) as (url, app):
        assert httpx.get(url + "/metrics").status_code == 200  # scrapers without the key, if so configured
        assert httpx.post(url + "/encode", json=json_body(_png(881)), timeout=30).status_code == 401


def test_health_turns_503_when_the_step_loop_dies(tmp_path, tiny_model):
    with live_server(_settings(tmp_path), tiny_model) as (url, app):
        assert httpx.get(url + "/health").status_code == 200
        assert httpx.get(url + "/docs").status_code == 200
        assert "/encode" in httpx.get(url + "/openapi.json").json()["paths"]
        local_host(app.state.rt).batcher.close()  # the loop exits once the queue is empty
        _wait_for(lambda: not local_host(app.state.rt).engine.alive())
        r = httpx.get(url + "/health")
        assert r.status_code == 503


def test_a_failed_store_write_fails_only_that_image(tmp_path, tiny_model):
    with live_server(_settings(tmp_path, max_wait_ms=200), tiny_model) as (url, app):
        store = local_host(app.state.rt).store
        real_commit, bad = store.commit, {}

        def commit(reservation, ec_cache, answer=None):  # the write itself fails (after the reservation succeeded)
            if reservation.key == bad.get("key"):
                store.abort(reservation)
                raise OSError(28, "No space left on device")
            return real_commit(reservation, ec_cache, answer)

        store.commit = commit
        bad["key"] = "doomed"
        with ThreadPoolExecutor(2) as pool:
            a = pool.submit(httpx.post, url + "/encode", json=json_body(_png(900), uuids=["doomed"]), timeout=30)
            b = pool.submit(httpx.post, url + "/encode", json=json_body(_png(901), uuids=["fine"]), timeout=30)
            ra, rb = a.result(), b.result()
        assert ra.status_code == 500 and ra.json()["error"]["code"] == "backend_error"
        assert "No space left on device" in ra.json()["error"]["message"]
        assert rb.status_code == 200 and rb.json()["items"][0]["key"] == "fine"
        assert httpx.get(url + "/health").status_code == 200


def test_a_store_that_cannot_be_written_turns_health_503_until_a_write_succeeds(tmp_path, tiny_model, monkeypatch):
    import service.store.files as files_mod

    with live_server(_settings(tmp_path), tiny_model) as (url, app):
        real = files_mod.allocate

        def read_only(fd, size):
            raise OSError(30, "Read-only file system")

        monkeypatch.setattr(files_mod, "allocate", read_only)
        r = httpx.post(url + "/encode", json=json_body(_png(960)), timeout=30)
        assert r.status_code == 500 and "Read-only file system" in r.json()["error"]["message"]
        h = httpx.get(url + "/health")
        assert h.status_code == 503 and "store cannot be written" in h.json()["status"]
        monkeypatch.setattr(files_mod, "allocate", real)
        assert httpx.post(url + "/encode", json=json_body(_png(961)), timeout=30).status_code == 200
        assert httpx.get(url + "/health").status_code == 200


def test_request_size_limit_holds_while_streaming_for_json_and_multipart(tmp_path, tiny_model):
    import socket
    from urllib.parse import urlsplit

    limit = 1_000_000
    with live_server(_settings(tmp_path, max_request_bytes=limit), tiny_model) as (url, app):
        host, port = urlsplit(url).hostname, urlsplit(url).port

        def raw(head: bytes, body: bytes = b"") -> bytes:
            """Send a request head (and some body), return what the server answers before we send more."""
            with socket.create_connection((host, port), timeout=10) as c:
                c.sendall(head + body)
                return c.recv(65536)

        # A declared 10 GB body, JSON or multipart: 413 at once, with nothing of the body sent.
        for ctype in (b"application/json", b"multipart/form-data; boundary=x"):
            answer = raw(b"POST /encode HTTP/1.1\r\nHost: t\r\nContent-Type: " + ctype +
                         b"\r\nContent-Length: 10000000000\r\n\r\n")
            assert answer.startswith(b"HTTP/1.1 413") and b"request_too_large" in answer, answer[:300]

        # Chunked bodies (no length declared): answered 413 as soon as they pass the limit, while the client
        # is still sending (the body is never finished here: a server waiting for its end would time out).
        def chunk(data: bytes) -> bytes:
            return b"%x\r\n" % len(data) + data + b"\r\n"

        first = {b"application/json": b'{"images": [{"type": "image_url", "image_url": {"url": "data:',
                 b"multipart/form-data; boundary=x": b'--x\r\nContent-Disposition: form-data; name="image"; '
                                                     b'filename="a.png"\r\n\r\n'}
        for ctype, start in first.items():
            body = chunk(start) + chunk(b"A" * 65536) * 24  # 1.5 MB, no final chunk
            answer = raw(b"POST /encode HTTP/1.1\r\nHost: t\r\nContent-Type: " + ctype +
                         b"\r\nTransfer-Encoding: chunked\r\n\r\n", body)
            assert answer.startswith(b"HTTP/1.1 413") and b"request_too_large" in answer, answer[:300]
        # Under the limit, everything as before.
        assert httpx.post(url + "/encode", json=json_body(_png(970)), timeout=30).status_code == 200


def test_a_stalled_body_gets_408_and_idle_connections_close_after_keep_alive(tmp_path, tiny_model):
    import socket
    from urllib.parse import urlsplit

    with live_server(_settings(tmp_path, body_timeout_s=0.5, keep_alive_s=1.0), tiny_model) as (url, app):
        addr = (urlsplit(url).hostname, urlsplit(url).port)
        with socket.create_connection(addr, timeout=10) as c:  # 1000 bytes promised, 10 sent, then silence
            t0 = time.monotonic()
            c.sendall(b"POST /encode HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 1000\r\n\r\n{\"images\":")
            answer = c.recv(65536)
            assert answer.startswith(b"HTTP/1.1 408") and b"request_timeout" in answer, answer[:300]
            assert time.monotonic() - t0 < 8
            # ... and its connection is closed, not kept for the rest of a body that never came (issue 23).
            assert b"\r\nconnection: close\r\n" in answer.lower(), answer[:300]
            while answer := c.recv(65536):
                pass
        with socket.create_connection(addr, timeout=10) as c:  # an idle keep-alive connection is closed
            c.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
            assert c.recv(65536).startswith(b"HTTP/1.1 200")
            t0 = time.monotonic()
            assert c.recv(65536) == b""  # the server closed it
            assert 0.5 < time.monotonic() - t0 < 8
        # An ordinary request is unaffected: the timeout covers only the gaps while its body arrives.
        assert httpx.post(url + "/encode", json=json_body(_png(980)), timeout=30).status_code == 200


def test_a_killed_decode_worker_is_replaced_and_costs_at_most_one_request(tmp_path, tiny_model):
    import os
    import signal

    with live_server(_settings(tmp_path, decode_workers=2), tiny_model) as (url, app):
        rt = app.state.rt
        assert httpx.post(url + "/encode", json=json_body(_png(990)), timeout=30).status_code == 200
        old_pool = rt.decoder.pool
        victim = next(iter(old_pool._processes))  # what the OOM killer does to a decode worker
        os.kill(victim, signal.SIGKILL)
        # The executor learns of the death in its management thread; on a loaded machine that can come
        # after a request or two were already served by the surviving worker. Wait for it (deadline).
        deadline = time.monotonic() + 20
        while not old_pool._broken and time.monotonic() < deadline:
            time.sleep(0.01)
        assert old_pool._broken, "the pool never noticed its killed worker"
        codes = [httpx.post(url + "/encode", json=json_body(_png(991 + k)), timeout=30) for k in range(4)]
        first = codes[0]
        assert first.status_code in (200, 503), first.text
        if first.status_code == 503:
            assert first.json()["error"]["code"] == "unavailable" and "decode worker died" in first.json()["error"]["message"]
        assert [r.status_code for r in codes[1:]] == [200, 200, 200]
        assert rt.decoder.pool is not old_pool and httpx.get(url + "/health").status_code == 200


def test_a_stuck_decode_pool_is_replaced_its_waiting_images_answered_503(tmp_path, tiny_model, monkeypatch):
    """A pool whose workers stop answering without the executor noticing (a worker killed while it held
    the call queue's lock): after DECODE_STALL_S with no decode finished, its workers are killed, a new
    pool serves, and the image that waited gets a 503 it can retry."""
    import concurrent.futures

    class Worker:
        killed = False

        def kill(self):
            self.killed = True

    class StuckPool(concurrent.futures.Executor):
        def __init__(self):
            self._processes, self.shut = {1: Worker(), 2: Worker()}, False

        def submit(self, fn, /, *args, **kwargs):
            return concurrent.futures.Future()  # never runs, never finishes

        def shutdown(self, wait=True, *, cancel_futures=False):
            self.shut = True

    with live_server(_settings(tmp_path, decode_workers=1), tiny_model) as (url, app):
        rt = app.state.rt
        rt.decoder.stall_s = 1.5
        assert httpx.post(url + "/encode", json=json_body(_png(980)), timeout=30).status_code == 200
        real, stuck = rt.decoder.pool, StuckPool()
        rt.decoder.pool = stuck
        real.shutdown(wait=True)
        t0 = time.monotonic()
        r = httpx.post(url + "/encode", json=json_body(_png(981)), timeout=30)
        assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
        assert r.json()["error"]["code"] == "unavailable" and "stopped answering" in r.json()["error"]["message"]
        assert 1.5 <= time.monotonic() - t0 < 15
        assert rt.decoder.pool is not stuck and stuck.shut and all(w.killed for w in stuck._processes.values())
        again = httpx.post(url + "/encode", json=json_body(_png(981)), timeout=30)  # the retry: a new pool serves
        assert again.status_code == 200, again.text
        assert httpx.get(url + "/health").status_code == 200


def test_image_urls_only_from_allowed_hosts_with_limits(tmp_path, tiny_model):
    blob = _png(950)
    bodies = {"/ok.png": blob, "/big.png": b"\0" * 3_000_000, "/secret": b"SECRET-metrics 42 not an image"}
    with file_server(bodies) as port:
        base = f"http://127.0.0.1:{port}"
        s = _settings(tmp_path, allowed_url_hosts="127.0.0.1,localhost", max_image_bytes=2_000_000)
        with live_server(s, tiny_model) as (url, app):
            # Allow-listed, but resolving to loopback: refused unless --allow-private-url-addresses.
            r = httpx.post(url + "/encode", timeout=30, json={"images": [
                {"type": "image_url", "image_url": {"url": f"http://localhost:{port}/ok.png"}}]})
            assert r.status_code == 422 and "loopback, private or link-local" in r.json()["error"]["message"]
            # Malformed URLs are the client's mistake: 400, never a 500.
            for bad in ("http://[::1", "http://[zzz]/", "http://127.0.0.1:99999/x.png", "http://127.0.0.1/a\tb.png",
                        "https:///nohost.png"):
                r = httpx.post(url + "/encode", timeout=30,
                               json={"images": [{"type": "image_url", "image_url": {"url": bad}}]})
                assert r.status_code == 400 and r.json()["error"]["code"] == "bad_request", (bad, r.text)
        s = s.model_copy(update={"allow_private_url_addresses": True, "allowed_url_hosts": ["127.0.0.1"]})
        with live_server(s, tiny_model) as (url, app):
            def post(image_url):
                return httpx.post(url + "/encode", timeout=30,
                                  json={"images": [{"type": "image_url", "image_url": {"url": image_url}}]})

            ok = post(base + "/ok.png")
            assert ok.status_code == 200, ok.text
            direct = httpx.post(url + "/encode", json=json_body(blob), timeout=30).json()["items"][0]
            assert direct["cached"] is True and direct["key"] == ok.json()["items"][0]["key"]  # same bytes, same key
            big = post(base + "/big.png")
            assert big.status_code == 413 and big.json()["error"]["code"] == "image_too_large"
            missing = post(base + "/nope.png")
            assert missing.status_code == 422 and "answered 404" in missing.json()["error"]["message"]
            other = post(f"http://localhost:{port}/ok.png")  # not on the allow-list
            assert other.status_code == 422 and "not allowed" in other.json()["error"]["message"]
            leak = post(base + "/secret")  # fetched content that is no image: never echoed back
            assert leak.status_code == 422 and leak.json()["error"]["code"] == "not_an_image"
            assert "SECRET" not in leak.text and "fetched from" in leak.json()["error"]["message"]


def test_failed_warmup_is_reported_by_health(tmp_path, tiny_model, monkeypatch):
    from fastapi.testclient import TestClient

    from service.engine.core import Engine
    from service.procs.local import local_app

    def broken(self, images):
        raise RuntimeError("no device")

    monkeypatch.setattr(Engine, "encode_sync", broken)
    with TestClient(local_app(_settings(tmp_path), tiny_model)) as client:
        _wait_for(lambda: client.get("/health").status_code == 503)
        assert client.get("/ready").status_code == 503
        assert "warm-up failed" in client.get("/health").json()["status"]


def test_openapi_document_resolves_every_ref_and_lists_the_error_answers(tmp_path, tiny_model):
    from service.api.schemas import ErrorResponse
    from service.procs.local import local_app

    doc = local_app(_settings(tmp_path), tiny_model).openapi()
    refs: list[str] = []

    def walk(node):
        if isinstance(node, dict):
            refs.extend(v for k, v in node.items() if k == "$ref")
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(doc)
    assert refs and all(r.startswith("#/components/schemas/") for r in refs), refs
    assert {r.rsplit("/", 1)[1] for r in refs} <= set(doc["components"]["schemas"])  # nothing dangling
    encode = doc["paths"]["/encode"]["post"]
    assert {"400", "401", "409", "413", "422", "429", "503"} <= set(encode["responses"])
    assert encode["responses"]["429"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ErrorResponse"}
    assert encode["requestBody"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/EncodeRequest"}
    # and the answers really have that shape
    with live_server(_settings(tmp_path), tiny_model) as (url, app):
        for r in (httpx.post(url + "/encode", json={"images": "nope"}), httpx.post(url + "/encode", json=json_body(b"x")),
                  httpx.get(url + "/nowhere")):
            assert r.status_code >= 400
            ErrorResponse.model_validate(r.json())


def test_admission_before_decode_a_full_queue_refuses_images_before_decoding_them(tmp_path, tiny_model):
    from PIL import Image

    # 4000x4000 = 16M pixels (48 MB decoded) in a 48 KB PNG: the 24 concurrent huge images.
    huge = data.encode(Image.new("RGB", (4000, 4000), (40, 90, 160)), "PNG")
    s = _settings(tmp_path, max_queue_images=2, max_batch_images=1, max_queue_tokens=600)
    with live_server(s, tiny_model) as (url, app):
        rt = app.state.rt
        gate = Gate(local_host(rt).engine)
        decoded, real_decode = [], rt.decoder.decode

        async def counting_decode(blob, *rest):
            decoded.append(len(blob))
            return await real_decode(blob, *rest)

        rt.decoder.decode = counting_decode
        with ThreadPoolExecutor(24) as pool:
            first = pool.submit(httpx.post, url + "/encode", json=json_body(_png(1100)), timeout=60)
            assert gate.entered.wait(10)  # image 1100 is in the step loop, held
            queued = [pool.submit(httpx.post, url + "/encode", json=json_body(_png(1101 + i)), timeout=60)
                      for i in range(2)]
            _wait_for(lambda: local_host(rt).batcher.queue_depth() == 2)
            before = len(decoded)
            # The queue is full by count: 24 concurrent huge images (distinct keys) all 429, none decoded.
            over = list(pool.map(lambda k: httpx.post(url + "/encode", json=json_body(huge, uuids=[f"huge-{k}"]),
                                                      timeout=60), range(24)))
            assert [r.status_code for r in over] == [429] * 24, [r.text for r in over if r.status_code != 429]
            assert all(r.headers["retry-after"] == "1" and r.json()["error"]["code"] == "overloaded" for r in over)
            assert len(decoded) == before, "images refused by admission were decoded"
            gate.release.set()
            assert [f.result().status_code for f in [first, *queued]] == [200, 200, 200]
        _wait_for(lambda: local_host(rt).batcher.queue_depth() == 0 and local_host(rt).batcher.in_flight() == 0)

        # By tokens: with one small image queued, a large one (1444 tokens by its header: 1216x1216 once resized) is
        # over the 600-token bound: 429 before its decode; a small one still fits.
        large = data.encode(data.textured_rgb(1200, 1200, seed=1199), "JPEG")
        gate = Gate(local_host(rt).engine)
        with ThreadPoolExecutor(4) as pool:
            held = pool.submit(httpx.post, url + "/encode", json=json_body(_png(1200)), timeout=60)
            assert gate.entered.wait(10)
            small = pool.submit(httpx.post, url + "/encode", json=json_body(_png(1201)), timeout=60)
            _wait_for(lambda: local_host(rt).batcher.queue_depth() == 1)
            before = len(decoded)
            r = httpx.post(url + "/encode", json=json_body(large), timeout=60)
            assert r.status_code == 429 and "this image adds 1444," in r.json()["error"]["message"], r.text
            assert len(decoded) == before
            gate.release.set()
            assert held.result().status_code == 200 and small.result().status_code == 200
        # A request that fails after taking its places gives them back.
        bad = httpx.post(url + "/encode", json=json_body(_png(1300), b"\x89PNG\r\n\x1a\n broken"), timeout=60)
        assert bad.status_code == 422
        assert local_host(rt).batcher.reserved() == 0
        assert httpx.post(url + "/encode", json=json_body(large), timeout=60).status_code == 200  # alone: admitted


def test_the_docs_page_prefills_a_request_that_works_as_it_is(tmp_path, tiny_model):
    """Swagger UI's "Try it out" sends the document's example body: it must be a real request (a
    `"url": "string"` placeholder answers 400)."""
    with live_server(_settings(tmp_path), tiny_model) as (url, app):
        for doc in ("/openapi.json", "/docs/openapi-3.0.json"):
            body = httpx.get(url + doc).json()["paths"]["/encode"]["post"]["requestBody"]["content"]
            example = body["application/json"]["example"]
            r = httpx.post(url + "/encode", json=example, timeout=60)
            assert r.status_code == 200, (doc, r.text)
            (item,) = r.json()["items"]
            assert item["num_tokens"] > 0 and item["key"].startswith("sha256+")


# ---- video --------------------------------------------------------------------------------------------
def _video_part(blob: bytes, uuid: str | None = None, mime: str = "video/mp4") -> dict:
    import base64

    part = {"type": "video_url", "video_url": {"url": f"data:{mime};base64,{base64.b64encode(blob).decode()}"}}
    return part if uuid is None else {**part, "uuid": uuid}


def test_videos_beside_images_in_json_and_multipart_answer_their_sampling_and_equal_each_alone(tmp_path, tiny_model):
    from service.media.params import VideoParams
    from service.media.video import read_header, timestamps
    from service.media.video_preprocess import plan_video
    from tests.support import videodata as vd

    clip = vd.clip()  # H.264 in MP4, 160x120, 24 frames at 8 fps
    image = _png(700)
    plan = plan_video(read_header(clip, Settings().video_limits), VideoParams())  # the tiny preset's: the defaults
    with live_server(_settings(tmp_path), tiny_model) as (url, app):
        r = httpx.post(url + "/encode", json={"images": [json_body(image)["images"][0], _video_part(clip)]}, timeout=60)
        assert r.status_code == 200, r.text
        img, vid = r.json()["items"]
        assert img["modality"] == "image" and "frames_indices" not in img and "timestamps" not in img
        assert vid["modality"] == "video" and vid["cached"] is False and vid["key"].startswith("sha256+")
        assert vid["grid_thw"] == list(plan.grid_thw) == [3, 8, 12] and vid["num_tokens"] == plan.tokens == 72
        assert vid["frames_indices"] == list(plan.indices) == [0, 5, 9, 14, 18, 23] and vid["fps"] == 8.0
        assert vid["timestamps"] == timestamps(list(plan.indices), 8.0, 2) and len(vid["timestamps"]) == 3
        assert vid["shape"] == [72, 48 * 3] and vid["key"] != img["key"]
        stored = read_embeddings(tmp_path / "store", vid["key"])
        assert stored.modality == "video" and stored.grid_thw == (3, 8, 12)
        assert stored.video.frames_indices == tuple(vid["frames_indices"]) and stored.video.fps == 8.0
        # The video alone (under a uuid: encoded again) gives what it gave beside the image.
        alone = httpx.post(url + "/encode", json={"images": [_video_part(clip, "clip-alone")]}, timeout=60)
        assert alone.status_code == 200 and alone.json()["items"][0]["cached"] is False
        again = read_embeddings(tmp_path / "store", "clip-alone")
        assert (torch.cat([again.main, *again.deepstack], 1) - torch.cat([stored.main, *stored.deepstack], 1)).abs().max() <= 1e-5
        # multipart: `video` file parts beside `image` parts, answered in their order; both stored already
        multi = httpx.post(url + "/encode", files=[("video", ("c.mp4", clip, "video/mp4")), ("image", ("i.png", image, "image/png"))],
                           timeout=60)
        assert multi.status_code == 200, multi.text
        mv, mi = multi.json()["items"]
        assert mv == {**vid, "cached": True} and mi == {**img, "cached": True}
        # The same bytes as an image are not the video's key (and not a usable image either).
        as_image = httpx.post(url + "/encode", json=json_body(clip), timeout=60)
        assert as_image.status_code == 422 and as_image.json()["error"]["code"] == "not_an_image"


def test_videos_over_the_request_or_process_byte_budget_are_413_naming_the_limit_and_its_flag(tmp_path, tiny_model):
    """The budgets count each video's resized frames (VideoPlan.nbytes) from its header, before any frame is
    decoded: this clip resizes to 6 frames of 192x128, 442,368 bytes."""
    from service.media.params import VideoParams
    from service.media.video import read_header
    from service.media.video_preprocess import plan_video
    from tests.support import videodata as vd

    clip, other = vd.clip(), vd.clip(frames=25)  # (other bytes, the same sampling and size)
    nbytes = plan_video(read_header(clip, Settings().video_limits), VideoParams()).nbytes
    assert nbytes == 6 * 128 * 192 * 3 == plan_video(read_header(other, Settings().video_limits), VideoParams()).nbytes
    settings = _settings(tmp_path, video_max_request_bytes=nbytes * 3 // 2)
    with live_server(settings, tiny_model) as (url, app):
        r = httpx.post(url + "/encode", json={"images": [_video_part(clip), _video_part(clip)]}, timeout=60)
        assert r.status_code == 200, r.text  # one key twice: decoded once, counted once
        r = httpx.post(url + "/encode", json={"images": [json_body(_png(1))["images"][0], _video_part(clip),
                                                         _video_part(other)]}, timeout=60)
        err = r.json()["error"]
        assert (r.status_code, err["code"], err["index"]) == (413, "video_too_large", 2), r.text
        assert f"{2 * nbytes} bytes once resized; the limit is {nbytes * 3 // 2} a request (--video-max-request-bytes)" in err["message"]
    with live_server(_settings(tmp_path / "b", video_max_process_bytes=nbytes - 1), tiny_model) as (url, app):
        r = httpx.post(url + "/encode", json={"images": [_video_part(clip)]}, timeout=60)
        err = r.json()["error"]
        assert (r.status_code, err["code"], err["index"]) == (413, "video_too_large", 0), r.text
        assert f"is {nbytes} bytes once resized (6 frames of 192x128); the limit is {nbytes - 1}" in err["message"]
        assert "--video-max-process-bytes" in err["message"]


def test_a_rotated_video_is_encoded_upright(tmp_path, tiny_model):
    """A display matrix of 90 degrees (a phone held upright): the grid is the upright clip's, as vLLM's loader
    makes it (tests/unit/lm/test_vllm_connector_video.py), not the stored frames' [3, 8, 12]."""
    from tests.support import videodata as vd

    with live_server(_settings(tmp_path), tiny_model) as (url, app):
        r = httpx.post(url + "/encode", json={"images": [_video_part(vd.clip(rotation=90)), _video_part(vd.clip())]},
                       timeout=60)
        assert r.status_code == 200, r.text
        turned, plain = r.json()["items"]
        assert turned["grid_thw"] == [3, 12, 8] and plain["grid_thw"] == [3, 8, 12]
        assert turned["num_tokens"] == plain["num_tokens"] == 72


def test_a_video_key_covers_the_video_settings():
    from service.store.keys import content_key, video_salt
    from service.media.params import VideoParams

    digest = hashlib.sha256(b"the same file").digest()
    keys = {content_key(b"model|params", digest), content_key(video_salt(b"model|params", VideoParams()), digest),
            content_key(video_salt(b"model|params", VideoParams(fps=3.0)), digest),
            content_key(video_salt(b"model|params", VideoParams(max_pixels=65536)), digest)}
    assert len(keys) == 4  # an image, and the video under three settings: four keys


def test_hostile_videos_get_their_4xx_before_or_while_decoding_and_images_beside_them_succeed(tmp_path, tiny_model):
    from tests.support import videodata as vd

    mkv = vd.clip("mpeg4", "matroska")
    corrupt = bytearray(vd.clip())  # H.264 in MP4: its index intact, 3 kB of its frames overwritten
    at = len(corrupt) // 5
    corrupt[at : at + 3000] = bytes(i * 37 % 256 for i in range(3000))
    cases = {  # name -> (the file, its status, its code)
        "garbage": (b"\x1a\x45\xdf\xa3" + b"\x00\x01" * 1000, 422, "not_a_video"),
        "corrupt frames": (bytes(corrupt), 422, "corrupt_video"),
        "truncated": (mkv[: len(mkv) // 2], 422, "truncated_video"),
        "truncated mp4": (vd.clip()[:-2000], 422, "truncated_video"),
        "audio only": (vd.audio_only(), 422, "not_a_video"),
        "unsupported codec": (vd.clip("ffv1", "matroska"), 415, "unsupported_codec"),
        "two hours by its header": (vd.clip(frames=2, pts_gap_s=7200), 413, "video_too_long"),
        "8K frames": (vd.clip(width=7680, height=4320, frames=2), 413, "video_too_large"),
        "one frame": (vd.clip(frames=1), 422, "corrupt_video"),
        "more tokens than the queue holds": (vd.clip(frames=120), 413, "video_too_large"),
    }
    words = {"audio only": "only audio", "unsupported codec": "'ffv1' is not supported", "two hours by its header":
             "the limit is 1200 s", "8K frames": "7680x4320", "truncated": "ends after", "truncated mp4": "cut short",
             "more tokens than the queue holds": "more than the queue ever holds (200", "one frame": "at least 2",
             "corrupt frames": "cannot be decoded at frame"}
    with live_server(_settings(tmp_path, max_wait_ms=300, max_queue_tokens=200), tiny_model) as (url, app):
        # One hostile request at a time (the queue holds 200 tokens: a clip of 72 and an image of 70), images beside.
        # NOTE: three good images (70 tokens each) and a hostile request's image and clip do not all fit in the
        # 200-token queue at once: a good one may be answered 429 (the overload answer, Retry-After 1) while the
        # others are queued, and is sent again; never anything else.
        def good(i: int) -> int:
            for _ in range(100):
                r = httpx.post(url + "/encode", json=json_body(_png(800 + i)), timeout=60)
                if r.status_code != 429:
                    return r.status_code
                time.sleep(0.1)
            return 429

        with ThreadPoolExecutor(3) as pool:
            goods = [pool.submit(good, i) for i in range(3)]
            for name, (blob, _, _) in cases.items():
                for _ in range(100):  # (the goods may fill the queue: this one too may be answered 429, and is sent again)
                    r = httpx.post(url + "/encode", json={"images": [json_body(_png(900))["images"][0], _video_part(blob)]},
                                   timeout=60)
                    if r.status_code != 429:
                        break
                    time.sleep(0.1)
                err = r.json()["error"]
                assert (r.status_code, err["code"], err.get("index")) == (cases[name][1], cases[name][2], 1), (name, r.text)
                assert err["message"].startswith("images[1]: ") and words.get(name, "") in err["message"], (name, err)
            assert [g.result() for g in goods] == [200] * 3
        # The service keeps serving: the image of those requests, and a good video, now encode.
        r = httpx.post(url + "/encode", json={"images": [json_body(_png(900))["images"][0], _video_part(vd.clip())]},
                       timeout=60)
        assert r.status_code == 200, r.text
        assert [it["modality"] for it in r.json()["items"]] == ["image", "video"]
        assert httpx.get(url + "/health").status_code == 200


def test_priority_and_deadline_ms_are_checked_in_json_and_multipart_bodies(tmp_path, tiny_model):
    blob = _png(1400)
    with live_server(_settings(tmp_path), tiny_model) as (url, app):
        for fields, says in [({"priority": "high"}, "priority"), ({"priority": True}, "priority"),
                             ({"priority": 2**40}, "priority"), ({"priority": 1.5}, "priority"),
                             ({"deadline_ms": -1}, "deadline_ms"), ({"deadline_ms": "soon"}, "deadline_ms")]:
            r = httpx.post(url + "/encode", json={**json_body(blob), **fields}, timeout=30)
            assert r.status_code == 400 and r.json()["error"]["code"] == "bad_request", (fields, r.text)
            assert says in r.json()["error"]["message"], r.text
        files = [("image", ("a.png", blob, "image/png"))]
        for form, says in [({"priority": "x"}, "'priority' must be an integer"),
                           ({"deadline_ms": "-5"}, "deadline_ms"), ({"priority": ["1", "2"]}, "send it once")]:
            r = httpx.post(url + "/encode", files=files, data=form, timeout=30)
            assert r.status_code == 400 and says in r.json()["error"]["message"], (form, r.text)
        r = httpx.post(url + "/encode", json={**json_body(blob), "priority": -3, "deadline_ms": 60_000}, timeout=30)
        assert r.status_code == 200, r.text
        r = httpx.post(url + "/encode", files=files, data={"priority": "7", "deadline_ms": "60000"}, timeout=30)
        assert r.status_code == 200 and r.json()["items"][0]["cached"] is True, r.text


def test_a_spent_deadline_still_answers_a_cached_image_and_504s_an_uncached_one_without_decoding_it(tmp_path, tiny_model):
    cached, fresh = _png(1500), _png(1501)
    with live_server(_settings(tmp_path), tiny_model) as (url, app):
        rt = app.state.rt
        decoded, real_decode = [], rt.decoder.decode

        async def counting_decode(blob, *rest):
            decoded.append(len(blob))
            return await real_decode(blob, *rest)

        rt.decoder.decode = counting_decode
        assert httpx.post(url + "/encode", json=json_body(cached), timeout=30).status_code == 200
        r = httpx.post(url + "/encode", json={**json_body(cached), "deadline_ms": 0}, timeout=30)
        assert r.status_code == 200 and r.json()["items"][0]["cached"] is True, r.text
        for send in (lambda: httpx.post(url + "/encode", json={**json_body(fresh), "deadline_ms": 0}, timeout=30),
                     lambda: httpx.post(url + "/encode", files=[("image", ("f.png", fresh, "image/png"))],
                                        data={"deadline_ms": "0"}, timeout=30)):
            r = send()
            assert r.status_code == 504 and r.json()["error"]["code"] == "deadline_exceeded", r.text
            assert "before its image was decoded" in r.json()["error"]["message"]
        assert len(decoded) == 1 and len(local_host(rt).store) == 1  # only the first image was ever decoded
        m = httpx.get(url + "/metrics").text
        assert metric(m, "qve_deadline_exceeded_total", 'where="claim"') == 2
        assert metric(m, "qve_requests_total", 'status="504"') == 2


def test_the_default_deadline_drops_work_queued_too_long_and_the_rest_of_the_step_succeeds(tmp_path, tiny_model):
    """--default-deadline-ms applies to a request that sends none; one that sends its own is held to that. The
    expired image leaves the queue when the step loop next plans: never encoded, its request 504."""
    # (2 s: a loaded machine's arrival-to-queue time stays far under it, so the image expires in the queue)
    with live_server(_settings(tmp_path, max_batch_images=4, default_deadline_ms=2000), tiny_model) as (url, app):
        rt = app.state.rt
        gate = Gate(local_host(rt).engine)
        with ThreadPoolExecutor(4) as pool:
            held = pool.submit(httpx.post, url + "/encode", json={**json_body(_png(1600)), "deadline_ms": 60_000},
                               timeout=60)
            assert gate.entered.wait(10)  # the step loop holds image 1600
            expiring = pool.submit(httpx.post, url + "/encode", json=json_body(_png(1601)), timeout=60)
            patient = pool.submit(httpx.post, url + "/encode", json={**json_body(_png(1602)), "deadline_ms": 60_000},
                                  timeout=60)
            _wait_for(lambda: local_host(rt).batcher.queue_depth() == 2)
            time.sleep(2.1)  # past the default 2 s of 1601
            gate.release.set()
            assert held.result().status_code == 200 and patient.result().status_code == 200
            r = expiring.result()
            assert r.status_code == 504 and "before its step started" in r.json()["error"]["message"], r.text
        _wait_for(lambda: local_host(rt).batcher.in_flight() == 0)
        assert len(local_host(rt).store) == 2  # 1601 never ran
        m = httpx.get(url + "/metrics").text
        assert metric(m, "qve_deadline_exceeded_total", 'where="queue"') == 1 and metric(m, "qve_expired") == 1
        assert metric(m, "qve_encoded_images_total") == 2  # 1600's and 1602's


def test_a_full_queue_sheds_queued_bulk_images_for_an_urgent_one_and_reports_what_waits(tmp_path, tiny_model):
    with live_server(_settings(tmp_path, max_queue_images=2, max_batch_images=1), tiny_model) as (url, app):
        rt = app.state.rt
        gate = Gate(local_host(rt).engine)
        with ThreadPoolExecutor(4) as pool:
            held = pool.submit(httpx.post, url + "/encode", json=json_body(_png(1700)), timeout=60)
            assert gate.entered.wait(10)
            bulk = [pool.submit(httpx.post, url + "/encode", json={**json_body(_png(1701 + i)), "priority": 5},
                                timeout=60) for i in range(2)]
            _wait_for(lambda: local_host(rt).batcher.queue_depth() == 2)
            m = httpx.get(url + "/metrics").text
            assert metric(m, "qve_waiting_images", 'priority="5"') == 2 and metric(m, "qve_waiting_tokens", 'priority="5"') > 0
            assert metric(m, "qve_oldest_wait_seconds") > 0
            same = httpx.post(url + "/encode", json={**json_body(_png(1800)), "priority": 5}, timeout=60)
            assert same.status_code == 429 and "queue is full" in same.json()["error"]["message"]
            urgent = pool.submit(httpx.post, url + "/encode", json=json_body(_png(1900)), timeout=60)
            _wait_for(lambda: sum(f.done() for f in bulk) == 1)
            shed = next(f.result() for f in bulk if f.done())
            assert shed.status_code == 429 and "shed" in shed.json()["error"]["message"], shed.text
            gate.release.set()
            assert held.result().status_code == 200 and urgent.result().status_code == 200
            assert sorted(f.result().status_code for f in bulk) == [200, 429]
        m = httpx.get(url + "/metrics").text
        assert metric(m, "qve_shed") == 1 and metric(m, "qve_waiting_images", 'priority="0"') == 0
