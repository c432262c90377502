"""Control messages between API and engine processes: frames, stored items and errors survive the trip."""

import asyncio

import pytest

from service import errors
from service.ipc import error_from_wire, error_to_wire, frame, item_from_wire, item_to_wire, read_frame
from service.store import StoredItem


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
