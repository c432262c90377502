"""The encode orchestration without HTTP (service/api/encode.py): a single-process Runtime with the tiny
CPU model, parsed inputs in, answers out. Cache hits, coalescing, a client that goes away, and a
decode failure that fails its request as a whole."""

import asyncio
import hashlib
import time

import pytest

from service.api import encode as encoding
from service.config import Settings
from service.errors import http_status, ImageError
from service.api.encode import Input
from service.engine.loader import load_model
from service.procs.local import local_runtime
from tests.support import imagedata as data
from tests.support.live import Gate, local_host, metric
from tests.support.errors import raises_code


@pytest.fixture(scope="module")
def tiny_model():
    return load_model(Settings(model="tiny", device="cpu"))


def _settings(tmp_path, **kw):
    base = dict(model="tiny", device="cpu", store=tmp_path / "store", max_pixels=256 * 256, decode_workers=1,
                max_wait_ms=20)
    base.update(kw)
    return Settings(**base)


def _png(seed: int) -> bytes:
    return data.encode(data.textured_rgb(96, 64, seed=seed), "PNG")


async def _here() -> bool:
    """A client that never leaves."""
    return False


async def _until(pred, timeout=20.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


def _with_runtime(tmp_path, model, test, **kw):
    """Run `await test(rt)` against a warmed-up single-process Runtime (built, started and shut down as
    the app's lifespan does)."""
    async def main():
        rt = await local_runtime(_settings(tmp_path, **kw), model)
        try:
            await rt.start()
            await _until(lambda: rt.ready or (rt.status is not None and rt.status.failed), timeout=60)
            assert rt.ready, f"warm-up failed: {rt.status}"
            return await test(rt)
        finally:
            await rt.shutdown()

    asyncio.run(main())


def _counter(rt, name: str, labels: str = "") -> float:
    """A counter of the API side's or the engine host's registry (a single process keeps both)."""
    return sum(metric(m.exposition().decode(), name, labels) for m in (rt.metrics, local_host(rt).metrics))


def test_a_second_request_for_the_same_image_is_answered_from_the_store(tmp_path, tiny_model):
    blob = _png(1)

    async def test(rt):
        first, named = await encoding.encode(rt, [Input(blob, None), Input(blob, "named")], _here)
        assert first.cached is False and named.cached is False and named.stored.key == "named"
        assert first.stored.key.startswith("sha256+") and first.stored.num_tokens > 0
        assert local_host(rt).store.lookup(first.stored.key) is not None
        (again,) = await encoding.encode(rt, [Input(blob, None)], _here)
        assert again.cached is True and again.stored.key == first.stored.key
        assert again.stored.path == first.stored.path == f"{first.stored.key}/encoder_cache.safetensors"
        assert _counter(rt, "qve_cache_hits_total") == 1
        assert _counter(rt, "qve_images_total", 'outcome="cached"') == 1
        assert _counter(rt, "qve_images_total", 'outcome="encoded"') == 2

    _with_runtime(tmp_path, tiny_model, test)


def test_two_concurrent_identical_images_are_decoded_and_encoded_once(tmp_path, tiny_model):
    async def test(rt):
        gate = Gate(local_host(rt).engine)
        decoded, real_decode = [], rt.decoder.decode

        async def counting_decode(blob, *rest):
            decoded.append(blob)
            return await real_decode(blob, *rest)

        rt.decoder.decode = counting_decode
        try:
            held = asyncio.create_task(encoding.encode(rt, [Input(_png(10), None)], _here))
            await _until(gate.entered.is_set)  # image 10 is in the step loop, held
            a = asyncio.create_task(encoding.encode(rt, [Input(_png(11), None)], _here))
            await _until(lambda: local_host(rt).batcher.queue_depth() == 1)
            b = asyncio.create_task(encoding.encode(rt, [Input(_png(11), None)], _here))
            await _until(lambda: _counter(rt, "qve_coalesced_total") == 1)  # b joined a's queued encode
        finally:
            gate.release.set()
        (one,), (other,), _ = await asyncio.gather(a, b, held)
        assert one == other and one.cached is False
        assert decoded.count(_png(11)) == 1
        assert _counter(rt, "qve_images_total", 'outcome="coalesced"') == 1
        assert _counter(rt, "qve_images_total", 'outcome="encoded"') == 2  # 10 and 11

    _with_runtime(tmp_path, tiny_model, test, max_batch_images=1)


def test_a_client_that_goes_away_gets_its_queued_work_cancelled(tmp_path, tiny_model):
    async def test(rt):
        gate = Gate(local_host(rt).engine)
        gone = asyncio.Event()

        async def client_gone() -> bool:
            return gone.is_set()

        try:
            held = asyncio.create_task(encoding.encode(rt, [Input(_png(20), None)], _here))
            await _until(gate.entered.is_set)
            leaving = asyncio.create_task(encoding.encode(rt, [Input(_png(21), None)], client_gone))
            await _until(lambda: local_host(rt).batcher.queue_depth() == 1)
            gone.set()
            assert await leaving is None
            assert local_host(rt).batcher.stats.dropped == 1 and local_host(rt).batcher.queue_depth() == 0
        finally:
            gate.release.set()
        (kept,) = await held
        assert kept.cached is False
        await _until(lambda: local_host(rt).batcher.in_flight() == 0)
        assert len(local_host(rt).store) == 1  # the abandoned image was never encoded

    _with_runtime(tmp_path, tiny_model, test, max_batch_images=1)


def test_an_image_that_fails_to_decode_fails_its_request_with_its_4xx(tmp_path, tiny_model):
    good, broken = _png(30), b"\x89PNG\r\n\x1a\n broken"

    async def test(rt):
        with raises_code(ImageError, "truncated_image") as e:
            await encoding.encode(rt, [Input(good, None), Input(broken, None)], _here)
        assert e.value.index == 1 and e.value.message.startswith("images[1]: ") and http_status(e.value) == 422
        # The request failed as a whole: its places are given back and nothing of it stays queued. (Each
        # image is submitted as soon as it is decoded: the good one may have been encoded and stored by
        # then, a valid cache entry; it is not answered.)
        assert local_host(rt).batcher.reserved() == 0 and local_host(rt).batcher.queue_depth() == 0
        await _until(lambda: local_host(rt).batcher.in_flight() == 0)
        kept = len(local_host(rt).store)
        assert kept <= 1
        # Fetched content is never echoed: the error names the URL instead.
        with raises_code(ImageError, "not_an_image") as e:
            await encoding.encode(rt, [Input(b"SECRET not an image", None, source="http://images.example/a.png")], _here)
        assert e.value.index == 0 and "SECRET" not in e.value.message
        assert e.value.message == ("images[0]: the content fetched from http://images.example/a.png is not a usable "
                                   "image (not_an_image); check the URL")
        (ok,) = await encoding.encode(rt, [Input(good, None)], _here)
        assert ok.stored.num_tokens > 0 and ok.cached is (kept == 1)  # a hit exactly when it was kept

    _with_runtime(tmp_path, tiny_model, test)


def _held_decodes(rt, held: set[bytes]):
    """rt.decoder.decode, with the images in `held` waiting for the returned event before they decode; and the
    list of what rt.decoder.release was given (pixels nobody submitted)."""
    go, released = asyncio.Event(), []
    real_decode, real_release = rt.decoder.decode, rt.decoder.release

    async def decode(blob, *rest):
        if blob in held:
            await go.wait()
        return await real_decode(blob, *rest)

    def release(decoded):
        released.append(decoded)
        real_release(decoded)

    rt.decoder.decode, rt.decoder.release = decode, release
    return go, released


def test_a_client_that_leaves_while_its_image_decodes_gives_its_queue_place_back_at_once(tmp_path, tiny_model):
    """Issue 23: the clients of 4 scan bombs left after 5 s, and their queue places (the whole
    --max-queue-tokens) stayed held until the decodes ended: every other request got 429 meanwhile. A
    request now stops waiting for its decodes when its client leaves; a decode that ends later gives its
    pixels back and submits nothing."""
    slow = _png(40)

    async def test(rt):
        go, released = _held_decodes(rt, {slow})
        gone = asyncio.Event()

        async def client_gone() -> bool:
            return gone.is_set()

        leaving = asyncio.create_task(encoding.encode(rt, [Input(slow, None)], client_gone))
        await _until(lambda: local_host(rt).batcher.reserved() == 1)  # granted, decoding (held)
        gone.set()
        assert await asyncio.wait_for(leaving, 10) is None  # before its decode ended
        assert local_host(rt).batcher.reserved() == 0
        go.set()  # the decode ends now: its pixels go back, nothing is queued
        await _until(lambda: len(released) == 1)
        assert local_host(rt).batcher.queue_depth() == 0 and local_host(rt).batcher.in_flight() == 0
        (again,) = await encoding.encode(rt, [Input(slow, None)], _here)  # the image itself is fine
        assert again.cached is False and len(local_host(rt).store) == 1

    _with_runtime(tmp_path, tiny_model, test)


def test_a_request_is_answered_at_its_first_failed_image_not_after_its_slowest_decode(tmp_path, tiny_model):
    slow, broken = _png(41), b"\x89PNG\r\n\x1a\n broken"

    async def test(rt):
        go, released = _held_decodes(rt, {slow})
        failing = asyncio.create_task(encoding.encode(rt, [Input(slow, None), Input(broken, None)], _here))
        with raises_code(ImageError, "truncated_image") as e:
            await asyncio.wait_for(failing, 10)  # while images[0] still decodes
        assert e.value.index == 1
        assert local_host(rt).batcher.reserved() == 0  # images[0]'s place too
        go.set()
        await _until(lambda: len(released) == 1)
        assert local_host(rt).batcher.queue_depth() == 0 and len(local_host(rt).store) == 0

    _with_runtime(tmp_path, tiny_model, test)


def test_small_images_are_keyed_on_the_event_loop_large_ones_in_one_thread_hop(tmp_path, tiny_model, monkeypatch):
    # A lone small image's keys cost a thread hop more than its hash (INLINE_KEY_BYTES); a large request's
    # hashing must stay off the event loop.
    small = [Input(data.photo("astronaut.png", max_side=96), None), Input(_png(2), "two")]
    large = [Input(data.photo("astronaut.png"), None)]  # a 512x512 PNG photograph
    assert sum(len(i.data) for i in small) <= encoding.INLINE_KEY_BYTES < len(large[0].data)
    hops, real = [], asyncio.to_thread

    async def counting(fn, *args, **kwargs):
        hops.append(fn)
        return await real(fn, *args, **kwargs)

    async def test(rt):
        monkeypatch.setattr(encoding.asyncio, "to_thread", counting)
        keyed = await encoding._keys_for(rt, small)
        assert hops == []
        assert keyed[0].key == encoding.content_key(rt.key_salt, hashlib.sha256(small[0].data).digest())
        assert keyed[1].key == "two" and keyed[0].tokens > 0
        (big,) = await encoding._keys_for(rt, large)
        assert len(hops) == 1
        assert big.sha256 == hashlib.sha256(large[0].data).hexdigest() and big.tokens > keyed[0].tokens

    _with_runtime(tmp_path, tiny_model, test)
