"""Mooncake Store as the embedding store: one pool of memory across hosts (each encoder host may add a
segment), so an LM server on any host reads an image's embeddings by key. `--store mooncake://MASTER:PORT`.

Per image, two objects under this service's namespace (vLLM 0.33's Mooncake embedding layout):

    <namespace>@id:<key>     the value vLLM reads: a 24-byte little-endian header struct("<IIQQ")
                             (magic 0x4D4F4F4E, dtype code 0 float32 / 11 float16 / 12 bfloat16,
                             num_tokens, hidden) then the contiguous [num_tokens, hidden] tensor: main
                             embeddings, then each deepstack tap (hidden = out_hidden * (1 + levels))
    <namespace>@meta:<key>   the companion: what a directory entry keeps in __metadata__ (grid_thw,
                             model, levels, content SHA-256, format version), JSON

`namespace` is vLLM's v3 form, `[prefix@]embedding@model:M@revision:R@encoder:E@dtype:D@protocol:v3`;
by default this service's own (E: a hash of its model and preprocessing), or, with
--mooncake-namespace, the one a vLLM deployment computes, to share entries with it.

The value is written before its companion, and a lookup needs both: a companion is never there
without its value. The companion is read, not only checked (existence answers can be stale after a
host is lost): a lookup whose read fails is a miss, and the image is encoded again. Both objects are
put into this host's segment when it has one, so a lost host loses both together.

Minimum residency: each put is soft-pinned for --store-min-residency-s, and a hit's existence check
takes a lease for the master's --default_kv_lease_ttl; run the master with a lease TTL of at least the
minimum residency (docs/multihost.md), so an entry /encode answered stays until a consumer has read it.
"""

from __future__ import annotations

import ctypes
import json
import logging
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from service.store.options import MOONCAKE_BUFFER_BYTES, MooncakeOptions, parse_mooncake
from service.errors import Unavailable
from service.store.base import Answer, Found, StoreStats
from service.store.format import FORMAT_VERSION, StoredEmbeddings, StoredItem, VideoMeta
from service.store.keys import validate_key
from service.store.lookups import Lookups
from service.store.pool import connect

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

MAGIC = 0x4D4F4F4E
HEADER = struct.Struct("<IIQQ")  # magic, dtype code, num_tokens, hidden
DTYPE_CODES = {"float32": 0, "float16": 11, "bfloat16": 12}  # vLLM 0.33's codes
# Mooncake's error codes met here (its ErrorCode enum): no space.
NO_SPACE = (-200, -201, -202)  # NO_AVAILABLE_HANDLE and the allocation failures
REFORM_S = 60.0  # after the master was seen down, "no room" means its hosts have not registered again yet
# Value headers read back per Mooncake call when hits are checked (_readable): a lookup batch is at most
# a step's images; more go in several calls.
PROBE_BATCH = 64
# What written_lately remembers: an entry this client put, for WRITTEN_S or until WRITTEN_MAX newer ones.
WRITTEN_S = 2.0
WRITTEN_MAX = 4096


def default_namespace(model_id: str, dtype: str, salt: str) -> str:
    """This service's own namespace in vLLM's v3 form: entries of another model, preprocessing or dtype
    never share a key with these."""
    import hashlib

    encoder = hashlib.sha256(salt.encode()).hexdigest()[:16]
    return f"embedding@model:{model_id}@revision:default@encoder:{encoder}@dtype:torch.{dtype}@protocol:v3"


def value_key(namespace: str, key: str) -> str:
    return f"{namespace}@id:{key}"


def meta_key(namespace: str, key: str) -> str:
    return f"{namespace}@meta:{key}"


def _replicate_config(pin_s: float, segment: str | None):
    """How every put of an engine is placed: one replica, soft-pinned for `pin_s`, in `segment` (this
    host's, where it has one: value and companion are then lost, or kept, together)."""
    from mooncake.store import ReplicateConfig, SoftPinAction

    cfg = ReplicateConfig()
    cfg.replica_num = 1
    if pin_s > 0:  # the minimum residency (see the module docstring)
        cfg.soft_pin_action = SoftPinAction.ENABLE
        cfg.soft_pin_ttl_ms = int(pin_s * 1000)
    if segment is not None:
        cfg.preferred_segment = segment  # (a segment is named by its client's host:port)
    return cfg


@dataclass
class MooncakePending:
    """A put in progress (MooncakeStore.reserve): what commit writes."""

    key: str
    shape: tuple[int, int]
    dtype: str
    grid: tuple[int, int, int]
    content_sha256: str | None
    video: VideoMeta | None = None


class MooncakeStore:
    """The engine's store in Mooncake (the Store protocol, service/store/base.py), with the values in vLLM's
    layout. A lookup is an RPC to the master: `find` answers from a thread of lookups batched together
    (service/store/lookups.py); a step's entries go in one call (commit_step). Thread-safe (the client is
    Mooncake's, which is)."""

    def __init__(self, url: str, options: MooncakeOptions, *, model_id: str, out_hidden_size: int,
                 deepstack_levels: int, dtype: str, min_residency_s: float, salt: str):
        self.location = url  # what /ready names as the store
        self.options = options
        self.model_id, self.out_hidden_size, self.deepstack_levels, self.dtype = (
            model_id, out_hidden_size, deepstack_levels, dtype)
        self.namespace = options.namespace or default_namespace(model_id, dtype, salt)
        self.min_residency_s = min_residency_s
        self.client = connect(options)
        self._config = _replicate_config(min_residency_s,
                                         self.client.get_hostname() if options.segment_bytes > 0 else None)
        self._lock = threading.Lock()
        self._written = 0  # entries this engine put since it started (the pool's own count is the master's)
        self._bytes = 0
        self.evictions = 0  # the master evicts; this engine does not see it
        self._outage_at = float("-inf")  # when the master last did not answer (see _error)
        self._recent: OrderedDict[str, tuple[float, StoredItem]] = OrderedDict()  # see written_lately
        # Where the hits' value headers land for _readable (Mooncake reads ranges only into registered
        # memory): PROBE_BATCH headers per call, allocated and registered once.
        self._probe = ctypes.create_string_buffer(HEADER.size * PROBE_BATCH)
        self._probe_lock = threading.Lock()
        if self.client.register_buffer(ctypes.addressof(self._probe), len(self._probe)) != 0:
            raise Unavailable("Mooncake's client could not register a buffer for value headers", code="store_unavailable")
        self._lookups = Lookups(self.lookup_many)

    # ---- what the engine's metrics and health read -------------------------------------------------
    @property
    def bytes_used(self) -> int:
        """Bytes this engine has put since it started (the pool holds others' too, and evicts)."""
        return self._bytes

    def __len__(self) -> int:
        return self._written

    def stats(self) -> StoreStats:
        return StoreStats(entries=self._written, bytes_used=self._bytes, evictions=self.evictions)

    def health(self) -> str | None:
        return self.unwritable

    @property
    def unwritable(self) -> str | None:
        """Why the pool cannot take writes now (its master unreachable), or None. Asked of the master
        each time (a failing call answers at once). A put that fails for another reason (a peer host
        lost) answers its own request 503; the next put may land elsewhere."""
        probe = self.client.is_exist(f"{self.namespace}@probe")
        if probe < 0:
            self._outage_at = time.monotonic()
            return f"the Mooncake master at {self.options.master} does not answer (error {probe})"
        return None

    def close(self) -> None:
        self._lookups.close()
        self.client.unregister_buffer(ctypes.addressof(self._probe))
        self.client.close()

    # ---- lookups and reads -----------------------------------------------------------------------------
    def find(self, key: str) -> Found:
        return self._lookups.lookup(key)

    def known(self, key: str) -> StoredItem | None:
        """What this engine wrote lately (written_lately): no round trip to the master."""
        return self.written_lately(key)

    def lookup(self, key: str) -> StoredItem | None:
        return self.lookup_many([key])[0]

    def read(self, key: str) -> StoredEmbeddings:
        return MooncakeReader(self.client, self.namespace).read(key)

    def evict(self, key: str) -> bool:
        validate_key(key)
        with self._lock:
            self._recent.pop(key, None)
        rcs = self.client.batch_remove([value_key(self.namespace, key), meta_key(self.namespace, key)], True)
        return any(rc == 0 for rc in rcs)

    def lookup_many(self, keys: list[str]) -> list[StoredItem | None]:
        """The stored item of each key if it is a hit for this model, read from its companion (a failed read:
        a lost host, an evicted entry: None, and the image is encoded again). One batch_is_exist for all
        the keys (most lookups are misses: one round trip to the master); the hits' companions and a read
        of their values' headers (_readable) cost two more, for all of them. `store_unavailable` if the master
        does not answer."""
        for key in keys:
            validate_key(key)
        here = self.client.batch_is_exist([meta_key(self.namespace, key) for key in keys])
        if len(here) != len(keys) or any(h < 0 for h in here):
            # the master does not answer: neither a hit nor a miss (a miss would be encoded for nothing)
            self._outage_at = time.monotonic()
            rc = min(here, default=-1)
            raise Unavailable(f"the Mooncake master at {self.options.master} does not answer (error {rc}); "
                                   "retry shortly", code="store_unavailable")
        present = [key for key, h in zip(keys, here, strict=True) if h == 1]
        if not present:
            return [None] * len(keys)
        # The hits' companions in one call, then their values' headers in one more (_readable).
        raws = self.client.get_batch([meta_key(self.namespace, key) for key in present])
        lost = [key for key, raw in zip(present, raws, strict=True) if not raw]
        if lost:
            # NOTE: it exists (the master said so) but cannot be read: its host is lost, and existence answers
            # stay stale until the master's client TTL. Removed now (force: past the lease), so that the
            # re-encode's put is a fresh one, not an update in place in the lost segment.
            self.client.batch_remove([k for key in lost for k in (meta_key(self.namespace, key),
                                                                   value_key(self.namespace, key))], True)
        metas = {key: meta for key, raw in zip(present, raws) if raw and (meta := self._ours(raw)) is not None}
        ours = list(metas)
        live = self._readable([value_key(self.namespace, key) for key in ours]) if ours else []
        found = {key: self._item(key, metas[key]) for key, ok in zip(ours, live, strict=True) if ok}
        return [found.get(key) for key in keys]

    def written_lately(self, key: str) -> StoredItem | None:
        """The entry this client put under `key` in the last WRITTEN_S, without asking the master: what
        the engine host checks at a submit (an image stored since its claim's lookup missed; see
        EngineHost._with_entry). Recorded in commit_many, before the writer answers anyone."""
        with self._lock:
            at, item = self._recent.get(key, (float("-inf"), None))
        return item if time.monotonic() - at <= WRITTEN_S else None

    def _item(self, key: str, meta: dict) -> StoredItem:
        return StoredItem(key=key, path=None, store_key=value_key(self.namespace, key), num_tokens=meta["num_tokens"],
                          grid_thw=tuple(meta["grid_thw"]), shape=(meta["num_tokens"], meta["width"]),
                          dtype=meta["dtype"], nbytes=HEADER.size + meta["nbytes"],
                          content_sha256=meta.get("content_sha256"),
                          video=VideoMeta(tuple(meta["frames_indices"]), float(meta["fps"]), tuple(meta["timestamps"]))
                          if meta.get("modality") == "video" else None)

    def _readable(self, vkeys: list[str]) -> list[bool]:
        """Whether each value's header reads back from its segment now: one replica lookup for them all
        (which also takes the leases that keep them while a consumer reads them) and a 24-byte transfer
        from each one's host, PROBE_BATCH values a call.

        NOTE: not is_exist: after a host is lost the master still answers 1 for its objects until its
        client TTL, and the companion alone may still read (seen once, in a fresh-clone run of
        test_multihost's SIGKILL test: a lost entry answered cached); a read from the value's own
        segment fails then."""
        ok: list[bool] = []
        base, size = ctypes.addressof(self._probe), HEADER.size
        with self._probe_lock:
            for start in range(0, len(vkeys), PROBE_BATCH):
                chunk = vkeys[start : start + PROBE_BATCH]
                ctypes.memset(base, 0, size * len(chunk))  # a failed range must not read as the last hit's
                got = self.client.get_into_ranges([base], [chunk], [[[i * size] for i in range(len(chunk))]],
                                                  [[[0]] * len(chunk)], [[[size]] * len(chunk)])
                read = got[0] if len(got) == 1 and len(got[0]) == len(chunk) else [[-1]] * len(chunk)
                ok += [r == [size] and HEADER.unpack_from(self._probe, i * size)[0] == MAGIC
                       for i, r in enumerate(read)]
        return ok

    def _ours(self, raw) -> dict | None:
        """A companion's metadata if it is an entry of this model (another model's entry under our
        namespace is no hit, cf. directory), else None."""
        try:
            meta = json.loads(bytes(raw))
        except ValueError:
            return None
        ours = (meta.get("format_version") == FORMAT_VERSION and meta.get("model") == self.model_id
                and meta.get("out_hidden_size") == self.out_hidden_size
                and meta.get("deepstack_levels") == self.deepstack_levels and meta.get("dtype") == self.dtype)
        return meta if ours else None

    # ---- writes ---------------------------------------------------------------------------------------
    def reserve(self, key: str, shape: tuple[int, int], dtype: torch.dtype, grid_thw,
                content_sha256: str | None = None, video: VideoMeta | None = None, *,
                lone: bool = False) -> MooncakePending:
        """The first half of a put: checks only; Mooncake allocates in the put itself (so `lone` changes
        nothing here)."""
        validate_key(key)
        name = str(dtype).removeprefix("torch.")
        n, width = shape
        assert name == self.dtype and width == self.out_hidden_size * (1 + self.deepstack_levels), \
            f"a {name} [{n}, {width}] entry for a {self.dtype} store of width {self.out_hidden_size}: this is a bug"
        return MooncakePending(key, (n, width), name, tuple(int(g) for g in grid_thw), content_sha256, video)

    def abort(self, pending: MooncakePending) -> None:
        pass  # nothing was written

    def prepare_next(self, like: MooncakePending) -> bool:
        """Nothing to make ahead for a lone image here: the put allocates."""
        return False

    def commit(self, pending: MooncakePending, ec_cache: torch.Tensor,
               answer: Callable[[StoredItem], None] | None = None) -> StoredItem:
        """Put one entry (commit_many's one). Raises `store_full` (the pool has no room) or Unavailable (the
        master or a peer is unreachable): 503 + Retry-After; nothing half-written is left as a hit.
        `answer(item)` once it is stored (nothing to tidy here)."""
        (out,) = self.commit_many([pending], [ec_cache])
        if isinstance(out, Exception):
            raise out
        if answer is not None:
            answer(out)
        return out

    def commit_step(self, pendings: list[MooncakePending], rows: list[torch.Tensor], answer: Answer) -> None:
        """A step's entries in one put (commit_many); each answered with its item or its error."""
        try:
            results = self.commit_many(pendings, rows)
        except Exception as e:  # the whole call failed: every entry of it has that answer
            results = [e] * len(pendings)
        for i, result in enumerate(results):
            answer(i, result)

    def commit_many(self, pendings: list[MooncakePending], tensors: list[torch.Tensor]) -> list[StoredItem | Exception]:
        """Put a step's entries, each value (header + the rows, read in place: no copy on this side) and
        its companion, in two Mooncake calls for the whole step: a forced remove of the keys (a put onto
        an existing key keeps the old object: a re-encode after a lost host, or an entry of another model
        under this key, must replace it, and a fresh put never writes into a lost host's segment), then
        one batch put from the rows' own memory. Each entry's result, or the error that answers it.

        NOTE: why batches: a Mooncake call releases the GIL and takes it back when it returns, and while
        the engine's other threads are busy in Python that wait can be a whole switch interval (5 ms).
        A probe (now in git history) on the 2-core CPU machine, one Python thread busy beside, 4 MB
        entries over TCP on loopback: entry by entry (two upsert_parts each) 82 entries/s, 16 per
        commit_many 866/s (alone: 894 and 2,595); one is_exist 250/s (alone 11,354).
        """
        n = len(pendings)
        metas, shapes = [], []
        for pending, ec_cache in zip(pendings, tensors, strict=True):
            rows, width = pending.shape
            assert tuple(ec_cache.shape) == (rows, width) and ec_cache.is_contiguous(), "rows do not match: this is a bug"
            nbytes = ec_cache.numel() * ec_cache.element_size()
            shapes.append(nbytes)
            meta = {"format_version": FORMAT_VERSION, "model": self.model_id,
                    "out_hidden_size": self.out_hidden_size, "deepstack_levels": self.deepstack_levels,
                    "dtype": pending.dtype, "grid_thw": list(pending.grid), "num_tokens": rows,
                    "width": width, "nbytes": nbytes, "content_sha256": pending.content_sha256}
            if pending.video is not None:  # the same fields as a directory entry's (VideoMeta.metadata)
                v = pending.video
                meta.update(modality="video", frames_indices=list(v.frames_indices), fps=float(v.fps),
                            timestamps=list(v.timestamps))
            metas.append(json.dumps(meta).encode())
        # The headers and companions in one small buffer of their own (kept alive until the put returns).
        small = ctypes.create_string_buffer(HEADER.size * n + sum(map(len, metas)) or 1)
        view, base = memoryview(small).cast("B"), ctypes.addressof(small)
        keys, ptrs, sizes = [], [], []
        for i, (pending, ec_cache) in enumerate(zip(pendings, tensors)):
            HEADER.pack_into(view, HEADER.size * i, MAGIC, DTYPE_CODES[pending.dtype], *pending.shape)
            keys.append(value_key(self.namespace, pending.key))
            ptrs.append([base + HEADER.size * i] + ([ec_cache.data_ptr()] if shapes[i] else []))
            sizes.append([HEADER.size] + ([shapes[i]] if shapes[i] else []))
        at = HEADER.size * n
        for pending, meta in zip(pendings, metas):
            view[at : at + len(meta)] = meta
            keys.append(meta_key(self.namespace, pending.key))
            ptrs.append([base + at])
            sizes.append([len(meta)])
            at += len(meta)
        self.client.batch_remove(keys, True)  # (absent keys answer an error: nothing to replace)
        rcs = self.client.batch_put_from_multi_buffers(keys, ptrs, sizes, config=self._config)
        out: list[StoredItem | Exception] = []
        for i, pending in enumerate(pendings):
            rv, rm = rcs[i], rcs[n + i]
            if rv != 0 or rm != 0:  # no value without its companion, nor a companion without its value
                self.client.remove(keys[n + i] if rv != 0 else keys[i], True)
                out.append(self._error(rv or rm))
                continue
            rows, width = pending.shape
            item = StoredItem(key=pending.key, path=None, store_key=keys[i], num_tokens=rows, grid_thw=pending.grid,
                              shape=(rows, width), dtype=pending.dtype, nbytes=HEADER.size + shapes[i],
                              content_sha256=pending.content_sha256, video=pending.video)
            with self._lock:
                self._written += 1
                self._bytes += HEADER.size + shapes[i] + len(metas[i])
                self._recent[pending.key] = (time.monotonic(), item)
                self._recent.move_to_end(pending.key)
                while len(self._recent) > WRITTEN_MAX:
                    self._recent.popitem(last=False)
            out.append(item)
        return out

    def put(self, key: str, ec_cache: torch.Tensor, grid_thw, content_sha256: str | None = None,
            video: VideoMeta | None = None) -> StoredItem:
        return self.commit(self.reserve(key, tuple(ec_cache.shape), ec_cache.dtype, grid_thw, content_sha256, video),
                           ec_cache)

    def _error(self, rc: int) -> Exception:
        if rc in NO_SPACE and time.monotonic() - self._outage_at < REFORM_S:
            # A master that came back knows no segment until the hosts register theirs again: no room
            # then is a pool still forming, not a full one.
            return Unavailable(f"the Mooncake pool is forming again after its master came back (error {rc}); "
                                   "retry shortly", code="store_unavailable")
        if rc in NO_SPACE:
            return Unavailable(f"the Mooncake pool has no room for this entry now (error {rc}): its segments are full "
                            "of pinned entries; retry shortly, or add segment space", retry_after_s=1, code="store_full")
        return Unavailable(f"the Mooncake pool did not take the entry (error {rc}: its master or a peer "
                               "unreachable?); retry shortly", code="store_unavailable")


class MooncakeReader:
    """The consumer's side (store/reader.py): a client only (no segment of its own), reading by key in
    `namespace`, or by an /encode item's whole `store_key` (which names its namespace)."""

    def __init__(self, client, namespace: str | None):
        self.client, self.namespace = client, namespace

    @classmethod
    def open(cls, url: str, *, namespace: str | None = None, local_host: str = "127.0.0.1", protocol: str = "tcp",
             buffer_bytes: int = MOONCAKE_BUFFER_BYTES) -> MooncakeReader:
        options = MooncakeOptions(master=parse_mooncake(url), local_host=local_host, segment_bytes=0,
                                  buffer_bytes=buffer_bytes, protocol=protocol, namespace=namespace)
        return cls(connect(options), namespace)

    def _keys(self, key: str, store_key: str | None) -> tuple[str, str]:
        """(value key, companion key) of `key`."""
        if store_key is not None:
            namespace, sep, named = store_key.rpartition("@id:")
            if not sep or named != key:
                raise ValueError(f"{store_key!r} is not the store key of {key!r}")
        else:
            namespace = self.namespace
            assert namespace is not None, "a key without its store_key needs the reader's namespace: this is a bug"
        return value_key(namespace, key), meta_key(namespace, key)

    def exists(self, key: str, store_key: str | None = None) -> bool:
        vkey, mkey = self._keys(key, store_key)
        return bool(self.client.get(mkey)) and self.client.is_exist(vkey) == 1

    def read(self, key: str, store_key: str | None = None) -> StoredEmbeddings:
        import torch

        from service.store.format import StoreFormatError

        vkey, mkey = self._keys(key, store_key)
        raw_meta = self.client.get(mkey)
        # NOTE: get_buffer, not get: the value lands in the client's buffer and is copied out once, into
        # the tensor (get returns a bytes object, which parsing would copy again: 787 -> 557 MB/s here).
        handle = self.client.get_buffer(vkey) if raw_meta else None
        if handle is None:
            raise KeyError(key)
        meta = json.loads(bytes(raw_meta))
        ec_cache = parse_value(memoryview((ctypes.c_ubyte * handle.size()).from_address(handle.ptr())).cast("B"))
        del handle  # (the client's buffer is released with it)
        hidden = meta["out_hidden_size"]
        if ec_cache.shape[1] != hidden * (1 + meta["deepstack_levels"]):
            raise StoreFormatError(f"{key}: a [{ec_cache.shape[0]}, {ec_cache.shape[1]}] value for "
                                   f"{meta['deepstack_levels']} deepstack levels of width {hidden}")
        parts = list(torch.split(ec_cache, hidden, dim=1))
        return StoredEmbeddings(main=parts[0], deepstack=parts[1:], grid_thw=tuple(meta["grid_thw"]),
                                metadata={k: json.dumps(v) if isinstance(v, list) else str(v) for k, v in meta.items()})

    def read_ec_cache(self, key: str, store_key: str | None = None) -> torch.Tensor:
        """The value's whole [num_tokens, hidden] tensor as vLLM reads it (the value alone: its header says
        dtype and shape; the companion is what `exists` checked). KeyError if it is not in the pool."""
        value = self.client.get(self._keys(key, store_key)[0])
        if not value:
            raise KeyError(key)
        return parse_value(value)

    def close(self) -> None:
        self.client.close()


def parse_value(value) -> torch.Tensor:
    """A value in vLLM 0.33's layout (bytes or a memoryview) -> the [num_tokens, hidden] tensor, a copy this
    process owns, as vLLM parses it: the header's magic, dtype code and sizes checked against the bytes."""
    import torch

    from service.store.format import StoreFormatError

    buf = memoryview(value).cast("B")
    if len(buf) < HEADER.size:
        raise StoreFormatError(f"a Mooncake value of {len(buf)} bytes has no header")
    magic, code, n, hidden = HEADER.unpack_from(buf)
    dtypes = {c: getattr(torch, name) for name, c in DTYPE_CODES.items()}
    if magic != MAGIC or code not in dtypes:
        raise StoreFormatError(f"not an embedding value (magic {magic:#x}, dtype code {code})")
    dtype = dtypes[code]
    if len(buf) != HEADER.size + n * hidden * dtype.itemsize:
        raise StoreFormatError(f"a value of {len(buf)} bytes for [{n}, {hidden}] {dtype}")
    out = torch.empty((n, hidden), dtype=dtype)
    if n * hidden:
        out.view(torch.uint8).view(-1).numpy()[:] = buf[HEADER.size:]  # the one copy
    return out
