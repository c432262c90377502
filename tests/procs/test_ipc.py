"""Control messages between API and engine processes: frames, stored items and errors survive the trip."""

import asyncio

import pytest

from service import errors
from service.procs.ipc import error_from_wire, error_to_wire, frame, item_from_wire, item_to_wire, read_frame
from service.store.directory import StoredItem


def test_errors_keep_their_class_and_retry_hint():
    for e in (errors.KeyConflict("in the store"), errors.Overloaded("queue full", retry_after_s=3),
              errors.StoreFull("full", retry_after_s=7), errors.NotAnImage("not an image")):
        back = error_from_wire(*error_to_wire(e))
        assert type(back) is type(e) and back.message == e.message and back.code == e.code
        assert getattr(back, "retry_after_s", None) == getattr(e, "retry_after_s", None)
        assert errors.http_status(back) == errors.http_status(e)
    bug = error_from_wire(*error_to_wire(RuntimeError("boom")))
    assert type(bug) is errors.BackendError and "RuntimeError: boom" in bug.message


def test_frames_and_items_round_trip():
    item = StoredItem(key="sha256+" + "ab" * 32, path="k/encoder_cache.safetensors", num_tokens=196,
                      grid_thw=(1, 28, 28), shape=(196, 10240), dtype="bfloat16", nbytes=4_014_176,
                      content_sha256="cd" * 32)

    async def trip(data: bytes):
        reader = asyncio.StreamReader()
        reader.feed_data(data)
        reader.feed_eof()
        return [await read_frame(reader), await read_frame(reader)]

    msg, end = asyncio.run(trip(frame(["result", 7, item_to_wire(item)])))
    assert msg[:2] == ["result", 7] and item_from_wire(msg[2]) == item and end is None
    with pytest.raises(ValueError, match="control frame"):
        asyncio.run(trip((1 << 21).to_bytes(4, "little") + b"x"))


def test_router_sends_a_key_to_its_shard_and_a_cancel_to_the_engine_that_issued_the_id():
    from service.procs.ipc import EngineMismatch, EngineRouter
    from service.store.directory import shard_of

    router = EngineRouter(["e0.sock", "e1.sock", "e2.sock"], lambda *a: None)
    ids = [[next(c._ids) for _ in range(3)] for c in router.clients]
    assert ids == [[1, 4, 7], [2, 5, 8], [3, 6, 9]]  # disjoint: an id names its engine
    assert all(router._issuer(rid) is router.clients[i] for i, row in enumerate(ids) for rid in row)
    for key in ("a", "img-2", "sha256+" + "0" * 64):
        assert router.route(key) is router.clients[shard_of(key, 3)]
    assert not router.connected  # none connected yet; one lost engine is enough to say False

    def status(pid, salt, store_error=None):
        async def answer():
            return {"info": {"ready": True, "device": "cpu"}, "key_salt": salt, "params": [1], "pid": pid,
                    "store_error": store_error}
        return answer

    for i, c in enumerate(router.clients):
        c.status = status(100 + i, "m|p|float32", "disk full" if i == 2 else None)
    st = asyncio.run(router.status())
    assert st["pid"] == 100 and st["info"]["ready"] and st["store_error"] == "engine 2: disk full"
    assert st["engines"] == [{"device": "cpu", "engine_pid": 100 + i, "ready": True} for i in range(3)]
    router.clients[1].status = status(101, "m|p|bfloat16")
    with pytest.raises(EngineMismatch, match="engine 1 keys or preprocesses images differently"):
        asyncio.run(router.status())
