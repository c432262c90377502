"""The two decoders (service/procs/decoders.py): an API process's decode threads write each image once,
straight into a cell of its arena, and give the cell back when the decode fails; a full arena is a 429
before anything is taken."""

import asyncio
import os

import numpy as np
import pytest

from service.config import PreprocessParams, Settings
from service.errors import CorruptImage, Overloaded
from service.media.images import prepare_image, read_header
from service.metrics import Metrics
from service.procs.arena import Arena, segment_name
from service.procs.decoders import ArenaDecoder
from tests import imagedata as data


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
        with pytest.raises(CorruptImage):
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

    from service.procs import decoders

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
    from service.errors import TruncatedVideo, VideoTooLarge
    from service.media.video import VideoParams
    from service.media.video import read_header as video_header
    from service.media.video_preprocess import prepare_video
    from tests import videodata as vd

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
        with pytest.raises(TruncatedVideo):  # failed after it took its cell: the cell is given back
            decode(mkv[: len(mkv) // 2])
        assert arena.used == 0
        with pytest.raises(VideoTooLarge, match="more than this process's pixel arena holds"):
            decode(clip, VideoParams(min_pixels=6 * 512 * 512, max_pixels=6 * 1024 * 1024))
        assert arena.used == 0
    finally:
        asyncio.run(decoder.shutdown())
