"""The consumer's side of the store, whichever backend holds it: `open_reader(store)` for a directory
(`/dev/shm/...`, vLLM's ECExampleConnector layout) or Mooncake Store (`mooncake://MASTER:PORT`,
service/store/mooncake.py). An LM server (the bundled consumer, vLLM through lm/vllm_connector.py)
reads each key's embeddings with `read`, and asks `exists` where it only needs to know.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from service.store.options import MOONCAKE_SCHEME
from service.store.format import (FILE_NAME, StoredEmbeddings, StoredItem, _key_dir, read_ec_cache, read_entry_data,
                                  read_embeddings as format_read_embeddings)
from service.store.mooncake import MooncakeReader

if TYPE_CHECKING:
    import torch


class Reader(Protocol):
    def read(self, key: str, store_key: str | None = None) -> StoredEmbeddings:
        """The key's embeddings; KeyError if it is not in the store (never written, evicted, or its host
        lost), StoreFormatError for an entry that is not a whole one of this format. `store_key`: the
        /encode item's, where it has one (a Mooncake key names its namespace)."""

    def read_ec_cache(self, key: str, store_key: str | None = None) -> torch.Tensor:
        """The key's whole tensor, [num_tokens, out_hidden * (1 + deepstack_levels)] (main, then each
        deepstack tap), as stored: what vLLM's encoder cache holds. Raises as `read` does."""

    def exists(self, key: str, store_key: str | None = None) -> bool: ...

    def read_data(self, item: StoredItem) -> bytearray | memoryview:
        """The tensor bytes of the entry an /encode answer named (no torch): for a process that passes them
        on. KeyError if it is gone, StoreFormatError if what is there now is not that entry."""

    def close(self) -> None: ...


class DirectoryReader:
    """A store directory on this machine (read-only is enough)."""

    def __init__(self, root: Path):
        self.root = Path(root)

    def read(self, key: str, store_key: str | None = None) -> StoredEmbeddings:
        return format_read_embeddings(self.root, key)

    def read_ec_cache(self, key: str, store_key: str | None = None) -> torch.Tensor:
        return read_ec_cache(self.root, key)

    def exists(self, key: str, store_key: str | None = None) -> bool:
        return (_key_dir(self.root, key) / FILE_NAME).is_file()

    def read_data(self, item: StoredItem) -> bytearray:
        return read_entry_data(self.root, item)

    def close(self) -> None:
        pass


def is_mooncake(store: str | Path) -> bool:
    return str(store).startswith(MOONCAKE_SCHEME)


def open_reader(store: str | Path, **mooncake) -> Reader:
    """A reader of `store`: a directory path, or `mooncake://MASTER_HOST:RPC_PORT` (then `mooncake` holds
    the client options of service/store/mooncake.py's MooncakeReader)."""
    if is_mooncake(store):
        return MooncakeReader.open(str(store), **mooncake)
    return DirectoryReader(Path(store))


@functools.lru_cache(maxsize=8)
def _cached_reader(store: str, namespace: str | None, local_host: str) -> Reader:
    return open_reader(store, namespace=namespace, local_host=local_host) if is_mooncake(store) else open_reader(store)


def read_embeddings(store: str | Path, key: str, *, store_key: str | None = None, namespace: str | None = None,
                    local_host: str = "127.0.0.1") -> StoredEmbeddings:
    """One key's embeddings from either backend, for scripts and consumers that read now and then: a
    directory (format.read_embeddings) or `mooncake://MASTER:PORT` (by the /encode item's `store_key`, or
    by `key` in `namespace`). Its Mooncake client is kept for the next call; an LM server that reads per
    request holds its own reader (`open_reader`)."""
    if not is_mooncake(store):
        return format_read_embeddings(Path(store), key)
    return _cached_reader(str(store), namespace, local_host).read(key, store_key)
