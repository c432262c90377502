"""The embedding store: where each image's embeddings go, for the LM servers to read.

    base.py      the Store protocol the engine and the API side use, whatever the backend
    directory.py a directory in vLLM's ECExampleConnector layout (--store DIR): files.py writes and owns
                 its files, index.py keeps its LRU order and minimum residency
    mooncake.py  Mooncake Store, one pool across hosts (--store mooncake://MASTER:PORT)
    format.py    the file layout and the consumer's reader (no torch at import); reader.py: either backend
    keys.py      what a key is, content keys, salts, shards
    options.py   what a store is opened with (Settings.store_options)

`open_store(options, identity)` is the one place that picks a backend: nothing outside this package
imports a backend module.
"""

from __future__ import annotations

from pathlib import Path

from service.store.base import Identity, Store, StoreStats
from service.store.directory import DirectoryStore
from service.store.files import RootLock
from service.store.files import lock_root as _lock_root
from service.store.mooncake import MooncakeStore
from service.store.options import StoreOptions

__all__ = ["Identity", "Store", "StoreStats", "open_store", "lock_root"]


def open_store(options: StoreOptions, identity: Identity, shard: tuple[int, int] = (0, 1)) -> Store:
    """The store of one engine: a directory (shard (i, n) of n engines gets 1/n of the capacity, and only
    its keys), or Mooncake Store (one pool whatever the shard; the pool's master evicts)."""
    if options.mooncake is not None:
        return MooncakeStore(str(options.root), options.mooncake, model_id=identity.model_id,
                             out_hidden_size=identity.out_hidden_size, deepstack_levels=identity.deepstack_levels,
                             dtype=identity.dtype, min_residency_s=options.min_residency_s, salt=identity.salt)
    return DirectoryStore(
        Path(options.root), options.capacity_bytes // shard[1], model_id=identity.model_id,
        out_hidden_size=identity.out_hidden_size, deepstack_levels=identity.deepstack_levels,
        dtype=identity.dtype, min_residency_s=options.min_residency_s, exclusive=True, group=options.group,
        shard=shard, writers=options.writers,
    )


def lock_root(root: Path, group: str | None) -> RootLock:
    """A directory store's root checked as the service's own and locked, without opening the store: what
    preflight checks (then closes), and what the supervisor of a sharded service holds until it exits.
    Raises StoreOwnershipError saying why not."""
    return _lock_root(root, group)
