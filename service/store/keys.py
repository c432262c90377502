"""Store keys, in one place: what a key may be, the content key of a request sent without a uuid, the salt
that makes the same bytes another key under another model or preprocessing, and the shard that owns a key.

    a client key   the request's `uuid`, used verbatim (vLLM uses it as the item's mm_hash): KEY_RE
    a content key  "sha256+<hex>": SHA-256 of (salt, the bytes' SHA-256). Its '+' is outside KEY_RE, so
                   no client uuid can name (and poison) one
    the salt       model identity, preprocessing, dtype (and an FP8 tower's GEMMs and bf16 blocks); a
                   video's adds every video setting, so a video is never an image's key
    the shard      which engine (with several --devices) writes, indexes and evicts a key

The standard library only: an LM server imports it with the store's reader.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable

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
