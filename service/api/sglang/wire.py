"""SGLang's encoder protocol on the wire (SGLang 0.5.22 and 0.5.23, sglang/srt/disaggregation/encoder/): the
JSON its language side posts, and the ZMQ message that answers it. No torch and no SGLang here: the message
is written as SGLang's own encoder pickles it, by name.

    POST {url}/encode  {encoder_idx, encoder_url, mm_items, num_parts, part_idx, req_id, modality,
                        prefill_host, embedding_port, ...}: one part of a request's items (SGLang splits a
                        request's items among its encoders, a part per modality and encoder)
    the answer         one ZMQ multipart message PUSHed to the language side:
                         success: frame 0 the pickled `EmbeddingData` without its tensor, frame 1 the tensor's
                                  bytes, [tokens, out_hidden x (1 + deepstack levels)] (the store's entry)
                         error:   frame 0 alone, its `error_msg` and `error_code` set

SGLang unpickles frame 0 with an allow-list of exact (module, name) pairs (utils/common.py's SafeUnpickler):
the frame names only `EmbeddingData`, `Modality` (at `managers.schedule_batch`, where both releases allow it:
0.5.23 moved the class and allows its old path too) and a torch dtype, and holds nothing else but strings,
numbers, lists and None. Written here opcode by opcode (pickle protocol 2), so that it names SGLang's classes
without importing them.
"""

from __future__ import annotations

import struct
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

EMBEDDING_DATA = ("sglang.srt.disaggregation.encoder.receiver", "EmbeddingData")
MODALITY = ("sglang.srt.managers.schedule_batch", "Modality")
MODALITIES = {"IMAGE": 1, "VIDEO": 2, "AUDIO": 3}  # Modality's members (enum.auto() values)
# The keys of an item SGLang sends as a dict that this encoder takes: `content_hash` is checked against the
# bytes, `detail` is a knob of other models' processors (Qwen-VL's ignores it).
ITEM_KEYS = frozenset({"url", "content_hash", "detail"})


class EncodeBody(BaseModel):
    """One part, as SGLang's MMReceiverHTTP posts it to `{url}/encode`."""

    model_config = ConfigDict(extra="ignore")  # (time_stats_json, hashes, ...: SGLang's own bookkeeping)

    req_id: str = Field(min_length=1, max_length=512)  # `<rid>_local_part_<part_idx>`
    num_parts: int = Field(gt=0, le=4096)
    part_idx: int = Field(ge=0)
    mm_items: list[str | dict[str, Any]] = Field(min_length=1)
    modality: str
    prefill_host: str = Field(min_length=1, max_length=255)
    embedding_port: int | None = Field(None, ge=1, le=65535)  # None: the ranks register (zmq_to_scheduler)
    encoder_idx: int | None = None
    encoder_url: str | None = None


class RegisterBody(BaseModel):
    """A tensor-parallel rank's `{url}/scheduler_receive_url`: where it takes this part's message."""

    model_config = ConfigDict(extra="ignore")

    req_id: str = Field(min_length=1, max_length=512)
    receive_count: int = Field(gt=0, le=1024)  # the ranks that will register for this part
    receive_url: str = Field(min_length=3, max_length=300)  # host:port, an IPv6 host in brackets
    modality: str | None = None


def success_frames(req_id: str, num_parts: int, part_idx: int, modality: str, grids: list[list[int]],
                   dtype: str, shape: tuple[int, int], data: bytes | memoryview,
                   timestamps: list[list[float]] | None = None) -> list:
    """The message of a part encoded: `grids` one [t, h, w] per item, `data` the items' rows in order
    ([shape] of `dtype`, "float32" or "bfloat16"), `timestamps` a video part's seconds per temporal group,
    one list per video."""
    state = _state(req_id, num_parts, part_idx, modality)
    state.update(grid_dim=grids, dtype=_Global("torch", dtype), shape=list(shape), video_timestamps=timestamps)
    return [_dumps(state), data]


def error_frames(req_id: str, num_parts: int, part_idx: int, modality: str, message: str, code: int) -> list:
    """The message of a part that failed: SGLang fails its request with `message` (its client sees a 503)."""
    state = _state(req_id, num_parts, part_idx, modality)
    state.update(error_msg=message, error_code=int(code))
    return [_dumps(state)]


def _state(req_id: str, num_parts: int, part_idx: int, modality: str) -> dict:
    # The instance __dict__ SGLang's own copy_without_embedding() sends, in its order.
    return {"req_id": req_id, "num_parts": num_parts, "part_idx": part_idx, "grid_dim": None,
            "modality": _Member(MODALITY, MODALITIES[modality]), "embedding": None, "send_time": None,
            "dtype": None, "shape": None, "_mr_ptr": None, "error_msg": None, "error_code": None,
            "video_timestamps": None, "second_per_grid_ts": None}


# ---- pickle protocol 2, by opcode (the names are pickle's own: Lib/pickle.py) ----------------------------
class _Global:
    """A module-level name, pickled as a reference (a torch dtype)."""

    def __init__(self, module: str, name: str):
        self.module, self.name = module, name


class _Member:
    """An Enum member: its class called with its value, as Enum pickles itself."""

    def __init__(self, cls: tuple[str, str], value: int):
        self.cls, self.value = cls, value


def _dumps(state: dict) -> bytes:
    """`EmbeddingData.__new__(EmbeddingData)` with `state` as its __dict__ (copyreg's protocol-2 form)."""
    out = bytearray(b"\x80\x02")  # PROTO 2
    _global(out, *EMBEDDING_DATA)
    out += b")\x81"  # EMPTY_TUPLE NEWOBJ
    _save(out, state)
    out += b"b."  # BUILD STOP
    return bytes(out)


def _global(out: bytearray, module: str, name: str) -> None:
    out += b"c" + module.encode() + b"\n" + name.encode() + b"\n"  # GLOBAL


def _save(out: bytearray, v) -> None:
    if v is None:
        out += b"N"
    elif v is True or v is False:
        out += b"\x88" if v else b"\x89"
    elif isinstance(v, int):
        if -2**31 <= v < 2**31:
            out += b"J" + struct.pack("<i", v)  # BININT
        else:
            raw = v.to_bytes((v.bit_length() + 8) // 8, "little", signed=True)
            out += b"\x8a" + bytes([len(raw)]) + raw  # LONG1
    elif isinstance(v, float):
        out += b"G" + struct.pack(">d", v)  # BINFLOAT
    elif isinstance(v, str):
        raw = v.encode("utf-8", "surrogatepass")
        out += b"X" + struct.pack("<I", len(raw)) + raw  # BINUNICODE
    elif isinstance(v, (list, tuple)):
        out += b"]"  # EMPTY_LIST
        if v:
            out += b"("  # MARK
            for x in v:
                _save(out, x)
            out += b"e"  # APPENDS
    elif isinstance(v, dict):
        out += b"}"  # EMPTY_DICT
        if v:
            out += b"("
            for k, x in v.items():
                _save(out, k)
                _save(out, x)
            out += b"u"  # SETITEMS
    elif isinstance(v, _Global):
        _global(out, v.module, v.name)
    elif isinstance(v, _Member):
        _global(out, *v.cls)
        _save(out, v.value)
        out += b"\x85R"  # TUPLE1 REDUCE
    else:
        raise TypeError(f"not in SGLang's frame: {type(v).__name__}")
