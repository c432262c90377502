"""The `Store` protocol: what the engine (its host and its writer) and the API side need of an embedding
store, whichever backend holds it. service/store/__init__.py's `open_store` picks the backend; nothing
outside service/store/ names one.

    find(key)            the entry, if the store holds one for this model: a future, done at once where the
                         answer is at hand (a directory's index), later where it is a round trip (Mooncake)
    known(key)           what this process knows of `key` without a round trip (its index, its recent writes)
    reserve(...)         the first half of a write, before the embeddings exist (while the device computes)
    commit(pending, rows, answer) / commit_step(pendings, rows, answer)
                         the second half: one entry, or a step's entries (the backend shares them among
                         its writer threads or puts them in one call); each is answered once it is stored
    abort(pending)       give a reservation up
    prepare_next(like)   make ahead what the next lone entry of its size takes (a directory's spare file)
    read(key)            an entry's embeddings, as a consumer reads them
    evict(key)           remove an entry (a stale or contradicted one)
    health()             why the store cannot take writes now, or None
    stats()              entries, bytes and evictions, for /metrics
    close()

A write is reserve + commit; `put` does both at once (tests, tools).
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from service.store.format import StoredEmbeddings, StoredItem, VideoMeta

if TYPE_CHECKING:
    import torch

# A lookup's outcome: the entry, None (a miss), or the error that answers whoever asked (`store_unavailable`).
Found = concurrent.futures.Future  # [StoredItem | None]
# An entry's answer at commit: its StoredItem, or the error that answers its waiters.
Answer = Callable[[int, "StoredItem | Exception"], None]


@dataclass(frozen=True)
class Identity:
    """Whose embeddings a store holds. An entry of another model, width or dtype is never a hit."""

    model_id: str
    out_hidden_size: int
    deepstack_levels: int
    dtype: str  # "float32" | "bfloat16"
    salt: str  # the model's key salt (store/keys.key_salt); Mooncake's default namespace is a hash of it


@dataclass(frozen=True)
class StoreStats:
    entries: int  # entries this store holds (Mooncake: that this engine wrote since it started)
    bytes_used: int
    evictions: int  # since start (Mooncake: the master evicts, unseen here: 0)
    timeouts: dict[str, int] = field(default_factory=dict)  # store calls past their deadline since start, by kind


def answered(value: StoredItem | None) -> Found:
    """A lookup answered at once."""
    found: Found = concurrent.futures.Future()
    found.set_result(value)
    return found


class Store(Protocol):
    location: str  # what /ready names: the root directory, or the mooncake:// URL

    def find(self, key: str) -> Found: ...

    def known(self, key: str) -> StoredItem | None: ...

    def reserve(self, key: str, shape: tuple[int, int], dtype: torch.dtype, grid_thw, content_sha256: str | None = None,
                video: VideoMeta | None = None, *, lone: bool = False) -> Any:
        """Check room and prepare the entry's write. `lone`: an entry whose write delays its answer (a lone
        image): the backend may spend more now (a directory maps its file) to make the commit shorter."""

    def commit(self, pending: Any, ec_cache: torch.Tensor,
               answer: Callable[[StoredItem | Exception], None] | None = None) -> StoredItem | None:
        """Write and publish one entry; `answer(item)` once it is published (before any tidying). On failure
        it raises (before any answer) and the reservation is given up, except for a write past the store's
        deadline (Mooncake): that one is answered `answer(error)` at the deadline, and commit returns (None)
        once nothing reads `ec_cache` any more."""

    def commit_step(self, pendings: list, rows: list[torch.Tensor], answer: Answer) -> None:
        """Write a step's entries; answer(i, item or error) once for each, as each is published."""

    def abort(self, pending: Any) -> None: ...

    def prepare_next(self, like: Any) -> bool: ...

    def put(self, key: str, ec_cache: torch.Tensor, grid_thw, content_sha256: str | None = None,
            video: VideoMeta | None = None) -> StoredItem: ...

    def read(self, key: str) -> StoredEmbeddings:
        """KeyError if the store does not hold `key`."""

    def evict(self, key: str) -> bool:
        """Remove `key`'s entry; whether there was one."""

    def health(self) -> str | None: ...

    def stats(self) -> StoreStats: ...

    def close(self) -> None: ...
