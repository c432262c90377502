"""The encode orchestration without HTTP (service/api/encode.py): a single-process Runtime with the tiny
CPU model, parsed inputs in, answers out. Cache hits, coalescing, a client that goes away, and a
decode failure that fails its request as a whole."""

import asyncio
import functools
import os
import time
from types import SimpleNamespace

import numpy as np
import pytest

from service.api import encode as frontend
from service.config import PreprocessParams, Settings
from service.errors import CorruptImage, NotAnImage, Overloaded, TruncatedImage, http_status
from service.api.encode import Input, Runtime
from service.engine.loader import load_model
from tests import imagedata as data
from tests.live import Gate, metric


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
        rt = await asyncio.to_thread(Runtime, _settings(tmp_path, **kw), model)
        try:
            rt.start()
            await _until(lambda: rt.ready.is_set() or rt.warmup_failed, timeout=60)
            assert rt.ready.is_set(), "warm-up failed"
            return await test(rt)
        finally:
            await rt.shutdown()

    asyncio.run(main())


def _counter(rt, name: str, labels: str = "") -> float:
    return metric(rt.metrics.exposition().decode(), name, labels)


def test_a_second_request_for_the_same_image_is_answered_from_the_store(tmp_path, tiny_model):
    blob = _png(1)

    async def test(rt):
        first, named = await frontend.encode(rt, [Input(blob, None), Input(blob, "named")], _here)
        assert first.cached is False and named.cached is False and named.stored.key == "named"
        assert first.stored.key.startswith("sha256+") and first.stored.num_tokens > 0
        assert rt.store.lookup(first.stored.key) is not None
        (again,) = await frontend.encode(rt, [Input(blob, None)], _here)
        assert again.cached is True and again.stored.key == first.stored.key
        assert again.stored.path == first.stored.path == f"{first.stored.key}/encoder_cache.safetensors"
        assert _counter(rt, "qve_cache_hits_total") == 1
        assert _counter(rt, "qve_images_total", 'outcome="cached"') == 1
        assert _counter(rt, "qve_images_total", 'outcome="encoded"') == 2

    _with_runtime(tmp_path, tiny_model, test)


def test_two_concurrent_identical_images_are_decoded_and_encoded_once(tmp_path, tiny_model):
    async def test(rt):
        gate = Gate(rt.engine)
        decoded, real_decode = [], rt.decode

        async def counting_decode(blob, header):
            decoded.append(blob)
            return await real_decode(blob, header)

        rt.decode = counting_decode
        try:
            held = asyncio.create_task(frontend.encode(rt, [Input(_png(10), None)], _here))
            await _until(gate.entered.is_set)  # image 10 is in the step loop, held
            a = asyncio.create_task(frontend.encode(rt, [Input(_png(11), None)], _here))
            await _until(lambda: rt.batcher.queue_depth() == 1)
            b = asyncio.create_task(frontend.encode(rt, [Input(_png(11), None)], _here))
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
        gate = Gate(rt.engine)
        gone = asyncio.Event()

        async def client_gone() -> bool:
            return gone.is_set()

        try:
            held = asyncio.create_task(frontend.encode(rt, [Input(_png(20), None)], _here))
            await _until(gate.entered.is_set)
            leaving = asyncio.create_task(frontend.encode(rt, [Input(_png(21), None)], client_gone))
            await _until(lambda: rt.batcher.queue_depth() == 1)
            gone.set()
            assert await leaving is None
            assert rt.batcher.stats.dropped == 1 and rt.batcher.queue_depth() == 0
        finally:
            gate.release.set()
        (kept,) = await held
        assert kept.cached is False
        await _until(lambda: rt.batcher.in_flight() == 0)
        assert len(rt.store) == 1  # the abandoned image was never encoded

    _with_runtime(tmp_path, tiny_model, test, max_batch_images=1)


def test_an_image_that_fails_to_decode_fails_its_request_with_its_4xx(tmp_path, tiny_model):
    good, broken = _png(30), b"\x89PNG\r\n\x1a\n broken"

    async def test(rt):
        with pytest.raises(TruncatedImage) as e:
            await frontend.encode(rt, [Input(good, None), Input(broken, None)], _here)
        assert e.value.index == 1 and e.value.message.startswith("images[1]: ") and http_status(e.value) == 422
        # The request failed as a whole: its places are given back and nothing of it is queued or stored.
        assert rt.batcher.reserved() == 0 and rt.batcher.queue_depth() == 0
        await _until(lambda: rt.batcher.in_flight() == 0)
        assert len(rt.store) == 0
        # Fetched content is never echoed: the error names the URL instead.
        with pytest.raises(NotAnImage) as e:
            await frontend.encode(rt, [Input(b"SECRET not an image", None, source="http://images.example/a.png")], _here)
        assert e.value.index == 0 and "SECRET" not in e.value.message
        assert e.value.message == ("images[0]: the content fetched from http://images.example/a.png is not a usable "
                                   "image (not_an_image); check the URL")
        (ok,) = await frontend.encode(rt, [Input(good, None)], _here)
        assert ok.cached is False

    _with_runtime(tmp_path, tiny_model, test)


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm")
def test_an_api_process_decodes_into_its_arena_cell_and_gives_the_cell_back_if_the_decode_fails():
    from service.media.images import prepare_image, read_header
    from service.metrics import Metrics
    from service.procs.arena import Arena, segment_name

    settings = Settings()
    rt = SimpleNamespace(arena=Arena(segment_name(os.getpid(), 0, 98), 1 << 20), params=PreprocessParams(),
                         settings=settings, metrics=Metrics())
    rt.free_cell = functools.partial(frontend.RemoteRuntime.free_cell, rt)
    limits = settings.image_limits
    try:
        good = data.encode(data.textured_rgb(448, 448, seed=1), "JPEG", quality=90)  # decoded in place
        prep, off = frontend._prepare_into_arena(rt, good, read_header(good, limits))
        assert np.shares_memory(prep.pixels, rt.arena.buf) and rt.arena.used >= prep.pixels.nbytes == 448 * 448 * 3
        expected = prepare_image(good, rt.params, limits).pixels
        assert np.array_equal(rt.arena.view(off, prep.pixels.nbytes), expected.reshape(-1))
        rt.free_cell(off, prep.pixels.nbytes)
        # a readable header over broken data: the cell it took while simplejpeg tried is given back
        broken = bytearray(good)
        dht = broken.index(b"\xff\xc4")
        broken[dht + 5 : dht + 13] = bytes(b ^ 0xFF for b in broken[dht + 5 : dht + 13])
        header = read_header(bytes(broken), limits)
        assert header.plain_jpeg  # so its cell is taken before simplejpeg (and then PIL) refuse it
        with pytest.raises(CorruptImage):
            frontend._prepare_into_arena(rt, bytes(broken), header)
        assert rt.arena.used == 0
        # no cell for it (1.2 MB in a 1 MB arena): 429, and nothing taken
        big = data.encode(data.textured_rgb(640, 640, seed=2), "PNG")
        with pytest.raises(Overloaded, match="too many images"):
            frontend._prepare_into_arena(rt, big, read_header(big, limits))
        assert rt.arena.used == 0
    finally:
        rt.arena.close()
