"""SGLang's encoder endpoints (service/api/sglang/serve.py) in process, under a real uvicorn on loopback, with
the language side played by plain ZMQ PULL sockets: the message each part is answered with (its frames read
back with an unpickler that knows only SGLang's three names), where it may go, and how a part fails. SGLang's
own receivers against the service: tests/system/test_sglang.py."""

import asyncio
import hashlib
import io
import pickle
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import zmq

from service.config import Settings
from service.engine.loader import load_model
from service.store.format import read_ec_cache, read_embeddings
from service.store.keys import content_key
from tests.support import imagedata as data
from tests.support import videodata as vd
from tests.support.live import Gate, data_url, live_server, local_host, metric, refused_port


class EmbeddingData:  # what SGLang's receiver unpickles frame 0 into (its names are all this test allows)
    pass


class Modality:
    def __init__(self, value):
        self.name = {1: "IMAGE", 2: "VIDEO", 3: "AUDIO"}[value]


class _Unpickler(pickle.Unpickler):
    ALLOWED = {("sglang.srt.disaggregation.encoder.receiver", "EmbeddingData"): EmbeddingData,
               ("sglang.srt.managers.schedule_batch", "Modality"): Modality}

    def find_class(self, module, name):
        if module == "torch" and name in ("float32", "bfloat16"):
            return f"torch.{name}"
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"{module}.{name} is not one of SGLang's allowed globals")
        return self.ALLOWED[(module, name)]


def _frames(sock: zmq.Socket, timeout_s: float = 30) -> tuple[dict, list[bytes]]:
    assert sock.poll(int(timeout_s * 1000)), "no message arrived"
    frames = sock.recv_multipart()
    return vars(_Unpickler(io.BytesIO(frames[0])).load()), frames


@pytest.fixture(scope="module")
def tiny_model():
    return load_model(Settings(model="tiny", device="cpu"))


@pytest.fixture
def zctx():
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


def _pull(ctx) -> tuple[zmq.Socket, int]:
    sock = ctx.socket(zmq.PULL)
    return sock, sock.bind_to_random_port("tcp://127.0.0.1")


def _settings(tmp_path, **kw):
    base = dict(model="tiny", device="cpu", store=tmp_path / "store", max_pixels=256 * 256, decode_workers=1,
                max_wait_ms=20, sglang_version="0.5.23")
    base.update(kw)
    return Settings(**base)


def _part(url: str, items: list, port: int | None, req_id: str = "rid1_local_part_0", **kw) -> dict:
    """A part as SGLang 0.5.23's MMReceiverHTTP.encode posts it."""
    body = {"encoder_idx": 0, "encoder_url": url + "/sglang", "mm_items": items, "num_parts": 1, "part_idx": 0,
            "req_id": req_id, "modality": "IMAGE", "prefill_host": "127.0.0.1", "embedding_port": port,
            "time_stats_json": None}
    body.update(kw)
    return body


def _jpeg(name: str, side: int) -> str:
    return data_url(data.photo(name, side), "image/jpeg")


def test_a_part_is_pushed_as_sglangs_message_with_the_stored_rows_then_answered_null(tmp_path, tiny_model, zctx):
    sock, port = _pull(zctx)
    rocket, coffee = data.photo("rocket.jpg", 200), data.valid_images()["coffee.png"]
    with live_server(_settings(tmp_path), tiny_model) as (url, app):
        r = httpx.post(url + "/sglang/encode", json=_part(url, [data_url(rocket, "image/jpeg"),
                                                                {"url": data_url(coffee), "detail": "auto"}], port,
                                                          num_parts=2, part_idx=1), timeout=60)
        assert r.status_code == 200 and r.json() is None
        state, frames = _frames(sock)
        keys = [content_key(app.state.rt.key_salt, hashlib.sha256(b).digest()) for b in (rocket, coffee)]
        stored = [read_ec_cache(tmp_path / "store", k) for k in keys]
        grids = [list(read_embeddings(tmp_path / "store", k).grid_thw) for k in keys]
    assert len(frames) == 2
    assert state["req_id"] == "rid1_local_part_0" and (state["num_parts"], state["part_idx"]) == (2, 1)
    assert state["modality"].name == "IMAGE" and state["dtype"] == "torch.float32"
    assert state["grid_dim"] == grids
    rows = sum(t.shape[0] for t in stored)
    assert state["shape"] == [rows, 144] and state["error_msg"] is None and state["video_timestamps"] is None
    # frame 1: the items' rows in order, as the store holds them (the store is exact against transformers:
    # tests/unit/engine; SGLang's receiver against transformers: tests/system/test_sglang.py)
    assert frames[1] == b"".join(t.numpy().tobytes() for t in stored)


def test_a_hit_is_pushed_from_the_store_without_encoding(tmp_path, tiny_model, zctx):
    sock, port = _pull(zctx)
    item = _jpeg("rocket.jpg", 160)
    with live_server(_settings(tmp_path), tiny_model) as (url, _):
        for req in ("a_local_part_0", "b_local_part_0"):
            assert httpx.post(url + "/sglang/encode", json=_part(url, [item], port, req), timeout=60).status_code == 200
        first, second = _frames(sock), _frames(sock)
        m = httpx.get(url + "/metrics").text
    assert first[1][1] == second[1][1] and second[0]["req_id"] == "b_local_part_0"
    assert metric(m, "qve_images_total", 'outcome="encoded"') == 1
    assert metric(m, "qve_images_total", 'outcome="cached"') == 1


def test_a_video_part_carries_its_grid_and_timestamps(tmp_path, tiny_model, zctx):
    sock, port = _pull(zctx)
    clip = vd.clip(frames=16, fps=8)
    with live_server(_settings(tmp_path), tiny_model) as (url, _):
        r = httpx.post(url + "/sglang/encode", json=_part(url, [data_url(clip, "video/mp4")], port, modality="VIDEO"),
                       timeout=120)
        assert r.status_code == 200, r.text
        state, frames = _frames(sock)
        answer = httpx.post(url + "/encode", json={"images": [{"type": "video_url", "video_url": {
            "url": data_url(clip, "video/mp4")}}]}, timeout=120).json()["items"][0]
    assert state["modality"].name == "VIDEO"
    assert state["grid_dim"] == [answer["grid_thw"]] and state["shape"] == answer["shape"]
    assert state["video_timestamps"] == [answer["timestamps"]] and len(answer["timestamps"]) == answer["grid_thw"][0]
    assert len(frames[1]) == answer["shape"][0] * answer["shape"][1] * 4


def test_a_push_to_a_host_outside_the_allow_list_is_403_and_nothing_is_sent(tmp_path, tiny_model, zctx):
    sock, port = _pull(zctx)
    with live_server(_settings(tmp_path), tiny_model) as (url, _):
        for host in ("10.0.0.7", "169.254.169.254", "example.com"):
            r = httpx.post(url + "/sglang/encode", json=_part(url, [_jpeg("rocket.jpg", 96)], port, prefill_host=host),
                           timeout=60)
            assert r.status_code == 403, r.text
            assert r.json()["status"] == "error" and "--sglang-allowed-hosts" in r.json()["message"]
        r = httpx.post(url + "/sglang/scheduler_receive_url", json={"req_id": "x_local_part_0", "receive_count": 1,
                                                                    "receive_url": "10.0.0.7:5000"}, timeout=10)
        assert r.status_code == 403
        m = httpx.get(url + "/metrics").text
    assert not sock.poll(300)  # nothing reached any socket
    assert metric(m, "qve_images_total", 'outcome="encoded"') == 0  # and nothing was encoded


def test_a_caller_outside_the_allow_list_is_403(tmp_path, tiny_model, zctx):
    sock, port = _pull(zctx)
    with live_server(_settings(tmp_path, sglang_allowed_hosts=["10.0.0.0/8"]), tiny_model) as (url, _):
        r = httpx.post(url + "/sglang/encode", json=_part(url, [_jpeg("rocket.jpg", 96)], port, prefill_host="10.0.0.2"),
                       timeout=60)
    assert r.status_code == 403 and "the caller '127.0.0.1'" in r.json()["message"]
    assert not sock.poll(100)


@pytest.mark.parametrize("items, status, says", [
    (["data:image/png;base64,AAAA"], 422, "mm_items[0]: the data is not an image"),
    (["/etc/passwd"], 400, "this encoder reads no files of its host"),
    (["file:///tmp/cat.jpg"], 400, "this encoder reads no files of its host"),
    ([{"url": "x", "max_dynamic_patch": 12}], 422, "'max_dynamic_patch': per-item preprocessing"),
    ([{"url": "data:image/png;base64,AAAA", "content_hash": "sha256:" + "0" * 64}], 400, "is not the SHA-256"),
    (["http://example.com/a.jpg"], 422, "not allowed"),
])
def test_a_bad_item_is_an_error_message_pushed_and_its_status_answered(tmp_path, tiny_model, zctx, items, status, says):
    sock, port = _pull(zctx)
    with live_server(_settings(tmp_path), tiny_model) as (url, _):
        r = httpx.post(url + "/sglang/encode", json=_part(url, items, port), timeout=60)
        state, frames = _frames(sock)
        ok = httpx.post(url + "/sglang/encode", json=_part(url, [_jpeg("rocket.jpg", 96)], port, "ok_local_part_0"),
                        timeout=60)  # the service goes on serving
        assert ok.status_code == 200 and _frames(sock)[0]["error_msg"] is None
    assert r.status_code == status and says in r.json()["message"], r.text
    assert r.json()["req_id"] == "rid1_local_part_0"
    assert len(frames) == 1  # SGLang's error message: frame 0 alone
    assert state["error_msg"] == r.json()["message"] and state["error_code"] == status
    assert state["req_id"] == "rid1_local_part_0" and state["shape"] is None


@pytest.mark.parametrize("change, says", [
    ({"mm_items": []}, "mm_items"), ({"part_idx": 3, "num_parts": 2}, "part_idx 3"),
    ({"modality": "AUDIO"}, "takes IMAGE and VIDEO"), ({"embedding_port": 0}, "embedding_port"),
    ({"req_id": ""}, "req_id"),
])
def test_a_malformed_part_is_400_saying_what(tmp_path, tiny_model, zctx, change, says):
    sock, port = _pull(zctx)
    with live_server(_settings(tmp_path), tiny_model) as (url, _):
        r = httpx.post(url + "/sglang/encode", json=_part(url, [_jpeg("rocket.jpg", 96)], port, **change), timeout=60)
    assert r.status_code == 400 and says in r.json()["message"], r.text


def _encode_body(side: int) -> dict:
    return {"images": [{"type": "image_url", "image_url": {"url": _jpeg("rocket.jpg", side)}}]}


def _fill_queue(url, app, pool):
    """With --max-queue-images 1: one /encode request held in the step loop (its gate) and one queued behind it,
    so that the queue is full. (the gate, the two requests' futures)"""
    gate = Gate(local_host(app.state.rt).engine)
    held = pool.submit(httpx.post, url + "/encode", json=_encode_body(90), timeout=60)
    assert gate.entered.wait(10)
    queued = pool.submit(httpx.post, url + "/encode", json=_encode_body(100), timeout=60)
    deadline = time.monotonic() + 10
    while local_host(app.state.rt).batcher.queue_depth() < 1:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    return gate, held, queued


def test_a_full_queue_makes_a_part_wait_for_a_place_not_fail(tmp_path, tiny_model, zctx):
    sock, port = _pull(zctx)
    s = _settings(tmp_path, max_queue_images=1, max_batch_images=1)
    with live_server(s, tiny_model) as (url, app):
        with ThreadPoolExecutor(4) as pool:
            gate, held, queued = _fill_queue(url, app, pool)
            over = httpx.post(url + "/encode", json=_encode_body(110), timeout=60)
            assert over.status_code == 429  # /encode's clients are refused...
            part = pool.submit(httpx.post, url + "/sglang/encode", json=_part(url, [_jpeg("rocket.jpg", 120)], port),
                               timeout=60)
            time.sleep(0.5)
            assert not part.done()  # ...SGLang's part waits for a place
            gate.release.set()
            assert held.result().status_code == 200 and queued.result().status_code == 200
            assert part.result().status_code == 200
        state, frames = _frames(sock)
    assert state["error_msg"] is None and len(frames) == 2


def test_a_part_that_waits_past_the_queue_wait_is_an_error_message(tmp_path, tiny_model, zctx):
    sock, port = _pull(zctx)
    s = _settings(tmp_path, max_queue_images=1, max_batch_images=1, sglang_queue_wait_s=0.3)
    with live_server(s, tiny_model) as (url, app):
        with ThreadPoolExecutor(2) as pool:
            gate, held, queued = _fill_queue(url, app, pool)
            t0 = time.monotonic()
            r = httpx.post(url + "/sglang/encode", json=_part(url, [_jpeg("rocket.jpg", 120)], port), timeout=60)
            waited = time.monotonic() - t0
            gate.release.set()
            held.result(), queued.result()
        state, _ = _frames(sock)
    assert r.status_code == 429 and state["error_code"] == 429 and "queue" in state["error_msg"]
    assert 0.25 < waited < 5


def test_a_language_side_that_is_gone_costs_only_its_own_part(tmp_path, tiny_model, zctx):
    sock, port = _pull(zctx)
    with refused_port() as gone:  # a port nobody takes messages on
        with live_server(_settings(tmp_path, sglang_push_timeout_s=5.0), tiny_model) as (url, _):
            with ThreadPoolExecutor(2) as pool:
                t0 = time.monotonic()
                lost = pool.submit(httpx.post, url + "/sglang/encode",
                                   json=_part(url, [_jpeg("rocket.jpg", 96)], gone, "lost_local_part_0"), timeout=60)
                time.sleep(0.1)
                r = httpx.post(url + "/sglang/encode", json=_part(url, [_jpeg("rocket.jpg", 130)], port), timeout=60)
                other_s = time.monotonic() - t0
                assert r.status_code == 200 and _frames(sock)[0]["error_msg"] is None
                lost_r, lost_s = lost.result(), time.monotonic() - t0
            assert httpx.get(url + "/sglang/health").status_code == 200
    assert other_s < 4.0, "a push to a language side that is gone held another part"
    assert lost_r.status_code == 502 and "did not take the message within 5 s" in lost_r.json()["message"]
    assert 4.9 < lost_s < 15


def test_the_scheduler_path_pushes_a_copy_to_each_registered_rank_whenever_they_register(tmp_path, tiny_model, zctx):
    ranks = [_pull(zctx) for _ in range(2)]
    item = _jpeg("rocket.jpg", 150)

    async def run(url):
        async with httpx.AsyncClient(timeout=60) as c:
            def register(port):
                return c.post(url + "/sglang/scheduler_receive_url", json={
                    "req_id": "s1_local_part_0", "receive_count": 2, "receive_url": f"127.0.0.1:{port}",
                    "modality": "IMAGE"})
            early = await register(ranks[0][1])  # one rank registers before the part arrives...
            encode = asyncio.ensure_future(c.post(url + "/sglang/encode", json=_part(url, [item], None, "s1_local_part_0")))
            await asyncio.sleep(0.5)
            assert not encode.done()  # ...the part waits for the other
            late = await register(ranks[1][1])
            return early, late, await encode

    with live_server(_settings(tmp_path), tiny_model) as (url, _):
        early, late, encoded = asyncio.run(run(url))
        got = [_frames(sock) for sock, _ in ranks]
    assert [early.status_code, late.status_code, encoded.status_code] == [200, 200, 200]
    assert early.json() is None and encoded.json() is None
    assert got[0][1][1] == got[1][1][1] and got[0][0]["req_id"] == got[1][0]["req_id"] == "s1_local_part_0"


def test_a_scheduler_part_whose_ranks_do_not_all_register_fails_in_the_push_timeout(tmp_path, tiny_model, zctx):
    sock, port = _pull(zctx)
    with live_server(_settings(tmp_path, sglang_push_timeout_s=0.5), tiny_model) as (url, _):
        httpx.post(url + "/sglang/scheduler_receive_url", json={"req_id": "s2_local_part_0", "receive_count": 2,
                                                                "receive_url": f"127.0.0.1:{port}"}, timeout=10)
        r = httpx.post(url + "/sglang/encode", json=_part(url, [_jpeg("rocket.jpg", 96)], None, "s2_local_part_0"),
                       timeout=60)
    assert r.status_code == 504 and "1 ranks registered" in r.json()["message"]


def test_a_store_that_fails_is_the_parts_error_message_and_the_next_part_is_served(tmp_path, tiny_model, zctx):
    sock, port = _pull(zctx)
    with live_server(_settings(tmp_path), tiny_model) as (url, app):
        store = local_host(app.state.rt).store
        real_commit = store.commit

        def commit(reservation, ec_cache, answer=None):  # the write fails (after its reservation succeeded)
            store.abort(reservation)
            raise OSError(28, "No space left on device")

        store.commit = commit
        r = httpx.post(url + "/sglang/encode", json=_part(url, [_jpeg("rocket.jpg", 96)], port), timeout=60)
        state, frames = _frames(sock)
        assert r.status_code == 500 and "No space left on device" in r.json()["message"]
        assert len(frames) == 1 and state["error_code"] == 500 and state["error_msg"] == r.json()["message"]

        # An entry evicted between its answer and its read, twice in a row: encoded again once, then a 503.
        store.commit = real_commit
        reads = []

        def gone(answers):
            reads.append(len(answers))
            raise KeyError(answers[0].stored.key)

        app.state.sglang._read_rows = gone
        r = httpx.post(url + "/sglang/encode", json=_part(url, [_jpeg("rocket.jpg", 100)], port, "ev_local_part_0"),
                       timeout=60)
        state, _ = _frames(sock)
        assert r.status_code == 503 and "evicted" in state["error_msg"] and reads == [1, 1]
        del app.state.sglang._read_rows
        assert httpx.post(url + "/sglang/encode", json=_part(url, [_jpeg("rocket.jpg", 104)], port, "ok_local_part_0"),
                          timeout=60).status_code == 200
        assert _frames(sock)[0]["error_msg"] is None


def test_health_and_an_unsupported_version_at_start(tmp_path, tiny_model):
    with live_server(_settings(tmp_path), tiny_model) as (url, _):
        assert httpx.get(url + "/sglang/health").status_code == 200
    with live_server(_settings(tmp_path, sglang_version=None), tiny_model) as (url, _):
        assert httpx.get(url + "/sglang/health").status_code == 404  # not served unless asked for
    with pytest.raises(ValueError, match=r"SGLang 0.5.21 is not supported: .* 0.5.22 and 0.5.23 only"):
        Settings(sglang_version="0.5.21")
