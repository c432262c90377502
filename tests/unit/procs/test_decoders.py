"""The two decoders (service/procs/decoders.py): an API process's decode threads write each image once,
straight into a cell of its arena, and give the cell back when the decode fails; a full arena is a 429
before anything is taken."""

import asyncio
import logging
import os
import signal
import time

import numpy as np
import pytest
from PIL import Image

from service.media.params import ImageLimits, PreprocessParams, VideoLimits
from service.config import Settings, usable_cores
from service.errors import DeadlineExceeded, http_status, ImageError, Overloaded, Unavailable, VideoError
from service.priority import Urgency
from service.media.images import prepare_image, read_header
from service.metrics import Metrics
from service.procs import decoders
from service.procs.arena import Arena, segment_name
from service.procs.decoders import ArenaDecoder
from tests.support import imagedata as data
from tests.support.errors import raises_code


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm")
def test_an_api_process_decodes_into_its_arena_cell_and_gives_the_cell_back_if_the_decode_fails():
    limits, params = Settings().image_limits, PreprocessParams()
    decoder = ArenaDecoder(Arena(segment_name(os.getpid(), 0, 98), 1 << 20), 1, limits, Metrics())
    arena = decoder.arena

    def decode(blob: bytes, header=None):
        return asyncio.run(decoder.decode(blob, header or read_header(blob, limits), params))

    try:
        good = data.encode(data.textured_rgb(448, 448, seed=1), "JPEG", quality=90)  # decoded in place
        decoded = decode(good)
        cell = decoded.pixels
        assert cell.segment == arena.name and cell.nbytes == 448 * 448 * 3 and arena.used >= cell.nbytes
        assert (decoded.geometry.height, decoded.geometry.width, decoded.geometry.grid_thw) == (448, 448, (1, 28, 28))
        expected = prepare_image(good, params, limits).pixels
        assert np.array_equal(arena.view(cell.offset, cell.nbytes), expected.reshape(-1))
        decoder.release(decoded)
        assert arena.used == 0
        # a readable header over broken data: the cell it took while simplejpeg tried is given back
        broken = bytearray(good)
        dht = broken.index(b"\xff\xc4")
        broken[dht + 5 : dht + 13] = bytes(b ^ 0xFF for b in broken[dht + 5 : dht + 13])
        header = read_header(bytes(broken), limits)
        assert header.plain_jpeg  # so its cell is taken before simplejpeg (and then PIL) refuse it
        with raises_code(ImageError, "corrupt_image"):
            decode(bytes(broken), header)
        assert arena.used == 0
        # no cell for it (1.2 MB in a 1 MB arena): 429, and nothing taken
        big = data.encode(data.textured_rgb(640, 640, seed=2), "PNG")
        with pytest.raises(Overloaded, match="too many images"):
            decode(big)
        assert arena.used == 0
    finally:
        asyncio.run(decoder.shutdown())


def test_a_new_decode_pool_is_on_the_stall_clock_only_once_a_worker_of_it_answered():
    """Issue 20: on a loaded machine a replacement pool was judged stuck before its first worker had
    started (the forkserver took seconds), so the retry that should succeed got a second 503."""
    import concurrent.futures

    clock = [1000.0]
    decoder = decoders.PoolDecoder(1, Settings().image_limits, stall_s=1.5, clock=lambda: clock[0])
    try:
        pool, created, started = decoder._started
        started.result(timeout=60)  # (a real worker answered; the clock above did not move meanwhile)
        unstarted = concurrent.futures.Future()
        decoder._started, decoder._up_at = (pool, created, unstarted), None  # as if its worker had not answered
        clock[0] += 60  # a minute with no decode finished, but the pool has not started: not stuck
        assert not decoder._stalled(pool, waiting_since=created)
        clock[0] += decoders.POOL_START_LIMIT_S  # one that never starts is stuck in the end
        assert decoder._stalled(pool, waiting_since=created)
        decoder._up_at = clock[0]  # now up: the stall clock runs from here
        assert not decoder._stalled(pool, waiting_since=created)
        clock[0] += 1.0
        assert not decoder._stalled(pool, waiting_since=created)
        clock[0] += 1.0  # 2 s since it came up, none finished
        assert decoder._stalled(pool, waiting_since=created)
        assert decoder._stalled(object(), waiting_since=created - 10)  # a pool it did not start: clock at once
    finally:
        asyncio.run(decoder.shutdown())


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm")
def test_an_api_process_decodes_a_video_into_one_cell_and_one_bigger_than_its_arena_is_a_413():
    from service.errors import ImageError, Overloaded, Unavailable, VideoError
    from service.media.params import VideoParams
    from service.media.video import read_header as video_header
    from service.media.video_preprocess import prepare_video
    from tests.support import videodata as vd

    settings = Settings()
    vlimits, vparams = settings.video_limits, VideoParams()
    decoder = ArenaDecoder(Arena(segment_name(os.getpid(), 0, 97), 1 << 20), 1, settings.image_limits, Metrics(),
                           video_limits=vlimits)
    arena = decoder.arena

    def decode(blob: bytes, params=vparams):
        return asyncio.run(decoder.decode_video(blob, video_header(blob, vlimits), params))

    try:
        clip = vd.clip()
        decoded = decode(clip)
        g, cell = decoded.geometry, decoded.pixels
        assert (g.grid_thw, g.height, g.width, g.tokens, g.video.frames) == ((3, 8, 12), 128, 192, 72, 6)
        assert g.video.indices == (0, 5, 9, 14, 18, 23) and g.video.fps == 8.0 and len(g.video.timestamps) == 3
        assert cell.nbytes == 6 * 128 * 192 * 3
        expected = prepare_video(clip, video_header(clip, vlimits), vparams, vlimits).frames
        assert np.array_equal(arena.view(cell.offset, cell.nbytes), expected.reshape(-1))
        decoder.release(decoded)
        assert arena.used == 0
        mkv = vd.clip("mpeg4", "matroska")
        with raises_code(VideoError, "truncated_video"):  # failed after it took its cell: the cell is given back
            decode(mkv[: len(mkv) // 2])
        assert arena.used == 0
        with raises_code(VideoError, "video_too_large", match="more than this process's pixel arena holds"):
            decode(clip, VideoParams(min_pixels=6 * 512 * 512, max_pixels=6 * 1024 * 1024))
        assert arena.used == 0
    finally:
        asyncio.run(decoder.shutdown())


# Run in decode processes (module functions: a pool pickles them by name).
def _spin(seconds: float) -> int:
    """Python that burns CPU for `seconds` (a decoder that does not stop at the deadline)."""
    end, n = time.monotonic() + seconds, 0
    while time.monotonic() < end:
        n += 1
    return n


def _nap(seconds: float) -> str:
    """An image's decode that takes `seconds` of wall time and no CPU (no budget of its own runs out)."""
    time.sleep(seconds)
    return "decoded"


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)  # (what the OOM killer does)


def test_a_decode_past_its_cpu_budget_ends_with_its_process_and_the_images_beside_it_are_decoded_again(caplog):
    """Issue 23: a decode that cannot be stopped inside (here Python that ignores the deadline) is ended by the
    kernel once its process has spent its CPU budget: that image is a 422, and the image decoding beside it
    on the same pool (a pool breaks whole) is decoded again on the new pool, not answered 503. A worker that
    dies otherwise (SIGKILL) is still a 503 for its image."""
    caplog.set_level(logging.INFO, logger=decoders.__name__)
    decoder = decoders.PoolDecoder(2, ImageLimits(decode_timeout_s=0.1), kill_grace_s=0.2)

    async def main():
        await asyncio.to_thread(decoder._started[2].result, 90)  # both start on a pool that is up
        first_pool = decoder.pool
        bomb = asyncio.create_task(decoder._in_pool(_spin, 120.0, cpu_s=0.3))
        victim = asyncio.create_task(decoder._in_pool(_nap, 3.0, cpu_s=0.3))  # in flight when the bomb ends
        with raises_code(ImageError, "image_too_complex") as e:
            await asyncio.wait_for(bomb, 90)
        assert "over 0.3 s of CPU" in e.value.message and http_status(e.value) == 422
        assert await asyncio.wait_for(victim, 90) == "decoded"
        assert decoder.pool is not first_pool
        assert "decoding again on the new pool" in caplog.text  # (the victim went with the bomb's pool)
        with pytest.raises(Unavailable, match="died"):
            await asyncio.wait_for(decoder._in_pool(_die), 90)
        assert await asyncio.wait_for(decoder._in_pool(_nap, 0.0), 90) == "decoded"  # a new pool serves

    try:
        asyncio.run(main())
    finally:
        asyncio.run(decoder.shutdown())


def test_a_fast_path_decode_that_cannot_be_stopped_is_ended_at_its_budget():
    """simplejpeg (a plain JPEG) has no chunks to stop between: with a budget far under its decode time (a
    4096x4096 photo: ~0.3 s here) its process is ended and the image answered 422; the pool goes on."""
    photo = Image.open(data.SKIMAGE_DATA / "chelsea.png").convert("RGB").resize((4096, 4096))
    big = data.encode(photo, "JPEG", quality=95)
    limits = ImageLimits(decode_timeout_s=0.01)
    assert read_header(big, limits).plain_jpeg
    decoder = decoders.PoolDecoder(1, limits, kill_grace_s=0.02)
    params = PreprocessParams(max_pixels=4096 * 4096)  # (no resize after the decode)

    async def main():
        with raises_code(ImageError, "image_too_complex", match="of CPU"):
            await asyncio.wait_for(decoder.decode(big, read_header(big, limits), params), 90)
        assert await asyncio.wait_for(decoder._in_pool(_nap, 0.0), 90) == "decoded"  # a new pool serves

    try:
        asyncio.run(main())
    finally:
        asyncio.run(decoder.shutdown())


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm")
def test_both_decoders_refuse_a_scan_bomb_at_once_and_stop_one_under_the_cap_at_its_deadline():
    """The bounds inside the decode hold in a decode process and in an API process's decode thread alike
    (a thread cannot be killed: only these bounds apply there): a JPEG of more scans than --max-jpeg-scans is
    refused before its decode, one under a raised cap is stopped at --decode-timeout-s; the arena cell is
    given back."""
    photo = data.progressive_photo(4096, smooth=True)
    params = PreprocessParams()
    arena_decoder = ArenaDecoder(Arena(segment_name(os.getpid(), 0, 96), 64 << 20), 1, ImageLimits(), Metrics())
    pool_decoder = decoders.PoolDecoder(1, ImageLimits())
    try:
        for decoder in (arena_decoder, pool_decoder):
            for limits, bomb, within in ((ImageLimits(), data.scan_bomb(photo, 100), 5.0),
                                         (ImageLimits(max_jpeg_scans=10**6, decode_timeout_s=0.5),
                                          data.scan_bomb(photo, 2000), 0.5 + 4.0)):
                decoder.limits = limits
                start = time.monotonic()
                with raises_code(ImageError, "image_too_complex"):
                    asyncio.run(asyncio.wait_for(decoder.decode(bomb, read_header(bomb, limits), params), 90))
                assert time.monotonic() - start < within, (type(decoder).__name__, time.monotonic() - start)
        assert arena_decoder.arena.used == 0
    finally:
        asyncio.run(arena_decoder.shutdown())
        asyncio.run(pool_decoder.shutdown())


def _modules_loaded(_i: int) -> tuple[bool, bool]:
    import sys

    return "torch" in sys.modules, "av" in sys.modules


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm")
def test_with_warm_video_both_decoders_import_the_video_path_before_the_first_video():
    """A process's first video paid PyAV's and torch's imports (on the H200 the first 30 s clips each API
    process decoded took 3.5-3.8 s, later ones 0.4-1.0 s): a GPU engine's decoders import them at start."""
    pytest.importorskip("av")
    pool_decoder = decoders.PoolDecoder(1, ImageLimits())
    try:
        asyncio.run(pool_decoder.start(PreprocessParams()))
        assert pool_decoder.pool.submit(_modules_loaded, 0).result(60) == (False, False)  # (a fresh worker: none)
        asyncio.run(pool_decoder.start(PreprocessParams(), warm_video=True))
        assert pool_decoder.pool.submit(_modules_loaded, 0).result(60) == (True, True)
    finally:
        asyncio.run(pool_decoder.shutdown())

    calls = []
    arena_decoder = ArenaDecoder(Arena(segment_name(os.getpid(), 0, 95), 1 << 20), 1, ImageLimits(), Metrics())

    async def start(warm: bool) -> None:
        await arena_decoder.start(PreprocessParams(), warm_video=warm)
        for _ in range(100):  # (the warm-up runs in a decode thread, not awaited: up to 10 s on a loaded machine)
            await asyncio.sleep(0.1)
            if calls or (not warm and _ >= 4):  # (none asked for: half a second to see that none came)
                break

    real = decoders._warm_video
    decoders._warm_video = lambda i: calls.append(__import__("threading").current_thread().name)
    try:
        asyncio.run(start(False))
        assert calls == []
        asyncio.run(start(True))
        assert len(calls) == 1 and calls[0].startswith("decode")  # one decode thread, not the event loop
    finally:
        decoders._warm_video = real
        asyncio.run(arena_decoder.shutdown())


def test_the_video_gate_lets_as_many_videos_decode_as_its_slots_and_bytes_allow():
    gate = decoders.VideoGate(slots=2, max_bytes=100)
    order: list[str] = []

    async def video(name: str, nbytes: int, release: asyncio.Event) -> None:
        async with gate.hold(nbytes):
            order.append(name)
            await release.wait()

    async def main():
        a, b, c = asyncio.Event(), asyncio.Event(), asyncio.Event()
        tasks = [asyncio.create_task(video("a", 60, a)), asyncio.create_task(video("b", 30, b)),
                 asyncio.create_task(video("c", 50, c))]
        await asyncio.sleep(0.05)
        assert order == ["a", "b"] and (gate.running, gate.held) == (2, 90)  # c waits: 140 bytes, and no slot
        b.set()
        await asyncio.sleep(0.05)
        assert order == ["a", "b"] and (gate.running, gate.held) == (1, 60)  # a slot, but 110 bytes: still waits
        a.set()
        await asyncio.sleep(0.05)
        assert order == ["a", "b", "c"] and (gate.running, gate.held) == (1, 50)
        c.set()
        await asyncio.gather(*tasks)
        assert (gate.running, gate.held) == (0, 0)
        with raises_code(VideoError, "video_too_large", match="--video-max-process-bytes"):
            async with gate.hold(101):
                pass
        waiting = asyncio.create_task(video("d", 100, asyncio.Event()))
        async with gate.hold(10):  # a waiter cancelled (its client gone) leaves nothing held
            await asyncio.sleep(0.05)
            waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert (gate.running, gate.held, gate._waiters, order[-1]) == (0, 0, [], "c")

    asyncio.run(main())


def test_videos_waiting_for_the_gate_go_by_priority_and_leave_at_their_deadline():
    gate = decoders.VideoGate(slots=1, max_bytes=100, aging_s=10.0)
    order: list[str] = []

    async def video(name: str, urgency: Urgency, release: asyncio.Event | None = None) -> None:
        async with gate.hold(10, urgency):
            order.append(name)
            if release is not None:
                await release.wait()

    async def main():
        first = asyncio.Event()
        tasks = [asyncio.create_task(video("first", Urgency(), first))]
        await asyncio.sleep(0.01)
        for name, u in [("bulk", Urgency(5)), ("late", Urgency(0, time.monotonic() + 0.05)), ("chat", Urgency(0))]:
            tasks.append(asyncio.create_task(video(name, u)))
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.1)
        first.set()
        outcomes = await asyncio.gather(*tasks, return_exceptions=True)
        assert order == ["first", "chat", "bulk"]
        assert isinstance(outcomes[2], DeadlineExceeded) and "before its decode started" in outcomes[2].message
        assert (gate.running, gate.held, gate._waiters) == (0, 0, [])

    asyncio.run(main())


# Video decodes in decode processes (module functions: a pool pickles them by name); `progress` is what
# prepare_video calls for every frame it decodes.
def _frames_for(seconds: float, progress) -> str:
    """A long video: a frame every 50 ms, for `seconds`, no CPU to speak of."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(0.05)
        progress()
    return "decoded"


def _frames_then_stuck(progress) -> str:
    """A video whose decode stops making progress (no frame, no CPU) after a few frames."""
    for _ in range(3):
        progress()
    time.sleep(300)
    return "never"


def _frames_then_spin(progress) -> int:
    """A video stuck in one frame's decode that burns CPU (past any deadline checked between frames)."""
    progress()
    return _spin(120.0)


def test_a_video_that_decodes_frames_is_not_a_stuck_pool_and_one_that_stops_is_ended():
    """The stall watch took a pool whose decodes had all run for --decode-stall-s without one finishing for stuck:
    two 4K videos on a pool of two were answered 503 at 30.5 s although --video-max-decode-s was 60. Every frame
    a video decodes is progress now: one that goes on past the stall limit is answered; one that stops
    decoding frames is ended at it (503, its pool replaced), and one that burns CPU in a frame past its CPU
    budget is a 413 (`video_too_long`)."""
    import functools

    stall_s = 2.0
    decoder = decoders.PoolDecoder(2, ImageLimits(), stall_s=stall_s, video_slots=1)

    def video(fn, *args, cpu_s=None):
        return decoder._in_pool(functools.partial(fn, progress=decoders._progress), *args, cpu_s=cpu_s, video=True)

    async def main():
        await asyncio.to_thread(decoder._started[2].result, 90)
        start = time.monotonic()
        assert await asyncio.wait_for(video(_frames_for, 3 * stall_s), 90) == "decoded"
        assert time.monotonic() - start > 3 * stall_s  # (three times the stall limit, and answered)
        first_pool = decoder.pool
        start = time.monotonic()
        with pytest.raises(Unavailable, match="stopped answering"):
            await asyncio.wait_for(video(_frames_then_stuck), 90)
        assert stall_s < time.monotonic() - start < stall_s + 30 and decoder.pool is not first_pool
        with raises_code(VideoError, "video_too_long", match="over 0.5 s of CPU, past its limit .*--video-max-decode-s") as e:
            await asyncio.wait_for(video(_frames_then_spin, cpu_s=0.5), 90)
        assert http_status(e.value) == 413
        assert await asyncio.wait_for(decoder._in_pool(_nap, 0.0), 90) == "decoded"  # a new pool serves

    try:
        asyncio.run(main())
    finally:
        asyncio.run(decoder.shutdown())


def test_a_video_decode_past_its_cpu_budget_ends_with_its_process_and_is_a_413():
    """A video's decode process has a CPU budget, as an image's has: --video-max-decode-s on every core (its
    decoder's threads use them all) and the grace. A frame that never finishes decoding never reaches the
    deadline checked between frames; the kernel ends its process instead. Here the budget (a millisecond of
    deadline) runs out inside the first frames of a 4K clip, before that check can answer."""
    pytest.importorskip("av")
    from service.media.params import VideoParams
    from service.media.video import read_header as read_video_header
    from tests.support import videodata as vd

    decoder = decoders.PoolDecoder(1, ImageLimits(), video_limits=VideoLimits(max_decode_s=0.001), kill_grace_s=0.0)
    assert decoder.video_cpu_s() == 0.001 * usable_cores()
    blob = vd.still_clip(3840, 2160, frames=100, fps=1)
    header = read_video_header(blob, VideoLimits())

    async def main():
        await decoder.start(PreprocessParams(), warm_video=True)  # (the imports are not the decode's CPU)
        first_pool = decoder.pool
        with raises_code(VideoError, "video_too_long", match="of CPU, past its limit") as e:
            await asyncio.wait_for(decoder.decode_video(blob, header, VideoParams()), 90)
        assert http_status(e.value) == 413 and decoder.pool is not first_pool
        assert await asyncio.wait_for(decoder._in_pool(_nap, 0.0), 90) == "decoded"  # a new pool serves

    try:
        asyncio.run(main())
    finally:
        asyncio.run(decoder.shutdown())
