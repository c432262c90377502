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

Failures: every Mooncake call has a deadline (--mooncake-timeout-s; store/calls.py). A read past it (a
host that does not answer) is a miss and is counted; a lookup or a write that the master does not answer
is `store_unavailable` (503). Whether the master answers is followed by a thread of its own (a probe a
second), so health() never waits on the pool, and while the master is down lookups and writes fail at
once instead of each waiting for its deadline.
"""

from __future__ import annotations

import ctypes
import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from service.errors import Unavailable
from service.store.base import Answer, Found, StoreStats
from service.store.calls import Calls, Overdue
from service.store.format import FORMAT_VERSION, StoredEmbeddings, StoredItem, StoreFormatError, VideoMeta
from service.store.keys import validate_key
from service.store.lookups import Lookups
from service.store.options import MOONCAKE_BUFFER_BYTES, MOONCAKE_TIMEOUT_S, MooncakeOptions, parse_mooncake
from service.store.pool import connect
from service.store.values import DTYPE_CODES, HEADER, MAGIC, Companion, ValueHeaders, companion, parse_value, value_rows

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

__all__ = ["MooncakeStore", "MooncakeReader", "default_namespace", "meta_key", "value_key", "parse_value"]

# Mooncake's error codes met here (its ErrorCode enum): no space.
NO_SPACE = (-200, -201, -202)  # NO_AVAILABLE_HANDLE and the allocation failures
REFORM_S = 60.0  # after the master was seen down, "no room" means its hosts have not registered again yet
HEALTH_S = 1.0  # how often the master is probed (health() answers the last probe's outcome)
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
    layout. A lookup is an RPC to the master: `find` answers from threads of lookups batched together
    (service/store/lookups.py); a step's entries go in one call (commit_step). Thread-safe (the client is
    Mooncake's, which is); every call into it is bounded (see the module docstring)."""

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
        # Two pools: the master's calls (its existence answers, removes, the health probe) and transfers
        # (reads and writes, which a stopped host holds): reads held by a stopped host must not leave the
        # master's calls without a thread, which would read as the master gone.
        self._calls = Calls(options.timeout_s)
        self._master_calls = Calls(options.timeout_s, name="mooncake-master")
        self._headers = ValueHeaders(self.client, self._calls)
        self._lock = threading.Lock()
        self._written = 0  # entries this engine put since it started (the pool's own count is the master's)
        self._bytes = 0
        self.evictions = 0  # the master evicts; this engine does not see it
        self._down: str | None = None  # why the master is taken to be gone now (None: it answers)
        self._outage_at = float("-inf")  # when the master last did not answer (see _error)
        self._recent: OrderedDict[str, tuple[float, StoredItem]] = OrderedDict()  # see written_lately
        self._lookups = Lookups(self.lookup_many)
        self._closing = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="store-health", daemon=True)
        self._watcher.start()

    # ---- what the engine's metrics and health read -------------------------------------------------
    @property
    def bytes_used(self) -> int:
        """Bytes this engine has put since it started (the pool holds others' too, and evicts)."""
        return self._bytes

    def __len__(self) -> int:
        return self._written

    def stats(self) -> StoreStats:
        return StoreStats(entries=self._written, bytes_used=self._bytes, evictions=self.evictions,
                          timeouts=self.timeouts())

    def timeouts(self) -> dict[str, int]:
        """Mooncake calls past their deadline since start, by kind: lookup (the master's existence answers),
        read (a hit's companion or value header: a miss), write, remove, probe (the health probe)."""
        return dict(self._calls.counts() + self._master_calls.counts())

    def health(self) -> str | None:
        return self._down

    @property
    def unwritable(self) -> str | None:
        """Why the pool cannot take writes now (its master does not answer), or None: the last probe's
        answer (_watch), or a lookup's since, never a call of its own. A put that fails for another reason
        (a peer host lost) answers its own request 503; the next put may land elsewhere."""
        return self._down

    def _watch(self) -> None:
        """Probe the master every HEALTH_S, each probe bounded: down while it does not answer."""
        probe = None
        while True:
            if probe is None or probe.done():  # (a probe still out past its deadline: down, as it was)
                try:
                    probe = None
                    probe = self._master_calls.start("probe", self.client.is_exist, f"{self.namespace}@probe")
                    rc = self._master_calls.wait("probe", probe)
                except Overdue as e:
                    self._master_down(f"{e} (--mooncake-timeout-s)")
                except Exception as e:  # (the client closed under it)
                    self._master_down(f"the Mooncake client failed ({type(e).__name__}: {e})")
                else:
                    if rc < 0:
                        self._master_down(f"error {rc}")
                    elif self._down is not None:
                        log.info("the Mooncake master at %s answers again", self.options.master)
                        self._down = None
            if self._closing.wait(HEALTH_S):
                return

    def _master_down(self, why: str) -> None:
        if self._down is None:
            log.warning("the Mooncake master at %s does not answer (%s): lookups and writes answer 503 until it "
                        "does", self.options.master, why)
        self._outage_at = time.monotonic()
        self._down = f"the Mooncake master at {self.options.master} does not answer ({why})"

    def _refuse(self) -> Unavailable:
        return Unavailable(f"{self._down}; retry shortly", code="store_unavailable")

    def close(self) -> None:
        self._closing.set()
        self._lookups.close()
        self._watcher.join(self.options.timeout_s + HEALTH_S)
        _close(self.client, self._headers, self._calls, self._master_calls)

    # ---- lookups and reads -----------------------------------------------------------------------------
    def find(self, key: str) -> Found:
        return self._lookups.lookup(key)

    def known(self, key: str) -> StoredItem | None:
        """What this engine wrote lately (written_lately): no round trip to the master."""
        return self.written_lately(key)

    def lookup(self, key: str) -> StoredItem | None:
        return self.lookup_many([key])[0]

    def read(self, key: str) -> StoredEmbeddings:
        return MooncakeReader(self.client, self.namespace, calls=self._calls).read(key)

    def evict(self, key: str) -> bool:
        validate_key(key)
        with self._lock:
            self._recent.pop(key, None)
        try:
            rcs = self._master_calls.run("remove", self.client.batch_remove,
                                  [value_key(self.namespace, key), meta_key(self.namespace, key)], True)
        except Overdue as e:
            raise Unavailable(f"{e}; retry shortly", code="store_unavailable") from None
        return any(rc == 0 for rc in rcs)

    def lookup_many(self, keys: list[str]) -> list[StoredItem | None]:
        """The stored item of each key if it is a hit for this model, read from its companion and checked
        against its value's header (a failed or late read: a lost or stopped host, an evicted entry, a
        companion that does not parse or a value that contradicts it: None, and the image is encoded
        again). One batch_is_exist for all the keys (most lookups are misses: one round trip to the
        master); the hits' companions and a read of their values' headers (ValueHeaders) cost two more,
        for all of them. `store_unavailable` if the master does not answer."""
        for key in keys:
            validate_key(key)
        if self._down is not None:  # (at once: a lookup would only wait for its deadline)
            raise self._refuse()
        try:
            here = self._master_calls.run("lookup", self.client.batch_is_exist, [meta_key(self.namespace, k) for k in keys])
        except Overdue as e:
            self._master_down(f"{e} (--mooncake-timeout-s)")
            raise self._refuse() from None
        if len(here) != len(keys) or any(h < 0 for h in here):
            # the master does not answer: neither a hit nor a miss (a miss would be encoded for nothing)
            self._master_down(f"error {min(here, default=-1)}")
            raise self._refuse()
        present = [key for key, h in zip(keys, here, strict=True) if h == 1]
        if not present:
            return [None] * len(keys)
        # The hits' companions in one call, then their values' headers in one more (ValueHeaders).
        try:
            raws = self._calls.run("read", self.client.get_batch, [meta_key(self.namespace, key) for key in present])
        except Overdue:  # a host that does not answer holds one of them: this batch's hits are misses
            return [None] * len(keys)
        lost = [key for key, raw in zip(present, raws, strict=True) if not raw]
        if lost:
            # NOTE: it exists (the master said so) but cannot be read: its host is lost, and existence answers
            # stay stale until the master's client TTL. Removed now (force: past the lease), so that the
            # re-encode's put is a fresh one, not an update in place in the lost segment.
            self._quietly("remove", self.client.batch_remove,
                          [k for key in lost for k in (meta_key(self.namespace, key), value_key(self.namespace, key))], True)
        metas = {key: meta for key, raw in zip(present, raws) if raw and (meta := self._ours(raw)) is not None}
        ours = list(metas)
        live = self._headers.read([value_key(self.namespace, key) for key in ours], list(metas.values())) if ours else []
        found = {key: self._item(key, metas[key]) for key, ok in zip(ours, live, strict=True) if ok}
        return [found.get(key) for key in keys]

    def written_lately(self, key: str) -> StoredItem | None:
        """The entry this client put under `key` in the last WRITTEN_S, without asking the master: what
        the engine host checks at a submit (an image stored since its claim's lookup missed; see
        EngineHost._with_entry). Recorded in commit_many, before the writer answers anyone."""
        with self._lock:
            at, item = self._recent.get(key, (float("-inf"), None))
        return item if time.monotonic() - at <= WRITTEN_S else None

    def _item(self, key: str, meta: Companion) -> StoredItem:
        return StoredItem(key=key, path=None, store_key=value_key(self.namespace, key), num_tokens=meta.num_tokens,
                          grid_thw=meta.grid_thw, shape=(meta.num_tokens, meta.width), dtype=meta.dtype,
                          nbytes=meta.value_nbytes, content_sha256=meta.content_sha256, video=meta.video)

    def _ours(self, raw) -> Companion | None:
        """A companion's fields if it is a whole one of an entry of this model (another model's entry under
        our namespace is no hit, cf. directory), else None."""
        meta = companion(raw)
        ours = (meta is not None and meta.model == self.model_id and meta.out_hidden_size == self.out_hidden_size
                and meta.deepstack_levels == self.deepstack_levels and meta.dtype == self.dtype)
        return meta if ours else None

    def _quietly(self, what: str, fn: Callable, *args) -> None:
        """A call whose outcome nobody waits for (tidying up), bounded like every other."""
        try:
            self._master_calls.run(what, fn, *args)
        except Exception as e:
            log.debug("Mooncake %s failed: %s", what, e)

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
               answer: Callable[[StoredItem | Exception], None] | None = None) -> StoredItem | None:
        """Put one entry (commit_many's one). Raises `store_full` (the pool has no room) or Unavailable (the
        master or a peer is unreachable): 503 + Retry-After; nothing half-written is left as a hit.
        `answer(item)` once it is stored; a put past its deadline is answered `answer(error)` then, and
        commit returns (None) once Mooncake has returned (the rows are read in place until then)."""
        late: list[Exception] = []

        def overdue(e: Exception) -> None:
            late.append(e)
            answer(e)

        (out,) = self.commit_many([pending], [ec_cache], overdue if answer is not None else None)
        if late:
            return None
        if isinstance(out, Exception):
            raise out
        if answer is not None:
            answer(out)
        return out

    def commit_step(self, pendings: list[MooncakePending], rows: list[torch.Tensor], answer: Answer) -> None:
        """A step's entries in one put (commit_many); each answered with its item or its error, once (past
        the deadline: with that error, then)."""
        late = False

        def overdue(e: Exception) -> None:
            nonlocal late
            late = True
            for i in range(len(pendings)):
                answer(i, e)

        try:
            results = self.commit_many(pendings, rows, overdue)
        except Exception as e:  # the whole call failed: every entry of it has that answer
            results = [e] * len(pendings)
        if not late:
            for i, result in enumerate(results):
                answer(i, result)

    def commit_many(self, pendings: list[MooncakePending], tensors: list[torch.Tensor],
                    overdue: Callable[[Exception], None] | None = None) -> list[StoredItem | Exception]:
        """Put a step's entries, each value (header + the rows, read in place: no copy on this side) and
        its companion, in two Mooncake calls for the whole step: a forced remove of the keys (a put onto
        an existing key keeps the old object: a re-encode after a lost host, or an entry of another model
        under this key, must replace it, and a fresh put never writes into a lost host's segment), then
        one batch put from the rows' own memory. Each entry's result, or the error that answers it.

        Past the deadline, `overdue(error)` is called at once (the caller answers its waiters with it)
        and every result is that error; commit_many itself returns only once Mooncake has, for Mooncake
        reads the rows in place until then (the writer reuses their buffer once commit returns).

        NOTE: why batches: a Mooncake call releases the GIL and takes it back when it returns, and while
        the engine's other threads are busy in Python that wait can be a whole switch interval (5 ms).
        A probe (now in git history) on the 2-core CPU machine, one Python thread busy beside, 4 MB
        entries over TCP on loopback: entry by entry (two upsert_parts each) 82 entries/s, 16 per
        commit_many 866/s (alone: 894 and 2,595); one is_exist 250/s (alone 11,354).
        """
        n = len(pendings)
        if self._down is not None:  # (at once: the put would only wait for its deadline)
            return [self._refuse()] * n
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
        client = self.client

        def put() -> list[int]:
            client.batch_remove(keys, True)  # (absent keys answer an error: nothing to replace)
            return client.batch_put_from_multi_buffers(keys, ptrs, sizes, config=self._config)

        late, call = None, None
        try:
            call = self._calls.start("write", put)
            rcs = self._calls.wait("write", call)
        except Overdue as e:
            late = Unavailable(f"the Mooncake pool did not take the entry in time ({e}; --mooncake-timeout-s): its "
                               "master or a peer does not answer; retry shortly", code="store_unavailable")
            if overdue is not None:
                overdue(late)
            try:  # NOTE: the rows are read in place until Mooncake returns (see above)
                rcs = call.result() if call is not None else [-1] * (2 * n)
            except Exception:
                rcs = [-1] * (2 * n)
        out: list[StoredItem | Exception] = []
        for i, pending in enumerate(pendings):
            rv, rm = rcs[i], rcs[n + i]
            if rv != 0 or rm != 0:  # no value without its companion, nor a companion without its value
                self._quietly("remove", client.remove, keys[n + i] if rv != 0 else keys[i], True)
                out.append(late or self._error(rv or rm))
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
            out.append(late or item)
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
    `namespace`, or by an /encode item's whole `store_key` (which names its namespace). Every call has the
    deadline `timeout_s` (store/calls.py): a read past it is a miss (KeyError), never a wait on a host that
    does not answer."""

    def __init__(self, client, namespace: str | None, *, calls: Calls | None = None,
                 timeout_s: float = MOONCAKE_TIMEOUT_S):
        self.client, self.namespace = client, namespace
        self.calls = calls or Calls(timeout_s, name="mooncake-read")
        self._headers = ValueHeaders(client, self.calls)

    @classmethod
    def open(cls, url: str, *, namespace: str | None = None, local_host: str = "127.0.0.1", protocol: str = "tcp",
             buffer_bytes: int = MOONCAKE_BUFFER_BYTES, timeout_s: float = MOONCAKE_TIMEOUT_S) -> MooncakeReader:
        options = MooncakeOptions(master=parse_mooncake(url), local_host=local_host, segment_bytes=0,
                                  buffer_bytes=buffer_bytes, protocol=protocol, namespace=namespace, timeout_s=timeout_s)
        return cls(connect(options), namespace, timeout_s=timeout_s)

    def timeouts(self) -> dict[str, int]:
        """Calls past their deadline since this reader opened, by kind (as MooncakeStore.timeouts)."""
        return dict(self.calls.counts())

    def _keys(self, key: str, store_key: str | None) -> tuple[str, str]:
        """(value key, companion key) of `key`."""
        if store_key is not None:
            namespace, sep, named = store_key.rpartition("@id:")
            if not sep or named != key:
                raise ValueError(f"{store_key!r} is not the store key of {key!r}")
        elif self.namespace is None:
            raise ValueError(f"reading {key!r} from Mooncake needs its namespace: pass store_key= (the /encode "
                             "item's store_key) or namespace= (the encoders' --mooncake-namespace)")
        else:
            namespace = self.namespace
        return value_key(namespace, key), meta_key(namespace, key)

    def _get(self, what: str, fn: Callable, *args):
        """A read, None when it fails or is past its deadline (a miss)."""
        try:
            return self.calls.run(what, fn, *args)
        except Overdue as e:
            log.warning("%s: counted as a miss", e)
            return None

    def entry(self, key: str, store_key: str | None = None) -> Companion | None:
        """The entry's companion if the entry is whole now: its companion parses and its value reads back
        with the header and size the companion says (which also takes the master's lease on the value);
        else None. Reads no tensor."""
        vkey, mkey = self._keys(key, store_key)
        raw = self._get("read", self.client.get, mkey)
        meta = companion(raw) if raw else None
        if meta is None or not self._headers.read([vkey], [meta])[0]:
            return None
        return meta

    def exists(self, key: str, store_key: str | None = None) -> bool:
        return self.entry(key, store_key) is not None

    def read(self, key: str, store_key: str | None = None) -> StoredEmbeddings:
        import torch

        vkey, mkey = self._keys(key, store_key)
        raw_meta = self._get("read", self.client.get, mkey)
        # NOTE: get_buffer, not get: the value lands in the client's buffer and is copied out once, into
        # the tensor (get returns a bytes object, which parsing would copy again: 787 -> 557 MB/s here).
        handle = self._get("read", self.client.get_buffer, vkey) if raw_meta else None
        if handle is None:
            raise KeyError(key)
        meta = companion(raw_meta)
        if meta is None:
            raise StoreFormatError(f"{key}: its companion is not one of this store's ({bytes(raw_meta)[:200]!r})")
        ec_cache = parse_value(memoryview((ctypes.c_ubyte * handle.size()).from_address(handle.ptr())).cast("B"), meta)
        del handle  # (the client's buffer is released with it)
        parts = list(torch.split(ec_cache, meta.out_hidden_size, dim=1))
        return StoredEmbeddings(main=parts[0], deepstack=parts[1:], grid_thw=meta.grid_thw,
                                metadata={k: json.dumps(v) if isinstance(v, list) else str(v) for k, v in meta.raw.items()})

    def read_ec_cache(self, key: str, store_key: str | None = None, expect: Companion | None = None) -> torch.Tensor:
        """The value's whole [num_tokens, hidden] tensor as vLLM reads it (the value alone: its header says
        dtype and shape, checked against `expect`, the companion `entry` answered, if given). KeyError if
        it is not in the pool or does not arrive within the deadline."""
        value = self._get("read", self.client.get, self._keys(key, store_key)[0])
        if not value:
            raise KeyError(key)
        return parse_value(value, expect)

    def read_data(self, item: StoredItem) -> memoryview:
        """The value's tensor bytes (after its header), checked against the /encode answer `item`: KeyError if it
        is not in the pool or does not arrive within the deadline, StoreFormatError if it is another value."""
        value = self._get("read", self.client.get, self._keys(item.key, item.store_key)[0])
        if not value:
            raise KeyError(item.key)
        try:
            return value_rows(value, (MAGIC, DTYPE_CODES.get(item.dtype, -1), *item.shape))[3]
        except StoreFormatError as e:
            raise StoreFormatError(f"{item.key}: the value in the pool is not the entry answered ({e})") from None

    def close(self) -> None:
        _close(self.client, self._headers, self.calls)


CLOSE_WAIT_S = 5.0  # how long a closing client waits for its calls out past their deadline to return


def _close(client, headers: ValueHeaders, *pools: Calls) -> None:
    """Close a client once no call into it is out. NOTE: a call past its deadline (a host stopped) may
    still be inside Mooncake, writing into a registered buffer: closing the client or unregistering the
    buffer under it crashed the process (a segfault). If one is still out after CLOSE_WAIT_S, the client
    is left open (to the process's exit) rather than closed under it."""
    deadline = time.monotonic() + CLOSE_WAIT_S
    returned = all([pool.drain(max(0.0, deadline - time.monotonic())) for pool in pools])
    for pool in pools:
        pool.close()
    if not returned:
        log.warning("a Mooncake call past its deadline has not returned: the client is left open")
        return
    headers.close()
    client.close()
