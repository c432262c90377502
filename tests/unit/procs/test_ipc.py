"""Messages between API and engine processes (service/procs/ipc.py, service/engine/messages.py): typed
frames, stored items and errors survive the trip; the router sends each key to its shard."""

import asyncio

import pytest

from service import errors
from service.media.params import VideoParams, PreprocessParams
from service.engine.client import EngineRouter
from service.errors import BackendError, ImageError, KeyConflict, Overloaded, Unavailable
from service.engine.messages import (
    Cell,
    Claim,
    EngineStatus,
    Failed,
    Geometry,
    Hit,
    ModelInfo,
    Result,
    Submit,
)
from service.procs.ipc import FROM_ENGINE, MAX_FRAME, TO_ENGINE
from service.store.format import StoredItem
from service.store.keys import shard_of
from tests.support.errors import raises_code


def test_errors_keep_their_class_and_retry_hint():
    for e in (errors.KeyConflict("in the store"), errors.Overloaded("queue full", retry_after_s=3),
              errors.Unavailable("full", retry_after_s=7, code="store_full"), errors.ImageError("not an image", code="not_an_image")):
        back = errors.from_code(e.code, e.message, getattr(e, "retry_after_s", None))
        assert type(back) is type(e) and back.message == e.message and back.code == e.code
        assert getattr(back, "retry_after_s", None) == getattr(e, "retry_after_s", None)
        assert errors.http_status(back) == errors.http_status(e)
    unknown = errors.from_code("no_such_code", "boom")
    assert type(unknown) is errors.BackendError and unknown.message == "boom"


async def _trip(frames, data: bytes) -> list:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    reader.feed_eof()
    return [await frames.read(reader), await frames.read(reader)]


def test_frames_round_trip_typed_messages_and_refuse_what_is_not_one():
    item = StoredItem(key="sha256+" + "ab" * 32, path="k/encoder_cache.safetensors", num_tokens=196,
                      grid_thw=(1, 28, 28), shape=(196, 10240), dtype="bfloat16", nbytes=4_014_176,
                      content_sha256="cd" * 32)
    for msg in (Result(7, item), Hit(8, item), Failed(9, "overloaded", "full", 1)):
        back, end = asyncio.run(_trip(FROM_ENGINE, FROM_ENGINE.frame(msg)))
        assert back == msg and type(back) is type(msg) and end is None
    submit = Submit(3, 1, "k", "ef" * 32, Geometry(448, 448, (1, 28, 28), 196), cell=Cell("qve-1-api0-1", 64, 602112))
    back, _ = asyncio.run(_trip(TO_ENGINE, TO_ENGINE.frame(submit)))
    assert back == submit and back.geometry.grid_thw == (1, 28, 28)
    with pytest.raises(ValueError, match="control frame"):
        asyncio.run(_trip(TO_ENGINE, (MAX_FRAME + 1).to_bytes(4, "little") + b"x"))
    # An engine-bound message on the API side's decoder (or garbage) is refused, not half-read.
    with pytest.raises(ValueError, match="malformed control frame"):
        asyncio.run(_trip(FROM_ENGINE, TO_ENGINE.frame(Claim(1, "k", "0" * 64, 4))))


class _Transport:
    travels, connected = True, False


def _status(pid: int, salt: str, store_error: str | None = None) -> EngineStatus:
    info = ModelInfo(model="m", device="cpu", dtype="float32", random_weights=True, out_hidden_size=8,
                     deepstack_levels=3, compiled=False, cuda_graphs=0, startup_s={}, min_pixels=1, max_pixels=2,
                     store="/s")
    return EngineStatus(ready=True, failed=None, store_error=store_error, key_salt=salt, params=PreprocessParams(),
                        video=VideoParams(), pid=pid, info=info)


def test_router_sends_a_key_to_its_shard_and_a_cancel_to_the_engine_that_issued_the_id():
    router = EngineRouter([_Transport(), _Transport(), _Transport()])
    ids = [[next(c._ids) for _ in range(3)] for c in router.clients]
    assert ids == [[1, 4, 7], [2, 5, 8], [3, 6, 9]]  # disjoint: an id names its engine
    assert all(router._issuer(rid) is router.clients[i] for i, row in enumerate(ids) for rid in row)
    for key in ("a", "img-2", "sha256+" + "0" * 64):
        assert router.route(key) is router.clients[shard_of(key, 3)]
    assert not router.connected  # none connected yet; one lost engine is enough to say False

    def status(st):
        async def answer():
            return st
        return answer

    for i, c in enumerate(router.clients):
        c.status = status(_status(100 + i, "m|p|float32", "disk full" if i == 2 else None))
    st = asyncio.run(router.status())
    assert st.first.pid == 100 and st.ready and st.store_error == "engine 2: disk full" and st.failed is None
    assert [s.pid for s in st.engines] == [100, 101, 102]
    router.clients[1].status = status(_status(101, "m|p|bfloat16"))
    with raises_code(Unavailable, "engine_mismatch", match="engine 1 keys or preprocesses images differently"):
        asyncio.run(router.status())
