"""What a Mooncake entry's two objects hold, checked before anyone trusts them (store/mooncake.py writes
and looks them up; its reader and vLLM's connector read them):

    value      vLLM 0.33's layout: a 24-byte little-endian header struct("<IIQQ") (magic 0x4D4F4F4E,
               dtype code 0 float32 / 11 float16 / 12 bfloat16, num_tokens, hidden), then the contiguous
               [num_tokens, hidden] tensor
    companion  JSON: what a directory entry keeps in __metadata__ (grid_thw, model, widths, dtype, the
               content SHA-256, a video's sampling), plus num_tokens, width and nbytes

Anyone can write a pool's keys (Mooncake has no authentication), so nothing read is trusted: a companion
that does not parse into its fields (`companion`), or a value whose header or size contradicts its
companion (`ValueHeaders.read`), is no entry at all, key by key.
"""

from __future__ import annotations

import ctypes
import json
import math
import struct
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

from service.store.calls import Calls, Overdue
from service.store.format import FORMAT_VERSION, StoreFormatError, VideoMeta

if TYPE_CHECKING:
    import torch

MAGIC = 0x4D4F4F4E
HEADER = struct.Struct("<IIQQ")  # magic, dtype code, num_tokens, hidden
DTYPE_CODES = {"float32": 0, "float16": 11, "bfloat16": 12}  # vLLM 0.33's codes
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}
# Values whose headers one Mooncake call reads (a lookup batch is at most a step's images; more go in
# several calls), and the calls that may be out at once, each with a buffer of its own (a call past its
# deadline still writes into its buffer until Mooncake returns).
PROBE_BATCH = 64
PROBE_BUFFERS = 8
_SLOT = 32  # bytes per value in a probe buffer: its header, its last byte, and one past its end
MERGE_PATCHES = 4  # Qwen3-VL merges 2 x 2 patches of its grid into one token


@dataclass(frozen=True)
class Companion:
    """A companion's fields, each checked (types, ranges, and that its sizes agree with each other)."""

    raw: dict  # the JSON object as written
    model: str
    out_hidden_size: int
    deepstack_levels: int
    dtype: str  # "float32" | "float16" | "bfloat16"
    grid_thw: tuple[int, int, int]
    num_tokens: int
    width: int  # out_hidden_size * (1 + deepstack_levels)
    nbytes: int  # of the tensor: num_tokens * width * the dtype's size
    content_sha256: str | None
    video: VideoMeta | None

    @property
    def value_nbytes(self) -> int:
        """The whole value's size, its header included."""
        return HEADER.size + self.nbytes

    def header(self) -> tuple[int, int, int, int]:
        """The value header this companion's value must have."""
        return MAGIC, DTYPE_CODES[self.dtype], self.num_tokens, self.width


def _int(v, low: int = 0) -> int:
    if type(v) is not int or v < low:
        raise ValueError(v)
    return v


def _number(v) -> float:
    if type(v) not in (int, float) or not math.isfinite(v):
        raise ValueError(v)
    return float(v)


def companion(raw) -> Companion | None:
    """A companion's bytes (Mooncake's buffer, bytes) -> its checked fields, or None for anything else
    (not JSON, a field missing, of the wrong type, or sizes that contradict each other)."""
    try:
        meta = json.loads(bytes(raw))
        if not isinstance(meta, dict) or meta.get("format_version") != FORMAT_VERSION:
            return None
        model, dtype, sha = meta["model"], meta["dtype"], meta.get("content_sha256")
        if not isinstance(model, str) or dtype not in DTYPE_CODES or not (sha is None or isinstance(sha, str)):
            return None
        out_hidden, levels = _int(meta["out_hidden_size"], 1), _int(meta["deepstack_levels"])
        grid = meta["grid_thw"]
        if not isinstance(grid, list) or len(grid) != 3:
            return None
        grid_thw = (_int(grid[0], 1), _int(grid[1], 1), _int(grid[2], 1))
        rows, width, nbytes = _int(meta["num_tokens"]), _int(meta["width"]), _int(meta["nbytes"])
        if width != out_hidden * (1 + levels) or nbytes != rows * width * ITEMSIZE[dtype]:
            return None
        if rows * MERGE_PATCHES != grid_thw[0] * grid_thw[1] * grid_thw[2]:  # rows its grid does not make
            return None
        video = None
        if meta.get("modality", "image") == "video":
            frames, stamps = meta["frames_indices"], meta["timestamps"]
            if not isinstance(frames, list) or not isinstance(stamps, list):
                return None
            video = VideoMeta(tuple(_int(f) for f in frames), _number(meta["fps"]), tuple(_number(t) for t in stamps))
        elif meta.get("modality", "image") != "image":
            return None
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        return None
    return Companion(meta, model, out_hidden, levels, dtype, grid_thw, rows, width, nbytes, sha, video)


class ValueHeaders:
    """Reads values' headers from their segments, each checked against what its companion says: one
    Mooncake call per PROBE_BATCH values, each a 24-byte transfer from the value's host (the replica lookup
    inside it also takes the master's lease on the value, which keeps it while a consumer reads it).

    NOTE: a read, not is_exist: after a host is lost the master still answers 1 for its objects until its
    client TTL, and the companion alone may still read (seen once, in a fresh-clone run of
    test_multihost's SIGKILL test: a lost entry answered cached); a read from the value's own segment
    fails then. The size: beside the header, the value's last byte is read and a byte one past its end,
    which Mooncake refuses for a value of exactly that size (a truncated one fails the first, a longer
    one reads the second), so a value that is not whole is found without reading it."""

    def __init__(self, client, calls: Calls):
        self.client, self.calls = client, calls
        self._lock = threading.Lock()
        self._free: list[ctypes.Array] = []
        self._buffers: list[ctypes.Array] = []  # every buffer registered with the client

    def read(self, vkeys: list[str], expected: list[Companion]) -> list[bool]:
        """Whether each value reads back now with exactly the header and size its companion says. A call
        past the deadline (a host that does not answer) answers False for its values: a miss."""
        ok: list[bool] = []
        for start in range(0, len(vkeys), PROBE_BATCH):
            chunk, want = vkeys[start : start + PROBE_BATCH], expected[start : start + PROBE_BATCH]
            buf = self._take()
            if buf is None:  # every buffer is held by a call still out past its deadline
                ok += [False] * len(chunk)
                continue
            try:
                call = self.calls.start("read", self._probe, buf, chunk, want)
            except Overdue:  # every thread held by reads past their deadline: misses at once
                self._give(buf)
                ok += [False] * len(chunk)
                continue
            call.add_done_callback(lambda _f, buf=buf: self._give(buf))  # (returned, or cancelled unstarted)
            try:
                ok += self.calls.wait("read", call)
            except Exception:  # (Overdue; its buffer comes back when its call returns)
                ok += [False] * len(chunk)
        return ok

    def _give(self, buf: ctypes.Array) -> None:
        with self._lock:
            if any(b is buf for b in self._buffers):  # (not after close)
                self._free.append(buf)

    def _take(self) -> ctypes.Array | None:
        with self._lock:
            if self._free:
                return self._free.pop()
            if len(self._buffers) >= PROBE_BUFFERS:
                return None
            buf = ctypes.create_string_buffer(_SLOT * PROBE_BATCH)
            if self.client.register_buffer(ctypes.addressof(buf), len(buf)) != 0:
                return None
            self._buffers.append(buf)
            return buf

    def _probe(self, buf: ctypes.Array, vkeys: list[str], want: list[Companion]) -> list[bool]:
        """One call's reads into `buf` (on a thread of `calls`)."""
        base, n = ctypes.addressof(buf), len(vkeys)
        ctypes.memset(base, 0, _SLOT * n)  # a failed range must not read as the last call's
        dst = [[i * _SLOT, i * _SLOT + HEADER.size, i * _SLOT + HEADER.size + 1] for i in range(n)]
        src = [[0, c.value_nbytes - 1, c.value_nbytes] for c in want]
        got = self.client.get_into_ranges([base], [vkeys], [dst], [src], [[[HEADER.size, 1, 1]] * n])
        reads = got[0] if len(got) == 1 and len(got[0]) == n else [[-1, -1, -1]] * n
        return [len(r) == 3 and r[0] == HEADER.size and r[1] == 1 and r[2] < 0
                and HEADER.unpack_from(buf, i * _SLOT) == c.header() for i, (r, c) in enumerate(zip(reads, want))]

    def close(self) -> None:
        """Unregister the buffers (after every call has returned: the client is closing)."""
        with self._lock:
            for buf in self._buffers:
                self.client.unregister_buffer(ctypes.addressof(buf))
            self._buffers.clear()
            self._free.clear()


def value_rows(value, expect: tuple[int, int, int, int] | None = None) -> tuple[str, int, int, memoryview]:
    """A value in vLLM 0.33's layout (bytes or a memoryview) -> (dtype name, num_tokens, hidden, its tensor's
    bytes, a view), the header's magic, dtype code and sizes checked against the bytes (and, with `expect`,
    against that header: a companion's, an answer's). StoreFormatError otherwise. No torch."""
    buf = memoryview(value).cast("B")
    if len(buf) < HEADER.size:
        raise StoreFormatError(f"a Mooncake value of {len(buf)} bytes has no header")
    magic, code, n, hidden = HEADER.unpack_from(buf)
    names = {c: name for name, c in DTYPE_CODES.items()}
    if magic != MAGIC or code not in names:
        raise StoreFormatError(f"not an embedding value (magic {magic:#x}, dtype code {code})")
    dtype = names[code]
    if len(buf) != HEADER.size + n * hidden * ITEMSIZE[dtype]:
        raise StoreFormatError(f"a value of {len(buf)} bytes for [{n}, {hidden}] {dtype}")
    if expect is not None and (magic, code, n, hidden) != expect:
        raise StoreFormatError(f"a [{n}, {hidden}] {dtype} value where [{expect[2]}, {expect[3]}] "
                               f"{names.get(expect[1], expect[1])} was expected")
    return dtype, n, hidden, buf[HEADER.size:]


def parse_value(value, expect: Companion | None = None) -> torch.Tensor:
    """A value in vLLM 0.33's layout (bytes or a memoryview) -> the [num_tokens, hidden] tensor, a copy this
    process owns, as vLLM parses it: checked as value_rows checks it (with `expect`, against its companion).
    StoreFormatError otherwise."""
    import torch

    dtype, n, hidden, rows = value_rows(value, None if expect is None else expect.header())
    out = torch.empty((n, hidden), dtype=getattr(torch, dtype))
    if n * hidden:
        out.view(torch.uint8).view(-1).numpy()[:] = rows  # the one copy
    return out
