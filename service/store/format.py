"""The embedding store's on-disk format: what a consumer (the LM server) imports. The writer, with its LRU
index and eviction, is service/store/directory.py; nothing here depends on it.

One safetensors file per image, in vLLM's ECExampleConnector layout:

    <root>/<key>/encoder_cache.safetensors
        tensor  "ec_cache"      # [num_tokens, out_hidden * (1 + deepstack_levels)], float32 | bfloat16
                                # columns: main merged embeddings, then each deepstack tap in index order
        __metadata__ (all values are strings; lists are JSON):
            format_version   "1"
            model            model identity, e.g. "qwen3-vl-4b" or a checkpoint path
            out_hidden_size  "2560"
            deepstack_levels "3"
            grid_thw         "[1, 28, 28]"
            num_tokens       "196"        (redundant with the shape; for humans and `jq`)
            content_sha256   SHA-256 of the source image's bytes (a uuid bound to other bytes is a 409)
        a video's entry also has (VideoMeta; an image's has none of these):
            modality         "video"
            frames_indices   "[0, 15, 30, 45]"  the source frames sampled (before an odd count's padding)
            fps              "30.0"             the source's average frame rate
            timestamps       "[0.25, 1.25]"     seconds of each temporal group (grid_thw's t of them)

`read_embeddings` is the consumer (reader) side (`read_ec_cache` for the tensor unsplit, as vLLM's
encoder cache holds it). It shares nothing with the writer (`store.directory.DirectoryStore`) but this format, so
another process (the LM server) can call it while the writer evicts and replaces files. This module
imports torch only inside the readers.

Why this is safe for concurrent readers: a file is written under a temp name in its key directory and
`os.replace`d onto the final name, and never modified in place afterwards. A reader that opens the
final name holds either the old or the new inode, both complete; eviction only unlinks, and an
unlinked inode stays readable through an open handle (POSIX). So `read_embeddings` opens once, reads
everything from that handle, and checks the size against the header.
"""

from __future__ import annotations

import ctypes
import json
import mmap as _mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from service.errors import RequestError
from service.store.keys import validate_key

if TYPE_CHECKING:
    import torch

FORMAT_VERSION = 1
FILE_NAME = "encoder_cache.safetensors"
TENSOR_NAME = "ec_cache"
TMP_PREFIX = ".tmp-"  # our temp names; start-up cleanup removes every ".tmp*" (older versions'
# files were written by safetensors' save_file, whose 0.8 writes a ".tmpXXXXXX" of its own)
FILE_MODE = 0o644

# safetensors dtype code -> the name used in the API ("dtype" in /encode answers; torch's name for it
# too) and the bytes per element. No torch dtypes here, so that this module imports without torch.
_DTYPES: dict[str, tuple[str, int]] = {
    "F32": ("float32", 4),
    "BF16": ("bfloat16", 2),
}
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_MAX_HEADER_BYTES = 100_000_000  # the limit safetensors itself enforces


class StoreFormatError(ValueError):
    """A store file that is not a well-formed ec_cache file (truncated, foreign, or corrupt)."""


@dataclass(frozen=True)
class VideoMeta:
    """What a video's entry records beside its embeddings: what the LM side needs for its prompt
    (Qwen3-VL writes each temporal group's `<t seconds>` before its tokens)."""

    frames_indices: tuple[int, ...]  # the source frames sampled, ascending (before an odd count's padding)
    fps: float  # the source video's average frame rate
    timestamps: tuple[float, ...]  # seconds of each temporal group, in order (media/video.timestamps)

    def metadata(self) -> dict[str, str]:
        """The entry's metadata fields (safetensors __metadata__ strings; lists as JSON)."""
        return {"modality": "video", "frames_indices": json.dumps(list(self.frames_indices)),
                "fps": repr(float(self.fps)), "timestamps": json.dumps(list(self.timestamps))}

    @staticmethod
    def from_metadata(metadata: dict[str, str]) -> VideoMeta | None:
        """A video entry's VideoMeta from its metadata strings; None for an image's."""
        if metadata.get("modality") != "video":
            return None
        return VideoMeta(frames_indices=tuple(int(i) for i in json.loads(metadata["frames_indices"])),
                         fps=float(metadata["fps"]), timestamps=tuple(float(t) for t in json.loads(metadata["timestamps"])))


@dataclass(frozen=True)
class StoredItem:
    """What the service tells a client about one stored image (the /encode answer's item, minus `cached`)."""

    key: str
    path: str | None  # a directory store: relative to the root, "<key>/encoder_cache.safetensors"; else None
    num_tokens: int
    grid_thw: tuple[int, int, int]
    shape: tuple[int, int]  # (num_tokens, out_hidden * (1 + deepstack_levels))
    dtype: str  # "float32" | "bfloat16"
    nbytes: int  # whole file (header + data): what counts against the capacity
    content_sha256: str | None = None  # SHA-256 of the source image's bytes (None: written without one)
    store_key: str | None = None  # Mooncake Store: the value's whole key, "<namespace>@id:<key>"; else None
    video: VideoMeta | None = None  # a video's sampling and timestamps; None: an image

    @property
    def modality(self) -> str:
        return "image" if self.video is None else "video"


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A zero-copy, flat byte view of a contiguous CPU tensor's data (little-endian, like every host we
    run on), valid while `t` is alive. Works for a view into a larger (e.g. pinned) buffer: data_ptr()
    includes the storage offset.

    NOTE: built from the data pointer with ctypes (as safetensors' own writer passes pointers), not as
    `t.reshape(-1).view(torch.uint8).numpy()`: every torch op call releases and retakes the GIL, and
    while another Python thread is busy each retake can wait a whole switch interval (5 ms); measured,
    that reshape alone cost ~10 ms under contention. This takes no torch op and never drops the GIL."""
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_ubyte * nbytes).from_address(t.data_ptr())).cast("B")


def _key_dir(root: Path, key: str, real_root: str | None = None) -> Path:
    """`root/key`, checked to resolve to a direct child of root (defence in depth behind validate_key:
    it also catches a key directory that someone replaced with a symlink to elsewhere)."""
    validate_key(key)
    d = root / key
    real_root = real_root or os.path.realpath(root)
    if os.path.dirname(os.path.realpath(d)) != real_root:
        raise RequestError(f"key {key!r} resolves outside the store root {str(root)!r}; remove that entry from the store", code="invalid_key")
    return d


# ---- the on-disk format ----------------------------------------------------------------------------
@dataclass(frozen=True)
class _Header:
    """A parsed, validated safetensors header of one store file."""

    header_len: int  # bytes of JSON after the 8-byte length prefix
    dtype: str  # "float32" | "bfloat16" (torch's names for them too)
    itemsize: int  # bytes per element
    shape: tuple[int, int]  # (num_tokens, out_hidden * (1 + deepstack_levels))
    data_nbytes: int
    metadata: dict[str, str]  # the raw __metadata__
    format_version: int
    model: str
    out_hidden_size: int
    deepstack_levels: int
    grid_thw: tuple[int, int, int]

    @property
    def file_nbytes(self) -> int:
        return 8 + self.header_len + self.data_nbytes


def _parse_header(prefix: bytes, header_json: bytes, file_size: int, where: str) -> _Header:
    """Validate one store file's header against its size. Raises StoreFormatError saying what is wrong."""

    def bad(why: str) -> StoreFormatError:
        return StoreFormatError(f"{where}: not a valid {FILE_NAME} ({why})")

    (header_len,) = struct.unpack("<Q", prefix)
    if len(header_json) != header_len:
        raise bad(f"truncated header: {len(header_json)} of {header_len} bytes")
    try:
        header = json.loads(header_json)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise bad(f"header is not JSON: {e}") from None
    if not isinstance(header, dict) or set(header) != {"__metadata__", TENSOR_NAME}:
        keys = sorted(header) if isinstance(header, dict) else type(header).__name__
        raise bad(f"expected exactly the tensor {TENSOR_NAME!r} and __metadata__, found {keys}")
    info, meta = header[TENSOR_NAME], header["__metadata__"]
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise bad("__metadata__ must map strings to strings")
    if not isinstance(info, dict) or info.get("dtype") not in _DTYPES:
        raise bad(f"{TENSOR_NAME} dtype must be one of {sorted(_DTYPES)}")
    dtype, itemsize = _DTYPES[info["dtype"]]
    shape, offsets = info.get("shape"), info.get("data_offsets")
    if not (isinstance(shape, list) and len(shape) == 2 and all(type(s) is int and s >= 0 for s in shape)):
        raise bad(f"{TENSOR_NAME} must be 2-D, got shape {shape!r}")
    data_nbytes = shape[0] * shape[1] * itemsize
    if offsets != [0, data_nbytes]:
        raise bad(f"data_offsets {offsets!r} do not match shape {shape} {dtype}")
    if file_size != 8 + header_len + data_nbytes:
        raise bad(f"file is {file_size} bytes, header says {8 + header_len + data_nbytes}")
    try:
        format_version = int(meta["format_version"])
        model = meta["model"]
        out_hidden = int(meta["out_hidden_size"])
        levels = int(meta["deepstack_levels"])
        grid = json.loads(meta["grid_thw"])
    except (KeyError, ValueError) as e:
        raise bad(f"missing or malformed metadata field: {e!r}") from None
    if not (isinstance(grid, list) and len(grid) == 3 and all(type(g) is int and g > 0 for g in grid)):
        raise bad(f"grid_thw must be three positive ints, got {meta['grid_thw']!r}")
    if out_hidden <= 0 or levels < 0 or shape[1] != out_hidden * (1 + levels):
        raise bad(f"shape {shape} does not match out_hidden_size={out_hidden} deepstack_levels={levels}")
    return _Header(
        header_len=header_len,
        dtype=dtype,
        itemsize=itemsize,
        shape=(shape[0], shape[1]),
        data_nbytes=data_nbytes,
        metadata=meta,
        format_version=format_version,
        model=model,
        out_hidden_size=out_hidden,
        deepstack_levels=levels,
        grid_thw=(grid[0], grid[1], grid[2]),
    )


def _read_into(fd: int, buf: memoryview, where: str) -> None:
    """Fill `buf` from the file's current position, or raise StoreFormatError if the file ends first."""
    got = 0
    while got < len(buf):
        k = os.readv(fd, [buf[got:]])
        if k == 0:
            raise StoreFormatError(f"{where}: truncated: got {got} of {len(buf)} bytes")
        got += k


def _read_bytes(fd: int, n: int, where: str) -> bytes:
    buf = bytearray(n)
    _read_into(fd, memoryview(buf), where)
    return bytes(buf)


def _read_header(fd: int, where: str) -> _Header:
    """Read and validate the header from an open file (position must be 0; left after the header)."""
    file_size = os.fstat(fd).st_size
    if file_size < 8:
        raise StoreFormatError(f"{where}: not a valid {FILE_NAME} (only {file_size} bytes)")
    prefix = _read_bytes(fd, 8, where)
    (header_len,) = struct.unpack("<Q", prefix)
    if header_len > min(_MAX_HEADER_BYTES, file_size - 8):
        raise StoreFormatError(f"{where}: not a valid {FILE_NAME} (header length {header_len} is impossible)")
    return _parse_header(prefix, _read_bytes(fd, header_len, where), file_size, where)


def _encode_header(dtype_code: str, shape: tuple[int, ...], data_nbytes: int, metadata: dict[str, str]) -> bytes:
    """The 8-byte length prefix and the JSON header of a file holding one tensor `ec_cache`, byte for byte
    as safetensors 0.8 (Rust serde_json) writes them:

        u64 little-endian N, then N bytes {"__metadata__":{...},"ec_cache":{"dtype":..,"shape":[..],
        "data_offsets":[0,nbytes]}} -- compact separators, non-ASCII as raw UTF-8, control characters
        escaped as \\n \\t ... or \\u00xx (lowercase hex) -- padded with spaces to N % 8 == 0, so the data
        starts 8-byte aligned. The raw little-endian tensor bytes follow.

    The one liberty: safetensors 0.8 emits the `__metadata__` entries in Rust HashMap order, which is
    randomized per call (its own output is not reproducible); we emit them in `metadata`'s order. Given
    the same order the bytes are identical (tests/unit/store/test_directory.py checks it), and no reader depends on it.
    """
    for k, v in metadata.items():
        if type(k) is not str or type(v) is not str:  # safetensors raises too; json would write a number
            raise TypeError(f"safetensors metadata must map str to str, got {k!r}: {v!r}")
    info = {"dtype": dtype_code, "shape": list(shape), "data_offsets": [0, data_nbytes]}  # serde's field order
    body = json.dumps(
        {"__metadata__": metadata, TENSOR_NAME: info}, ensure_ascii=False, separators=(",", ":")
    ).encode("utf-8")
    body += b" " * (-len(body) % 8)
    return struct.pack("<Q", len(body)) + body


# ---- the consumer side -----------------------------------------------------------------------------
@dataclass
class StoredEmbeddings:
    """One image's embeddings as the LM consumer needs them.

    `main` and `deepstack[i]` are column slices (views) of one [n, out_hidden*(1+levels)] buffer, as in
    vLLM's split of `ec_cache`; call `.contiguous()` if a kernel needs dense rows.
    """

    main: torch.Tensor  # [num_tokens, out_hidden], CPU, float32 | bfloat16
    deepstack: list[torch.Tensor]  # deepstack_levels x [num_tokens, out_hidden], tap index order
    grid_thw: tuple[int, int, int]  # the LM needs it for Qwen3-VL's 3-D rotary positions
    metadata: dict[str, str]  # the raw safetensors __metadata__ (string values, lists JSON-encoded)

    # A video entry's metadata also has modality "video", frames_indices, fps (the source's) and timestamps
    # (one per temporal group: media/video.timestamps); entries without `modality` are images.
    @property
    def modality(self) -> str:
        m = self.metadata.get("modality", "image")
        if m not in ("image", "video"):
            raise StoreFormatError(f"metadata modality {m!r}: expected 'image' or 'video'")
        return m

    @property
    def timestamps(self) -> list[float] | None:
        """A video's seconds per temporal group, what Qwen3-VL's prompt writes as `<{t:.1f} seconds>`;
        None for an image."""
        v = self._json("timestamps")
        if v is not None and not (isinstance(v, list) and all(isinstance(t, (int, float)) for t in v)):
            raise StoreFormatError(f"metadata timestamps {self.metadata['timestamps']!r}: expected a list of numbers")
        return None if v is None else [float(t) for t in v]

    @property
    def frames_indices(self) -> list[int] | None:
        v = self._json("frames_indices")
        if v is not None and not (isinstance(v, list) and all(type(i) is int for i in v)):
            raise StoreFormatError(f"metadata frames_indices {self.metadata['frames_indices']!r}: expected a list of ints")
        return v

    @property
    def fps(self) -> float | None:
        v = self._json("fps")
        if v is not None and not isinstance(v, (int, float)):
            raise StoreFormatError(f"metadata fps {self.metadata['fps']!r}: expected a number")
        return None if v is None else float(v)

    def _json(self, key: str):
        if key not in self.metadata:
            return None
        try:
            return json.loads(self.metadata[key])
        except json.JSONDecodeError:
            raise StoreFormatError(f"metadata {key} {self.metadata[key]!r} is not JSON") from None

    @property
    def video(self) -> VideoMeta | None:
        """A video's frames_indices, fps and timestamps together (the writer's VideoMeta); None for an image."""
        return VideoMeta.from_metadata(self.metadata)


def read_embeddings(root: Path, key: str, *, mmap: bool = False) -> StoredEmbeddings:
    """Read `<root>/<key>/encoder_cache.safetensors` and split it into main + deepstack embeddings.

    Raises KeyError(key) if the key is not in the store (never written, or evicted), `invalid_key` for a
    key that could not be in the store, and StoreFormatError for a file that is not a whole ec_cache file.

    Safe against a concurrent eviction or replacement by the writer: the file is opened once, its
    header checked against its size, and the data read through that same handle, so the result is
    one complete version of the file (an unlinked or replaced inode stays valid while open).

    `mmap=True` maps the file instead of copying it (zero-copy; on /dev/shm the tensor then lives in
    the store's pages, copy-on-write). The mapping keeps the inode alive after an eviction too; it is
    safe because the writer never modifies or truncates a published file, it only replaces or unlinks
    it. The default copy (~1.6 GB/s on one core, mostly page faults) owns its memory.
    """
    import torch  # here, not at module level: the format itself needs no torch

    fd, where = open_entry(root, key)
    try:
        ec_cache, h = _read_entry(fd, where, mmap)
    finally:
        os.close(fd)
    parts = list(torch.split(ec_cache, h.out_hidden_size, dim=1))
    assert len(parts) == 1 + h.deepstack_levels, "checked by _parse_header: this is a bug"
    return StoredEmbeddings(main=parts[0], deepstack=parts[1:], grid_thw=h.grid_thw, metadata=h.metadata)


def read_ec_cache(root: Path, key: str, *, mmap: bool = False) -> torch.Tensor:
    """The key's whole `ec_cache` tensor, [num_tokens, out_hidden * (1 + deepstack_levels)], unsplit: what
    vLLM's encoder cache holds (and ECExampleConnector loads). Raises as read_embeddings does."""
    fd, where = open_entry(root, key)
    try:
        return _read_entry(fd, where, mmap)[0]
    finally:
        os.close(fd)


def read_open_ec_cache(fd: int, where: str) -> torch.Tensor:
    """The whole `ec_cache` tensor of an entry file a caller holds open (from its start; the handle stays
    the caller's), e.g. one held since an existence check, which an eviction since cannot take away
    (lm/ecload.py). `where` names the file in errors. StoreFormatError for a file that is not a whole one."""
    os.lseek(fd, 0, os.SEEK_SET)
    return _read_entry(fd, where, False)[0]


def read_entry_data(root: Path, item: StoredItem) -> bytearray:
    """The tensor bytes of the entry `item` names ([shape] of its dtype, rows in order), without torch, for a
    process that only passes them on. KeyError if the entry is gone, StoreFormatError if the file there now
    is not that entry (another shape, dtype or source)."""
    fd, where = open_entry(root, item.key)
    try:
        h = _read_header(fd, where)
        if (h.shape, h.dtype, h.grid_thw) != (tuple(item.shape), item.dtype, tuple(item.grid_thw)) or (
                item.content_sha256 and h.metadata.get("content_sha256") != item.content_sha256):
            raise StoreFormatError(f"{where}: holds a {list(h.shape)} {h.dtype} entry, not the one answered "
                                   f"({list(item.shape)} {item.dtype})")
        data = bytearray(h.data_nbytes)  # (read into once: no second copy of a 4 MB entry into bytes)
        _read_into(fd, memoryview(data), where)
        return data
    finally:
        os.close(fd)


def open_entry_model(fd: int, where: str) -> str:
    """The encoder model an open entry file's header names (the file's position is put back to 0);
    StoreFormatError if the header is not one of this store's."""
    try:
        return _read_header(fd, where).model
    finally:
        os.lseek(fd, 0, os.SEEK_SET)


def open_entry(root: Path, key: str) -> tuple[int, str]:
    """An open read-only handle on the key's file and the file's path; KeyError if it is not there."""
    path = _key_dir(Path(root), key) / FILE_NAME
    try:
        return os.open(path, os.O_RDONLY | _O_CLOEXEC), str(path)
    except (FileNotFoundError, NotADirectoryError):
        raise KeyError(key) from None


def _read_entry(fd: int, where: str, mmap: bool) -> tuple[torch.Tensor, _Header]:
    """The ec_cache tensor and the checked header of an open entry file (read from its position 0)."""
    import torch

    h = _read_header(fd, where)
    n, width = h.shape
    offset = 8 + h.header_len
    torch_dtype = getattr(torch, h.dtype)  # torch.float32 | torch.bfloat16
    if h.data_nbytes == 0:
        ec_cache = torch.empty((n, width), dtype=torch_dtype)
    elif mmap and offset % h.itemsize == 0:  # safetensors pads headers to 8 bytes
        mapped = _mmap.mmap(fd, 0, access=_mmap.ACCESS_COPY)  # the tensor holds the only reference
        ec_cache = torch.frombuffer(mapped, dtype=torch_dtype, count=n * width, offset=offset)
        ec_cache = ec_cache.view(n, width)
    else:
        data = torch.empty(h.data_nbytes, dtype=torch.uint8)  # [data_nbytes] uint8, no zero fill
        _read_into(fd, memoryview(data.numpy()), where)
        ec_cache = data.view(torch_dtype).view(n, width)  # little-endian, like every host we run on
    return ec_cache, h
