"""The directory store (`--store DIR`): `DirectoryStore`, atomic writes of one safetensors file per key in
vLLM's ECExampleConnector layout, a byte-bounded LRU index with a minimum residency rebuilt from the files'
headers at start (service/store/index.py), eviction. One writer process per root (the index lives in its
memory; service/store/files.py makes the root its own and locks it); any number of threads in it.

The format it writes (the file layout, its header) and the consumer's reader `read_embeddings` are in
service/store/format.py, which a consumer (the LM server) imports without this module; why the writer's
temp file and rename make concurrent reads safe is said there too.

The files are plain safetensors (vLLM reads them with `safetensors.torch.load_file`), but the writer
is our own (`format._encode_header` + `files.write_ec_file`): it produces the bytes
`safetensors.torch.save` does (see `_encode_header` for the one liberty) from a zero-copy view of the
tensor, with one `writev` that releases the GIL, writing the temp file in place.
`safetensors.torch.save_file` (0.8) writes a second temp file of its own and renames it, and holds
the GIL for part of each call.
"""

from __future__ import annotations

import concurrent.futures
import errno
import json
import logging
import os
import secrets
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from service.errors import Unavailable
from service.store import files
from service.store.base import Answer, Found, StoreStats, answered
from service.store.format import (_DTYPES, _O_CLOEXEC, FILE_NAME, FORMAT_VERSION, TMP_PREFIX,
                                  StoredEmbeddings, StoredItem, VideoMeta, _encode_header, _Header, _key_dir,
                                  read_embeddings)
from service.store.index import Entry, Index
from service.store.keys import shard_of, validate_key

if TYPE_CHECKING:  # torch is not imported here: preflight's root check (and so every start-up) would wait on it
    import torch

log = logging.getLogger(__name__)

# str(torch dtype) -> safetensors dtype code (format's _DTYPES the other way round), keyed by name so that
# this module needs no torch.
_CODE_OF: dict[str, str] = {f"torch.{name}": code for code, (name, _) in _DTYPES.items()}


class DirectoryStore:
    """Byte-bounded LRU store of ec_cache files under `root`, written atomically. Thread-safe.

    NOTE (other models' files): an existing file whose metadata names a different model,
    out_hidden_size, deepstack_levels, format_version (or dtype, when `dtype` is given) -- or that does
    not parse -- is indexed, counted against the capacity and evictable in LRU order, but `find` never
    returns it: another model's embeddings are not a cache hit. A write of that key overwrites it.

    NOTE (oversize items): a single item larger than the whole capacity is still written (the request
    that produced it is waiting for it, and the consumer reads it from the store), everything else is
    evicted, and a warning is logged. The next write evicts it. So the store can exceed its capacity by
    at most one item, transiently.

    NOTE (locking): `_lock` guards the index and the directory-entry steps that must not interleave
    for one key -- mkdir + create temp, rename onto the final name, unlink + rmdir on eviction. The
    tensor write itself runs outside the lock, so lookups and other writes never wait on it. A key
    directory cannot be removed by an eviction while a write's temp file is in it (rmdir of a non-empty
    directory fails, and is tolerated), and the temp file is created under the lock right after the
    mkdir, so a write of a key that is being evicted always lands.

    NOTE (minimum residency): see service/store/index.py. When a write cannot make room without evicting
    entries in their residency it raises `store_full` (503 + Retry-After) and writes nothing.

    One writer process per root: the index is this process's memory. Readers in other processes use
    `read_embeddings`.

    NOTE (shards): with `shard=(i, n)`, n > 1, this store is one of n writers of the root (one engine per
    device): it indexes, writes and evicts only the keys with `shard_of(key, n) == i`, leaves the others'
    files alone and uncounted, and locks `shard_lock(i, n)` instead of ROOT_LOCK (which the supervisor
    holds, so a second service on the root is still refused). The caller passes each shard its part of
    the capacity (open_store: capacity / n); the filesystem's free space is split the same way.
    """

    def __init__(
        self,
        root: Path,
        capacity_bytes: int,
        model_id: str,
        out_hidden_size: int,
        deepstack_levels: int,
        *,
        dtype: str | None = None,  # "float32" | "bfloat16": if given, other-dtype files are not hits
        fsync: bool = False,  # durability across power loss; pointless on /dev/shm (RAM), so off by default
        min_residency_s: float = 0.0,  # see the class NOTE
        clock: Callable[[], float] = time.monotonic,  # injectable for tests
        exclusive: bool = False,  # the service's own root: checked, locked (files.own_root)
        group: str | None = None,  # with exclusive: a group that may read the store (root 0750, files 0640)
        shard: tuple[int, int] = (0, 1),  # (index, count): see the class NOTE on shards
        writers: int = 1,  # threads writing one step's entries (commit_step), the caller's included
    ):
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be > 0, got {capacity_bytes}")
        if out_hidden_size <= 0 or deepstack_levels < 0:
            raise ValueError(f"bad out_hidden_size={out_hidden_size} / deepstack_levels={deepstack_levels}")
        if dtype is not None and dtype not in {name for name, _ in _DTYPES.values()}:
            raise ValueError(f"dtype must be float32 or bfloat16, got {dtype!r}")
        if not 0 <= shard[0] < shard[1]:
            raise ValueError(f"shard must be (index, count) with 0 <= index < count, got {shard}")
        self.root = Path(root).absolute()
        self.location = str(self.root)
        self._real_root = os.path.realpath(self.root)
        self.model_id = model_id
        self.out_hidden_size = out_hidden_size
        self.deepstack_levels = deepstack_levels
        self.dtype = dtype
        self.fsync = fsync
        self.shard = shard

        self._lock = threading.Lock()
        self._index = Index(capacity_bytes, min_residency_s, clock)
        self._trash: list[Path] = []  # evicted files renamed aside under _lock, unlinked outside it (_empty_trash)
        self._spare: files.Spare | None = None  # under _lock (prepare_next)
        self._writers = writers
        # The calling thread takes a share of every step's writes itself, so the pool has one thread less.
        self._pool = concurrent.futures.ThreadPoolExecutor(max(1, writers - 1), thread_name_prefix="store-put")

        self.file_mode = files.FILE_MODE
        self._lock_fd: int | None = None
        if exclusive:
            self._lock_fd, self.file_mode = files.own_root(
                self.root, group, files.ROOT_LOCK if shard[1] == 1 else files.shard_lock(*shard))
        else:
            self.root.mkdir(parents=True, exist_ok=True)
        self._index.load(self._scan())
        if len(self._index):
            hits = sum(e.item is not None for e in self._index.entries.values())
            log.info("store %s: indexed %d files (%d bytes), %d usable by model %r",
                     self.root, len(self._index), self._index.bytes_used, hits, self.model_id)
        self._index.capacity_bytes = self._fit_capacity(capacity_bytes)
        if exclusive and files.tmpfs_huge(self._real_root) == "never":
            # Measured on an H200 host (bench/RESULTS.md, the store): a 448px image's 4 MB entry reserved and
            # written in 0.6 ms on a tmpfs mounted huge=always, 1.5-2.1 ms on one without huge pages.
            log.info("the store %s is on a tmpfs without huge pages: each write allocates its memory 4 KiB at a "
                     "time; a tmpfs mounted with huge=within_size writes 2-3x faster (docs/operations.md)",
                     self.root)
        self.unwritable: str | None = None  # why the last write failed, until one succeeds (health)
        self._evict(keep=None)

    def _fit_capacity(self, wanted: int) -> int:
        """`wanted`, or less where the filesystem cannot hold it (Docker's default /dev/shm is 64 MB):
        a capacity above what fits would make every write fail with ENOSPC instead of evicting."""
        st = os.statvfs(self.root)
        # free space (this shard's part of it) plus what our entries hold
        room = st.f_bavail * st.f_frsize // self.shard[1] + self._index.bytes_used
        fits = int(room * 0.95)  # headroom for temp files in flight and other users of the filesystem
        if wanted <= fits:
            return wanted
        log.warning("store capacity %d bytes is more than %s can hold (%d bytes free, %d used by the store): "
                    "using %d; give the filesystem more room (e.g. docker --shm-size) or lower "
                    "--store-capacity-bytes", wanted, self.root, st.f_bavail * st.f_frsize, self._index.bytes_used,
                    fits)
        return max(1, fits)

    def close(self) -> None:
        """Remove the spare file, if any; release the root's lock (a later service may then take the root)."""
        self._pool.shutdown()
        with self._lock:
            spare, self._spare = self._spare, None
        if spare is not None:
            spare.drop()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    # ---- what the engine's health and metrics read -------------------------------------------------
    @property
    def capacity_bytes(self) -> int:
        return self._index.capacity_bytes

    @property
    def min_residency_s(self) -> float:
        return self._index.min_residency_s

    @property
    def bytes_used(self) -> int:
        return self._index.bytes_used

    @property
    def evictions(self) -> int:
        return self._index.evictions

    def __len__(self) -> int:
        return len(self._index)

    def stats(self) -> StoreStats:
        return StoreStats(entries=len(self._index), bytes_used=self._index.bytes_used,
                          evictions=self._index.evictions)

    def health(self) -> str | None:
        return self.unwritable

    def lru_keys(self) -> list[str]:
        """All indexed keys, least recently used first (for metrics and tests)."""
        with self._lock:
            return list(self._index.entries)

    def abspath(self, item: StoredItem) -> Path:
        return self.root / item.path

    # ---- lookups and reads ---------------------------------------------------------------------------
    def find(self, key: str) -> Found:
        """The index answers at once: a stat and no read."""
        try:
            return answered(self.lookup(key))
        except Exception as e:
            found: Found = concurrent.futures.Future()
            found.set_exception(e)
            return found

    def known(self, key: str) -> StoredItem | None:
        return self.lookup(key)

    def lookup(self, key: str) -> StoredItem | None:
        """The stored item for `key` if it is a hit for this model; marks it most recently used."""
        validate_key(key)
        with self._lock:
            entry = self._index.touch(key)  # answered: kept for the minimum residency
        if entry is None:
            return None
        # Outside the lock: touch the mtime, which both checks that the file still exists and makes
        # the recency survive a restart (the index is rebuilt in mtime order).
        try:
            os.utime(self.root / entry.item.path)
        except FileNotFoundError:
            with self._lock:
                if self._index.entries.get(key) is entry:  # not already replaced/evicted by another thread
                    log.warning("store file for key %r was deleted externally; dropping it from the index", key)
                    self._index.drop(key, entry)
            return None
        return entry.item

    def read(self, key: str) -> StoredEmbeddings:
        return read_embeddings(self.root, key)

    def evict(self, key: str) -> bool:
        validate_key(key)
        with self._lock:
            if key not in self._index.entries:
                return False
            self._index.drop(key)
            self._trash_locked(key)
        self._empty_trash()
        return True

    # ---- writes ----------------------------------------------------------------------------------------
    def put(self, key: str, ec_cache: torch.Tensor, grid_thw, content_sha256: str | None = None,
            video: VideoMeta | None = None) -> StoredItem:
        """Write `ec_cache` for `key` atomically, then evict LRU entries (never this one) to fit.

        `ec_cache`: [num_tokens, out_hidden*(1+deepstack_levels)], CPU, contiguous, float32|bfloat16;
        it may be a row slice of a larger (pinned) buffer. It is read in place (not copied) without
        the GIL, so the caller must not overwrite it until put returns.
        Overwrites an existing entry of the same key. On failure nothing new is visible and the
        previous version (if any) is untouched.
        """
        return self.commit(self.reserve(key, tuple(ec_cache.shape), ec_cache.dtype, grid_thw, content_sha256, video),
                           ec_cache)

    def reserve(self, key: str, shape: tuple[int, int], dtype: torch.dtype, grid_thw,
                content_sha256: str | None = None, video: VideoMeta | None = None, *,
                lone: bool = False) -> files.PendingEntry:
        """The first half of `put`, for before the embeddings exist: check room, create the temp file
        and allocate its pages. Why: on tmpfs most of a write's cost is allocating and zeroing fresh
        pages (~1.5 ms for one 448px image's 4 MB); the step loop reserves while the GPU computes, and
        `commit` is then a plain copy. Every pending entry must be committed or aborted.

        `lone`: also map the file with its pages faulted in, so that `commit` is one memmove instead of
        a writev, which goes through the page cache a page at a time. For an entry whose write delays
        its answer (a lone image): the faulting costs more than the writev saves, but it is paid here,
        while the device computes (probes on an H200 host: writev 0.69-1.07 ms, a mapped copy 0.29-0.56
        after a 0.75 ms populate and before a 0.22 ms unmap). Not with fsync. Where a spare file of its
        size was made ahead (prepare_next), it takes that one instead."""
        key_dir = self._key_dir(key)
        assert shard_of(key, self.shard[1]) == self.shard[0], f"{key} is another shard's: a routing bug"
        grid = tuple(int(g) for g in grid_thw)
        self._check_shape(shape, dtype, grid)
        n, width = shape
        metadata = {
            "format_version": str(FORMAT_VERSION),
            "model": self.model_id,
            "out_hidden_size": str(self.out_hidden_size),
            "deepstack_levels": str(self.deepstack_levels),
            "grid_thw": json.dumps(list(grid)),
            "num_tokens": str(n),
        }
        if content_sha256 is not None:  # what lets a later request for this key check it is the same image
            metadata["content_sha256"] = content_sha256
        if video is not None:
            metadata.update(video.metadata())
        code = _CODE_OF[str(dtype)]
        data_bytes = n * width * dtype.itemsize
        header = _encode_header(code, (n, width), data_bytes, metadata)
        total = len(header) + data_bytes  # the file's size
        with self._lock:
            self._index.check_room(key, total)
            spare = self._spare if lone and not self.fsync else None
            if spare is not None and spare.nbytes == files.spare_size(total):
                # The file made ahead for it (prepare_next): no create, allocate or map here. It is renamed
                # from the root onto the key's name at commit (which makes the key's directory then).
                self._spare = None
                return files.PendingEntry(key, key_dir, spare.path, spare.fd, header, (n, width), dtype, grid,
                                    content_sha256, video, mapping=spare.mapping)

        # The temp file is created (empty) under the lock together with the mkdir: from then on the
        # directory is non-empty, so a concurrent eviction of this key cannot rmdir it from under us.
        # NOTE (GIL): every os.* call here releases the GIL, and while another Python thread is busy
        # each retake can cost a switch interval (5 ms); so a write keeps its syscalls few (one open,
        # written through that fd) and uses no torch op on the tensor (see format.tensor_bytes).
        tmp = key_dir / f"{TMP_PREFIX}{secrets.token_hex(8)}"
        with self._lock:
            key_dir.mkdir(exist_ok=True)
            # (a shared writable mapping needs the file open for reading too)
            fd = os.open(tmp, os.O_CREAT | os.O_EXCL | (os.O_RDWR if lone else os.O_WRONLY) | _O_CLOEXEC,
                         self.file_mode)
        r = files.PendingEntry(key, key_dir, tmp, fd, header, (n, width), dtype, grid, content_sha256, video)
        try:
            try:
                allocated = files.allocate(fd, total)
            except OSError as e:
                # The filesystem is fuller than our capacity says (other users, temp files): make room
                # by evicting as if over capacity, then try once more.
                if e.errno != errno.ENOSPC or not self._evict_bytes(total, keep=key):
                    raise
                allocated = files.allocate(fd, total)
            if lone and allocated and not self.fsync:  # (a file not allocated would fault past its end)
                r.mapping = files.map_file(fd, total)
        except OSError as e:
            self.abort(r)
            if e.errno == errno.ENOSPC:
                raise Unavailable(f"the store's filesystem ({self.root}) is full and nothing can be evicted now "
                                f"(entries answered in the last {self.min_residency_s:g} s are kept); retry "
                                "shortly, or give it more room", retry_after_s=1, code="store_full") from None
            self.unwritable = f"{type(e).__name__}: {e}"
            raise
        except BaseException:
            self.abort(r)
            raise
        return r

    def prepare_next(self, like: files.PendingEntry) -> bool:
        """Make ahead the file that the next lone reservation of `like`'s size takes, instead of creating,
        allocating and mapping its own: a lone image's reservation (2.4-2.8 ms for a 448px entry on an H200
        host, its pages faulted in) ended after the device and delayed its answer. The writer calls it once
        a lone image is answered, while the server waits for the next request. One spare at a time, the
        size of the last; none with fsync or above SPARE_MAX_BYTES (or an eighth of the capacity): it is
        held outside the capacity. Returns whether one of that size is ready; a failure (a full
        filesystem) only means there is none."""
        size = files.spare_size(like.nbytes)
        if self.fsync or size > min(files.SPARE_MAX_BYTES, self.capacity_bytes // 8):
            return False
        with self._lock:
            if self._spare is not None and self._spare.nbytes == size:
                return True
        spare = files.Spare(self.root / f"{files.SPARE_PREFIX}{self.shard[0]}-{secrets.token_hex(8)}", -1, size)
        try:
            spare.fd = os.open(spare.path, os.O_CREAT | os.O_EXCL | os.O_RDWR | _O_CLOEXEC, self.file_mode)
            if files.allocate(spare.fd, size):  # (a file not allocated would fault past its end)
                spare.mapping = files.map_file(spare.fd, size)
        except OSError as e:
            log.debug("store: no spare file (%s)", e)
        if spare.mapping is None:
            spare.drop()
            return False
        with self._lock:
            old, self._spare = self._spare, spare
        if old is not None:  # another size's
            old.drop()
        return True

    def abort(self, r: files.PendingEntry) -> None:
        """Give up a pending entry: close and remove its temp file (the key's entry, if any, is untouched)."""
        r.unmap()
        if r.fd >= 0:
            os.close(r.fd)
            r.fd = -1
        with self._lock:
            r.tmp.unlink(missing_ok=True)
            if r.key not in self._index.entries:
                files.rmdir_quietly(r.key_dir)

    def commit(self, r: files.PendingEntry, ec_cache: torch.Tensor,
               answer: Callable[[StoredItem], None] | None = None) -> StoredItem:
        """The second half of `put`: write `ec_cache` (the reserved shape and dtype) into the reserved
        file, publish it atomically and evict to fit. On failure the entry is aborted.

        `answer(item)` is called once the entry is published (and durable, with fsync), before the
        tidying that its waiters need not wait for: unlinking the files it evicted (0.5 ms each for a
        448px image's on /dev/shm) and unmapping a mapped file. Nothing raises after it."""
        key, key_dir, grid, content_sha256 = r.key, r.key_dir, r.grid, r.content_sha256
        tmp, final, (n, width) = r.tmp, key_dir / FILE_NAME, r.shape
        try:
            self._check_tensor(ec_cache, grid)
            if tuple(ec_cache.shape) != r.shape or ec_cache.dtype != r.dtype:
                raise ValueError(f"ec_cache is {tuple(ec_cache.shape)} {ec_cache.dtype}, reserved {r.shape} {r.dtype}")
            # Outside the lock, and the bulk copy releases the GIL: lookups, other writes and the service's
            # Python threads run meanwhile. `tmp` is written in place (no further temp file) and only it
            # is renamed onto the final name.
            try:
                nbytes = files.write_ec_file(r.fd, r.header, ec_cache, fsync=self.fsync, mode=self.file_mode,
                                             mapping=r.mapping)
            finally:
                os.close(r.fd)
                r.fd = -1
        except OSError as e:
            self.abort(r)
            self.unwritable = f"{type(e).__name__}: {e}"
            raise
        except BaseException:
            self.abort(r)
            raise

        item = StoredItem(key=key, path=f"{key}/{FILE_NAME}", num_tokens=n, grid_thw=grid,  # type: ignore[arg-type]
                          shape=(n, width), dtype=_DTYPES[_CODE_OF[str(r.dtype)]][0], nbytes=nbytes,
                          content_sha256=content_sha256, video=r.video)
        with self._lock:
            if tmp.parent != key_dir:  # a spare (reserve): the key's directory may not exist yet
                key_dir.mkdir(exist_ok=True)
            os.replace(tmp, final)
            self._index.put(key, nbytes, item)
            if nbytes > self.capacity_bytes:
                log.warning(
                    "store item %r is %d bytes, more than the whole capacity (%d): writing it anyway and "
                    "evicting everything else; raise --store-capacity-bytes",
                    key, nbytes, self.capacity_bytes,
                )
            self._evict_locked(keep=key)
        self.unwritable = None
        try:
            if self.fsync:
                try:
                    files.fsync_path(key_dir)  # makes the rename durable
                except FileNotFoundError:
                    pass  # already evicted by a concurrent write
            if answer is not None:
                answer(item)
        finally:
            r.unmap()
            self._empty_trash()
        return item

    def commit_step(self, pendings: list[files.PendingEntry], rows: list[torch.Tensor], answer: Answer) -> None:
        """Commit a step's entries on the store's writer threads (this one included), in contiguous shares,
        answer(i, item or error) as each is published.

        NOTE: a few threads: each commit is mostly a memcpy into /dev/shm with the GIL released, and one
        thread alone falls behind the GPU at large batches (8 measured slower than 4: they contend for the
        GIL). Why not Executor.map: one submit per image contends on the executor's locks with the threads
        finishing; py-spy put 10% of the engine process's GIL samples there under HTTP load on an H200 host."""
        def one(i: int) -> None:
            try:
                self.commit(pendings[i], rows[i], answer=lambda item: answer(i, item))
            except Exception as e:  # (raised before the answer: commit raises nothing after it)
                answer(i, e)

        shares = _shares(len(pendings), self._writers)
        run = lambda idx: [one(i) for i in idx]  # noqa: E731
        futures = [self._pool.submit(run, share) for share in shares[1:]]
        run(shares[0])
        for f in futures:
            f.result()

    # ---- internals ---------------------------------------------------------------------------------
    def _key_dir(self, key: str) -> Path:
        """`_key_dir(root, key)`, with one lstat in the common case instead of realpath's one per path
        component (each a chance to lose the GIL, see reserve): an entry of root that is not a symlink (or
        no entry yet) resolves to real_root/key; a symlink gets the full check."""
        validate_key(key)
        d = self.root / key
        try:
            if not stat.S_ISLNK(os.lstat(d).st_mode):
                return d
        except FileNotFoundError:
            return d
        except OSError:
            pass
        return _key_dir(self.root, key, self._real_root)

    def _check_shape(self, shape: tuple[int, ...], dtype: torch.dtype, grid: tuple[int, ...]) -> None:
        # The caller is our own step loop, so these are contract checks, kept as exceptions (not
        # asserts) because they guard what a separate consumer process will read.
        width = self.out_hidden_size * (1 + self.deepstack_levels)
        if len(shape) != 2 or shape[1] != width or shape[0] == 0:
            raise ValueError(f"ec_cache must be [num_tokens>0, {width}], got {tuple(shape)}")
        if str(dtype) not in _CODE_OF:
            raise ValueError(f"ec_cache dtype must be float32 or bfloat16, got {dtype}")
        if len(grid) != 3 or min(grid) <= 0:
            raise ValueError(f"grid_thw must be three positive ints, got {grid}")

    def _check_tensor(self, t: torch.Tensor, grid: tuple[int, ...]) -> None:
        self._check_shape(tuple(t.shape), t.dtype, grid)
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError("ec_cache must be a contiguous CPU tensor (copy it off the device first)")

    def _is_hit(self, h: _Header) -> bool:
        return (
            h.format_version == FORMAT_VERSION
            and h.model == self.model_id
            and h.out_hidden_size == self.out_hidden_size
            and h.deepstack_levels == self.deepstack_levels
            and (self.dtype is None or h.dtype == self.dtype)
            and _video_meta(h.metadata) is not False
        )

    def _scan(self) -> list[tuple[int, str, Entry]]:
        """Every entry of this shard on disk as (mtime_ns, key, entry): the index at start, in mtime order.
        A file whose header does not parse, or names another model, is counted but no hit (the class NOTE)."""
        found = []
        for mtime_ns, key, nbytes, h in files.scan_root(self.root, self.shard):
            item = None
            if h is not None and self._is_hit(h):
                item = StoredItem(key=key, path=f"{key}/{FILE_NAME}", num_tokens=h.shape[0], grid_thw=h.grid_thw,
                                  shape=h.shape, dtype=h.dtype, nbytes=nbytes,
                                  content_sha256=h.metadata.get("content_sha256"), video=_video_meta(h.metadata))
            found.append((mtime_ns, key, Entry(nbytes=nbytes, item=item)))
        return found

    def _evict(self, keep: str | None, limit: int | None = None) -> None:
        with self._lock:
            self._evict_locked(keep, limit)
        self._empty_trash()

    def _evict_bytes(self, nbytes: int, keep: str) -> bool:
        """Evict least recently used entries (not `keep`, not young ones) holding at least `nbytes`;
        False if there were none to evict."""
        with self._lock:
            before = self._index.bytes_used
            self._evict_locked(keep=keep, limit=max(0, before - nbytes))
            evicted = self._index.bytes_used < before
        self._empty_trash()  # (the room is there once the files are gone)
        return evicted

    def _evict_locked(self, keep: str | None, limit: int | None = None) -> None:
        """Evict what the index picks (never `keep`, never an entry in its minimum residency) until within
        capacity (or `limit` bytes). Caller holds _lock."""
        for victim in self._index.evict(keep, limit):
            self._trash_locked(victim)

    def _trash_locked(self, key: str) -> None:
        """Take `key`'s file out of the store. Caller holds _lock.

        Renamed aside (a temp name: a crash leaves it to start-up's cleanup), unlinked by _empty_trash after
        the lock: freeing a 448px entry's pages took 0.56 ms on a tmpfs of 4 KiB pages (0.02 ms in 2 MiB
        ones), and every commit waited for the lock meanwhile. The entry is gone for readers at the rename,
        as at an unlink; one that has the file open keeps reading it."""
        key_dir = self.root / key
        trash = self.root / f"{TMP_PREFIX}evicted-{secrets.token_hex(8)}"
        try:
            os.rename(key_dir / FILE_NAME, trash)
            self._trash.append(trash)
        except FileNotFoundError:
            pass
        except OSError as e:  # the bytes are probably still used; say so rather than fail the write
            log.error("store: cannot evict %s: %s", key_dir / FILE_NAME, e)
        files.rmdir_quietly(key_dir)  # fails harmlessly while a write of this key has its temp file inside

    def _empty_trash(self) -> None:
        """Unlink the files _evict_locked renamed aside. Callers hold no lock."""
        if not self._trash:  # (most commits evict nothing: no second trip through the lock; a file added
            return           # meanwhile is emptied by the thread whose eviction added it)
        with self._lock:
            trash, self._trash = self._trash, []
        for path in trash:
            try:
                files.unlink_quietly(path)
            except OSError as e:
                log.error("store: cannot remove evicted file %s: %s", path, e)


def _shares(n: int, threads: int) -> list[range]:
    """0..n-1 in at most `threads` contiguous shares of near-equal size, in order (one at least)."""
    k = max(1, min(threads, n))
    return [range(i * n // k, (i + 1) * n // k) for i in range(k)]


def _video_meta(metadata: dict[str, str]) -> VideoMeta | None | bool:
    """A video entry's VideoMeta, None for an image's, False for a video entry whose fields do not parse
    (not a hit: its answer would lack them)."""
    try:
        return VideoMeta.from_metadata(metadata)
    except (KeyError, ValueError, TypeError):
        return False
