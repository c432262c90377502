"""What the vLLM connector (lm/vllm_connector.py) does with the store, without vLLM: find an entry at vLLM's
scheduler-side existence check, hold it until vLLM's workers have loaded it, and load it. Plain Python
and torch, so it is tested without vLLM.

vLLM checks in its scheduler (`has_cache_item`) and loads later in each worker (`start_load_caches`),
usually in another process. An entry evicted in between makes the load fail in the middle of a model
step (vLLM's ECExampleConnector: FileNotFoundError; then "Encoder cache miss"), which takes the whole
engine down. Holding closes that window:

- Directory store: the check opens the entry's file and the scheduler keeps the handle until the workers
  report the load. The writer's eviction only unlinks a file and a replacement renames a new file over
  it, so the held inode stays whole and readable (POSIX). A worker reopens it through
  `/proc/<scheduler pid>/fd/<n>` (on Linux that opens the inode itself, unlinked or not), checked to be
  the inode the scheduler holds; where it cannot (a worker on another host sharing the directory, or in
  another PID namespace) it opens the entry by its path, as ECExampleConnector does, and only there the
  window stays open.
- Mooncake Store: the check reads the entry's companion and asks for the value (`is_exist`), which takes
  the master's lease on it (`--default_kv_lease_ttl`): the master does not evict it during the lease.
  The worker reads it by key. A host lost with its segment can still take it away: that load fails.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING

from service.store.options import MOONCAKE_SCHEME, MOONCAKE_TIMEOUT_S, parse_mooncake
from service.store.format import FILE_NAME, StoreFormatError, open_entry, open_entry_model, read_open_ec_cache
from service.store.keys import is_store_key
from service.store.reader import Reader, open_reader

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


@dataclass(frozen=True, kw_only=True)
class EntryOptions:
    """Where the entries are: vLLM's `ec_connector_extra_config`, named as `serve`'s flags are."""

    store: str  # the encoders' --store: a directory on this host, or mooncake://MASTER_HOST:RPC_PORT
    mooncake_namespace: str | None = None  # the encoders' namespace (their --mooncake-namespace)
    mooncake_local_host: str = "127.0.0.1"  # the address the pool's hosts reach this one at
    mooncake_protocol: str = "tcp"  # "tcp" | "rdma"
    # The longest one Mooncake call may take (the encoders' --mooncake-timeout-s): the check runs in vLLM's
    # scheduler loop, so a host that does not answer must cost it this, not the transfer engine's minute.
    mooncake_timeout_s: float = MOONCAKE_TIMEOUT_S
    # Whose embeddings vLLM may load, as the encoders' /ready names their model (`consume --encoder-model`):
    # "auto", the vision tower of vLLM's own model where that is a local checkpoint directory (no check for
    # a hub name, whose files are not known here); "any", no check; else that id.
    encoder_model: str = "auto"

    @classmethod
    def from_config(cls, extra: dict) -> EntryOptions:
        """Checked options from vLLM's `ec_connector_extra_config`; ValueError saying what to fix."""
        names = [f.name for f in fields(cls)]
        unknown = sorted(set(extra) - set(names))
        if unknown:
            raise ValueError(f"ec_connector_extra_config: unknown {unknown}; this connector takes {names}")
        if not isinstance(extra.get("store"), str) or not extra["store"]:
            raise ValueError("ec_connector_extra_config needs 'store': the encoders' --store (a directory on this "
                             "host, or mooncake://MASTER_HOST:RPC_PORT)")
        opts = cls(**extra)
        if opts.store.startswith(MOONCAKE_SCHEME):
            parse_mooncake(opts.store)  # (raises, saying how to write it)
            if not opts.mooncake_namespace:
                raise ValueError("ec_connector_extra_config needs 'mooncake_namespace' with a mooncake:// store: the "
                                 "encoders' --mooncake-namespace (with their default, the part of an /encode item's "
                                 "store_key before '@id:')")
        if opts.mooncake_protocol not in ("tcp", "rdma"):
            raise ValueError(f"mooncake_protocol must be 'tcp' or 'rdma', not {opts.mooncake_protocol!r}")
        if not isinstance(opts.encoder_model, str) or not opts.encoder_model:
            raise ValueError("encoder_model must be 'auto', 'any' or an encoder model id (the encoders' /ready "
                             f"`model`), not {opts.encoder_model!r}")
        if type(opts.mooncake_timeout_s) not in (int, float) or not opts.mooncake_timeout_s > 0:
            raise ValueError(f"mooncake_timeout_s must be a number of seconds above 0, not {opts.mooncake_timeout_s!r}")
        return opts


def encoder_model_for(opts: EntryOptions, lm_model: str | None) -> str | None:
    """The encoder model whose entries vLLM serving `lm_model` (its model_config.model) may load; None: any."""
    if opts.encoder_model == "any":
        return None
    if opts.encoder_model != "auto":
        return opts.encoder_model
    if lm_model is None or not Path(lm_model).is_dir():
        log.info("vLLM's model %r is not a local checkpoint directory: entries of any encoder model are loaded "
                 "(ec_connector_extra_config's encoder_model names the one to hold them to)", lm_model)
        return None
    from service.engine.loader import checkpoint_model_id

    try:
        return checkpoint_model_id(Path(lm_model))
    except (OSError, ValueError) as e:
        log.warning("cannot tell the vision tower of %s (%s): entries of any encoder model are loaded", lm_model, e)
        return None


class _Identity:
    """Whether an entry's model is the one its reader serves (same_tower), warning once per other model."""

    def __init__(self, model: str | None):
        self.model, self._warned = model, set()

    def ours(self, key: str, model: str | None) -> bool:
        from service.engine.loader import same_tower

        if self.model is None or same_tower(model, self.model):
            return True
        if model not in self._warned:
            self._warned.add(model)
            log.warning("store entry %s was written by the encoder model %s, not %s, whose embeddings this LM "
                        "reads: such entries are not found (vLLM encodes those images itself)", key, model,
                        self.model)
        return False


@dataclass(frozen=True)
class Held:
    """An entry found at the scheduler's check: what the connector's metadata carries to the workers
    (pickled by vLLM: plain fields only)."""

    key: str  # vLLM's mm_hash: the /encode key (the request's uuid)
    hold: int  # the scheduler's id for what it keeps for this entry, reported back once loaded; 0: nothing
    handle: str | None = None  # directory: "/proc/<scheduler pid>/fd/<n>", the scheduler's open handle
    inode: tuple[int, int] | None = None  # directory: (st_dev, st_ino) of the file that handle holds
    shape: tuple[int, int] | None = None  # Mooncake: the [rows, width] the check found, which the load must read
    dtype: str | None = None  # Mooncake: likewise ("float32" | "float16" | "bfloat16")


class DirectoryEntries:
    """Entries of a store directory on this host (read-only is enough), held open from check to load."""

    def __init__(self, root: str | Path, model: str | None = None):
        self.root = Path(root)
        self._identity = _Identity(model)  # None: entries of any encoder model
        self._handles: dict[int, int] = {}  # hold id -> open fd (scheduler side)
        self._next = 1
        self._warned = False

    def hold(self, key: str) -> Held | None:
        """The entry, held open until `release`; None if there is none (a key no entry can have, too:
        vLLM's own content hashes with a LoRA prefix, say)."""
        if not is_store_key(key):
            return None
        try:
            fd, where = open_entry(self.root, key)
        except KeyError:
            return None
        try:
            mine = self._identity.ours(key, open_entry_model(fd, where))
        except StoreFormatError:
            mine = False  # (not a whole entry of this store: the encoder writes it again)
        if not mine:
            os.close(fd)
            return None
        st = os.fstat(fd)
        hold, self._next = self._next, self._next + 1
        self._handles[hold] = fd
        return Held(key, hold, handle=f"/proc/{os.getpid()}/fd/{fd}", inode=(st.st_dev, st.st_ino))

    def release(self, hold: int) -> None:
        fd = self._handles.pop(hold, None)
        if fd is not None:
            os.close(fd)

    @property
    def held(self) -> int:
        """How many entries are held now."""
        return len(self._handles)

    def load(self, held: Held) -> torch.Tensor:
        """The held entry's whole tensor, read through the scheduler's handle (see the module docstring);
        KeyError if that cannot be reached and the entry is gone from its path."""
        fd = self._reopen(held)
        try:
            return read_open_ec_cache(fd, str(self.root / held.key / FILE_NAME))
        finally:
            os.close(fd)

    def _reopen(self, held: Held) -> int:
        try:
            fd = os.open(held.handle, os.O_RDONLY | _O_CLOEXEC)
        except OSError as e:
            why = f"{held.handle}: {e.strerror}"
        else:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) == held.inode:
                return fd
            os.close(fd)  # another process's file under that number (another host or PID namespace)
            why = f"{held.handle} is not the scheduler's handle here"
        if not self._warned:
            self._warned = True
            log.warning("cannot reach the vLLM scheduler's handle on a store entry (%s): loading entries by path, "
                        "so one evicted between vLLM's check and its load fails that load", why)
        return open_entry(self.root, held.key)[0]

    def close(self) -> None:
        for hold in list(self._handles):
            self.release(hold)


class MooncakeEntries:
    """Entries in Mooncake Store, held by the master's lease from check to load.

    Anyone can write a pool's keys (Mooncake has no authentication) and a vLLM deployment shares the
    namespace, so an entry is found only if it is whole and consistent: its companion parses, its value's
    24-byte header and size agree with it (read from the value's host, without the tensor), and its dtype
    is the namespace's. Anything else is not found, and vLLM encodes the image itself."""

    def __init__(self, reader: Reader, namespace: str | None = None, model: str | None = None):
        self.reader = reader
        self._identity = _Identity(model)  # None: entries of any encoder model
        dtype = re.search(r"@dtype:torch\.(\w+)@", namespace or "")
        self.dtype = dtype.group(1) if dtype else None  # the deployment's, as its namespace names it

    @classmethod
    def open(cls, opts: EntryOptions, model: str | None = None) -> MooncakeEntries:
        return cls(open_reader(opts.store, namespace=opts.mooncake_namespace, local_host=opts.mooncake_local_host,
                               protocol=opts.mooncake_protocol, timeout_s=float(opts.mooncake_timeout_s)),
                   opts.mooncake_namespace, model)

    def hold(self, key: str) -> Held | None:
        # NOTE: `entry` ends with the read of the value's header, which takes the master's lease on it.
        meta = self.reader.entry(key) if is_store_key(key) else None
        if meta is None or (self.dtype is not None and meta.dtype != self.dtype):
            return None
        if not self._identity.ours(key, meta.model):
            return None
        return Held(key, 0, shape=(meta.num_tokens, meta.width), dtype=meta.dtype)

    def release(self, hold: int) -> None:
        pass  # (the lease runs out by itself)

    @property
    def held(self) -> int:
        return 0

    def load(self, held: Held) -> torch.Tensor:
        """The entry's tensor; KeyError if it is gone or is no longer what the check found."""
        ec_cache = self.reader.read_ec_cache(held.key)
        if tuple(ec_cache.shape) != held.shape or str(ec_cache.dtype).removeprefix("torch.") != held.dtype:
            raise KeyError(f"{held.key}: a {held.dtype} {list(held.shape)} entry at the check, "
                           f"{ec_cache.dtype} {list(ec_cache.shape)} at the load")
        return ec_cache

    def close(self) -> None:
        self.reader.close()


def open_entries(opts: EntryOptions, model: str | None = None) -> DirectoryEntries | MooncakeEntries:
    """The entries of `opts.store`, of the encoder model `model` only (None: any; encoder_model_for)."""
    if opts.store.startswith(MOONCAKE_SCHEME):
        return MooncakeEntries.open(opts, model)
    return DirectoryEntries(opts.store, model)
