"""Store keys, in one place: what a key may be, the content key of a request sent without a uuid, the salt
that makes the same bytes another key under another model or preprocessing, and the shard that owns a key.

    a client key   the request's `uuid`, used verbatim (vLLM uses it as the item's mm_hash): KEY_RE
    a content key  "sha256+<hex>": SHA-256 of (salt, the bytes' SHA-256). Its '+' is outside KEY_RE, so
                   no client uuid can name (and poison) one
    the salt       model identity, preprocessing, dtype (and an FP8 tower's GEMMs and bf16 blocks); a
                   video's adds every video setting, so a video is never an image's key
    the shard      which engine (with several --devices) writes, indexes and evicts a key
    vLLM's key     with --vllm-model-id, an item without a uuid is keyed as vLLM keys it (its mm_hash), so that
                   vLLM's own LM, which computes that key itself, finds the entry (VllmKeys)

The standard library only (blake3, vLLM's default hash, where it is asked for): an LM server imports it with
the store's reader.
"""

from __future__ import annotations

import hashlib
import re
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from service.errors import RequestError

KEY_RE = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}$")  # client keys (`uuid`), used verbatim
CONTENT_KEY_PREFIX = "sha256+"
CONTENT_KEY_RE = re.compile(r"^sha256\+[0-9a-f]{64}$")


def is_store_key(key: object) -> bool:
    """A client key or a content key: one safe path component either way."""
    # NOTE: fullmatch, not match: with `re.match`, "$" also matches before a trailing "\n".
    return isinstance(key, str) and key not in (".", "..") and (
        KEY_RE.fullmatch(key) is not None or CONTENT_KEY_RE.fullmatch(key) is not None)


def validate_key(key: str, *, content_keys: bool = True) -> str:
    """Return `key` if it is a store key, else raise `invalid_key`. `content_keys=False` (a client's
    `uuid`): only KEY_RE, so a client cannot take a content key."""
    ok = is_store_key(key) if content_keys else (isinstance(key, str) and key not in (".", "..")
                                                   and KEY_RE.fullmatch(key) is not None)
    if not ok:
        shown = repr(key) if len(repr(key)) <= 80 else repr(key)[:77] + "..."
        raise RequestError(
            f"invalid key {shown}: a key is 1-128 ASCII characters from [A-Za-z0-9._-] "
            "and must not start with '.'; leave 'uuid' out to use a content hash", code="invalid_key"
        )
    return key


def key_salt(model_id: str, params: object, dtype: str, fp8_gemms: Iterable[str] = (),
             fp8_blocks: Iterable[int] = ()) -> str:
    """Part of every content key: the same bytes under another model, preprocessing (`params`: its repr),
    dtype (torch's name, "torch.bfloat16") or FP8 plan are another key."""
    fp8_blocks = list(fp8_blocks)
    fp8 = f"|fp8 {'+'.join(fp8_gemms)} blocks {','.join(map(str, fp8_blocks))}" if fp8_blocks else ""
    return f"{model_id}|{params}|{dtype}{fp8}"


def video_salt(salt: bytes, video: object) -> bytes:
    """A video's part of the content key: the model's salt and every video setting (`video`: VideoParams,
    its repr: sampling, sizes, normalization), so the same file under other video settings is another
    key, and never an image's."""
    return salt + b"|video|" + repr(video).encode()


def content_key(salt: bytes, sha256: bytes) -> str:
    """The key of an image sent without a uuid: a hash of the model and preprocessing (`salt`) and of the
    image bytes' SHA-256, so the same bytes under another model are another key; its prefix keeps it out
    of uuid space. (The bytes are hashed once: the key hashes their digest.)"""
    h = hashlib.sha256(salt)
    h.update(b"\0")
    h.update(sha256)
    return CONTENT_KEY_PREFIX + h.hexdigest()


def shard_of(key: str, n: int) -> int:
    """The shard (engine, with several --devices) that owns `key`: the only process that writes, indexes
    and evicts it, so dedupe and coalescing stay exact. The same in every process and every run
    (blake2b of the key; Python's hash() is salted per process)."""
    if n == 1:
        return 0
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little") % n


# ---- vLLM's item keys --------------------------------------------------------------------------------------
# What vLLM's multimodal/hasher.py feeds its digest: every chunk preceded by its 8-byte little-endian length,
# every value by a tag (none, sequence, mapping, leaf) and a container by its length too, so that the stream
# decodes one way only. `MultiModalHasher.hash_kwargs(algorithm, model_id=..., image=item)` hashes the
# keyword arguments sorted by name, each as its name then its value.
_TAG_NONE, _TAG_SEQUENCE, _TAG_MAPPING, _TAG_LEAF = b"\x00", b"\x01", b"\x02", b"\x03"
HASH_ALGORITHMS = ("blake3", "sha256", "sha512")
# How vLLM's ImageMediaIO records a decode that changed an image (its mode converted to RGB, transparency
# composited on white): beside the bytes, so the key differs from the same bytes loaded unconverted. These
# are its defaults; a vLLM deployment that sets --media-io-kwargs image_mode or rgba_background_color keys
# its images otherwise.
VLLM_IO_CONFIG = {"image_mode": "RGB", "rgba_background_color": (255, 255, 255)}


def _framed(chunk: bytes) -> Iterator[bytes]:
    yield len(chunk).to_bytes(8, "little")
    yield chunk


def _leaf(value: object) -> Iterator[bytes]:
    """vLLM's serialize_item for what a key is made of: bytes, text, an int or a float (numpy's scalar bytes:
    int64 and float64)."""
    if isinstance(value, bytes):
        yield from _framed(value)
    elif isinstance(value, str):
        yield from _framed(value.encode("utf-8"))
    elif isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"no key serialization for {type(value).__name__}: this is a bug")
    else:
        yield from _framed(struct.pack("<q", value) if isinstance(value, int) else struct.pack("<d", value))


def _value(value: object) -> Iterator[bytes]:
    """vLLM's iter_value_to_bytes."""
    if value is None:
        yield _TAG_NONE
    elif isinstance(value, (list, tuple)):
        yield _TAG_SEQUENCE
        yield len(value).to_bytes(8, "little")
        for v in value:
            yield from _value(v)
    elif isinstance(value, dict):
        yield _TAG_MAPPING
        yield len(value).to_bytes(8, "little")
        for k, v in value.items():
            yield from _framed(str(k).encode("utf-8"))
            yield from _value(v)
    else:
        yield _TAG_LEAF
        yield from _leaf(value)


def _item(name: str, value: object) -> Iterator[bytes]:
    """vLLM's iter_item_to_bytes: the name, then the value."""
    yield from _framed(name.encode("utf-8"))
    yield from _value(value)


class _ImageBytes:
    """An image as vLLM's hasher sees it after ImageMediaIO.load_bytes: its original bytes, with the io_config
    when loading converted it (a leaf whose serialization is itself an item named "image")."""

    def __init__(self, data: bytes, converted: bool):
        self.data, self.converted = data, converted

    def chunks(self) -> Iterator[bytes]:
        value = {"io_config": VLLM_IO_CONFIG, "data": self.data} if self.converted else self.data
        yield from _item("image", value)


@dataclass(frozen=True)
class VllmKeys:
    """vLLM's key (mm_hash) of an item: `hash_kwargs(algorithm, model_id=<the LM's model argument>, image=...)`,
    hex. NOTE: vLLM also lets an EXIF ImageID that is a uuid.UUID stand for the image; PIL reads EXIF values
    as str or bytes, never uuid.UUID, so with PIL's decoding that never applies and is not reproduced."""

    model_id: str  # what the LM's `vllm serve` was given (its model_config.model)
    algorithm: str = "blake3"  # --mm-hasher-algorithm

    def __post_init__(self) -> None:
        if self.algorithm not in HASH_ALGORITHMS:
            raise ValueError(f"hash algorithm must be one of {', '.join(HASH_ALGORITHMS)}, got {self.algorithm!r}")

    def _hasher(self):
        if self.algorithm == "blake3":
            from blake3 import blake3  # (vLLM's default; the others are the standard library's)

            return blake3()
        return hashlib.new(self.algorithm)

    def image(self, data: bytes, converted: bool) -> str:
        """The key of an image's encoded bytes; `converted`: vLLM's loading changes its mode (not RGB, or with
        transparency: media/images.py's vllm_converts)."""
        h = self._hasher()
        # The kwargs by name, "image" before "model_id"; the image's value is a leaf (MediaWithBytes) whose
        # serialization is an item "image" of its own.
        for chunk in (*_framed(b"image"), _TAG_LEAF, *_ImageBytes(data, converted).chunks(),
                      *_item("model_id", self.model_id)):
            h.update(chunk)
        return h.hexdigest()
