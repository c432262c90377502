"""The embedding store's writer: `EmbeddingStore`, atomic puts, a byte-bounded LRU index rebuilt from
the files' headers at start, eviction. One writer process per root (the index lives in memory); any
number of threads in it.

The format it writes (the file layout, its header, keys) and the consumer's reader `read_embeddings`
are in service/store/format.py, which a consumer (the LM server) imports without this module; why the
writer's temp file and rename make concurrent reads safe is said there too.

The files are plain safetensors (vLLM reads them with `safetensors.torch.load_file`), but the writer
is our own (`storeformat._encode_header` + `_write_ec_file`): it produces the bytes
`safetensors.torch.save` does (see `_encode_header` for the one liberty) from a zero-copy view of the
tensor, with one `writev` that releases the GIL, writing the temp file in place.
`safetensors.torch.save_file` (0.8) writes a second temp file of its own and renames it, and holds
the GIL for part of each call.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import json
import logging
import math
import mmap
import os
import secrets
import shutil
import stat
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from service.errors import StoreFull, StoreOwnershipError
from service.store.format import (_DTYPES, _O_CLOEXEC, FILE_MODE, FILE_NAME, FORMAT_VERSION, TMP_PREFIX, StoreFormatError, StoredItem, VideoMeta, tensor_bytes, _encode_header, _Header, _key_dir, _read_header)
from service.store.keys import is_store_key, shard_of, validate_key

if TYPE_CHECKING:  # torch is not imported here: preflight's root check (and so every start-up) would wait on it
    import torch

log = logging.getLogger(__name__)

# str(torch dtype) -> safetensors dtype code (storeformat's _DTYPES the other way round), keyed by name
# so that this module needs no torch.
_CODE_OF: dict[str, str] = {f"torch.{name}": code for code, (name, _) in _DTYPES.items()}


# A lone image's next store file, made ahead (EmbeddingStore.prepare_spare): "<prefix><shard index>-<random>" in
# the root. Not a key (keys never start with a dot), so other shards leave it alone; start-up removes its own
# shard's. Its size is rounded up to SPARE_ROUND (an entry's header varies by a few bytes) and trimmed at commit.
SPARE_PREFIX = ".spare-"
SPARE_ROUND = 64 * 1024
# The largest spare made (about a 1600x1600 image's bf16 entry): a spare is held outside the store's capacity.
SPARE_MAX_BYTES = 64 << 20

ROOT_LOCK = ".lock"  # held by the root's one writer: a service's store, or the supervisor of a sharded service


def shard_lock(index: int, count: int) -> str:
    """The lock file of one shard's writer (the supervisor holds ROOT_LOCK meanwhile)."""
    return f"{ROOT_LOCK}.shard-{index}-of-{count}"



def _write_all(fd: int, bufs: list) -> None:
    """Write all `bufs` (bytes / memoryviews) in order with as few writev calls as the kernel allows.
    os.writev releases the GIL for the copy; partial writes (> 2 GiB, signals) are resumed."""
    pending = [memoryview(b).cast("B") for b in bufs if len(b)]
    while pending:
        written = os.writev(fd, pending)
        if written <= 0:
            raise OSError(f"writev wrote {written} bytes")
        while pending and written >= len(pending[0]):
            written -= len(pending[0])
            pending.pop(0)
        if written:
            pending[0] = pending[0][written:]


def _allocate(fd: int, size: int) -> bool:
    """Allocate `size` bytes for the new file open as `fd` where the filesystem can (tmpfs, ext4, xfs);
    False where it cannot (the file stays empty). Why: on tmpfs, allocating and zeroing fresh pages is
    half a write's cost; done ahead (while the GPU computes), the later write is a plain copy (measured
    on an H200 host: 4 MB put 1.99 ms, the write after a reservation 1.04 ms)."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise  # ENOSPC and real errors: the reservation fails
        return False
    return True


def _map(fd: int, size: int) -> mmap.mmap | None:
    """The allocated file open as `fd`, mapped shared with its pages faulted in; None where that fails
    (the write then goes through writev). See EmbeddingStore.reserve's `mapped`."""
    try:
        return mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except (OSError, ValueError) as e:
        log.debug("store: mapping a reserved file failed (%s); it is written with writev", e)
        return None


def _copy_into(mapping: mmap.mmap, header: bytes, address: int, nbytes: int) -> None:
    """header, then the `nbytes` at `address` (a tensor's data), into the mapped file. The bulk copy is
    one memmove through ctypes, which releases the GIL (as writev does)."""
    mapping[: len(header)] = header
    dst = ctypes.c_char.from_buffer(mapping, len(header))
    try:
        ctypes.memmove(ctypes.addressof(dst), address, nbytes)
    finally:
        del dst  # (an export of the mapping: it could not be unmapped while this lives)


def tmpfs_huge(path: str, mountinfo: str | None = None, shmem_enabled: str | None = None) -> str | None:
    """How the tmpfs holding `path` (a real path) backs files with huge pages: its `huge=` mount option
    ("never" when it has none), or "force" where the kernel forces them on every tmpfs; None when `path`
    is not on a tmpfs or /proc cannot say. (`mountinfo`, `shmem_enabled`: the /proc and /sys texts, for tests.)"""
    try:
        if mountinfo is None:
            mountinfo = Path("/proc/self/mountinfo").read_text()
        if shmem_enabled is None:
            thp = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
            shmem_enabled = thp.read_text() if thp.exists() else ""
    except OSError:
        return None
    best: tuple[int, str, str] | None = None  # (mount point length, fs type, its options)
    for line in mountinfo.splitlines():
        head, sep, tail = line.partition(" - ")
        fields, rest = head.split(), tail.split()
        if not sep or len(fields) < 5 or len(rest) < 3:
            continue
        point = fields[4].replace("\\040", " ")
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) >= best[0]):  # the last of equal ones is on top
            best = (len(point), rest[0], rest[2])
    if best is None or best[1] != "tmpfs":
        return None
    if "[force]" in shmem_enabled:
        return "force"
    return next((o[len("huge="):] for o in best[2].split(",") if o.startswith("huge=")), "never")


def _write_ec_file(fd: int, header: bytes, ec_cache: torch.Tensor, *, fsync: bool, mode: int = FILE_MODE,
                   mapping: mmap.mmap | None = None) -> int:
    """Write header + tensor data to the new, empty file open as `fd` (or into its `mapping`, the file
    allocated to that size and mapped), make it `mode` (exactly, whatever the umask); return the file
    size. The caller closes `fd`. Only the store's temp files are written this way; `put` renames them
    onto the final name."""
    os.fchmod(fd, mode)
    if mapping is not None:
        nbytes = ec_cache.numel() * ec_cache.element_size()
        _copy_into(mapping, header, ec_cache.data_ptr(), nbytes)
        if len(mapping) != len(header) + nbytes:  # a spare, rounded up: trim it (nothing is written past here)
            os.ftruncate(fd, len(header) + nbytes)
        # Its pages were faulted in for writing when it was mapped (a spare: perhaps long before), which is when
        # the kernel stamped its mtime; start-up's LRU order is by mtime.
        os.utime(fd)
    else:
        data = tensor_bytes(ec_cache)  # borrows ec_cache's memory: the caller holds ec_cache meanwhile
        _write_all(fd, [header, data])
        nbytes = len(data)
    if fsync:
        os.fsync(fd)
    return len(header) + nbytes


# ---- the writer side -------------------------------------------------------------------------------
@dataclass
class _Entry:
    nbytes: int
    item: StoredItem | None  # None: on disk and counted, but not a hit (other model/format, or malformed)
    keep_until: float = 0.0  # store clock: not evicted before this (answered by /encode; min residency)


@dataclass
class PendingEntry:
    """A put in progress (see EmbeddingStore.reserve): an open, pre-allocated temp file for one key."""

    key: str
    key_dir: Path
    tmp: Path
    fd: int
    header: bytes
    shape: tuple[int, int]
    dtype: torch.dtype
    grid: tuple[int, int, int]
    content_sha256: str | None
    video: VideoMeta | None = None
    mapping: mmap.mmap | None = None  # the file mapped ahead (reserve's `mapped`); closed after the commit

    def unmap(self) -> None:
        if self.mapping is not None:
            self.mapping.close()
            self.mapping = None

    @property
    def nbytes(self) -> int:
        """The entry's file size."""
        return len(self.header) + self.shape[0] * self.shape[1] * self.dtype.itemsize


@dataclass
class _Spare:
    """A file made ahead for a lone image's entry (EmbeddingStore.prepare_spare): allocated and mapped."""

    path: Path
    fd: int
    nbytes: int
    mapping: mmap.mmap | None = None

    def drop(self) -> None:
        if self.mapping is not None:
            self.mapping.close()
            self.mapping = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        _unlink_quietly(self.path)


def _spare_size(nbytes: int) -> int:
    return -(-nbytes // SPARE_ROUND) * SPARE_ROUND


class EmbeddingStore:
    """Byte-bounded LRU store of ec_cache files under `root`, written atomically. Thread-safe.

    NOTE (other models' files): an existing file whose metadata names a different model,
    out_hidden_size, deepstack_levels, format_version (or dtype, when `dtype` is given) -- or that does
    not parse -- is indexed, counted against the capacity and evictable in LRU order, but `lookup` never
    returns it: another model's embeddings are not a cache hit. A `put` of that key overwrites it.

    NOTE (oversize items): a single item larger than the whole capacity is still written (the request
    that produced it is waiting for it, and the consumer reads it from the store), everything else is
    evicted, and a warning is logged. The next put evicts it. So the store can exceed its capacity by
    at most one item, transiently.

    NOTE (locking): `_lock` guards the index and the directory-entry steps that must not interleave
    for one key -- mkdir + create temp, rename onto the final name, unlink + rmdir on eviction. The
    tensor write itself runs outside the lock, so lookups and other puts never wait on it. A key
    directory cannot be removed by an eviction while a put's temp file is in it (rmdir of a non-empty
    directory fails, and is tolerated), and the temp file is created under the lock right after the
    mkdir, so a put of a key that is being evicted always lands.

    NOTE (minimum residency): an entry that was just written or answered as a hit is not evicted for
    `min_residency_s`: a consumer told "it is there" (vLLM's scheduler checks existence, its worker
    loads later) must still find it. When a put cannot make room without evicting such entries it
    raises StoreFull (503 + Retry-After) and writes nothing.

    One writer process per root: the index is this process's memory. Readers in other processes use
    `read_embeddings`.

    NOTE (shards): with `shard=(i, n)`, n > 1, this store is one of n writers of the root (one engine per
    device): it indexes, writes and evicts only the keys with `shard_of(key, n) == i`, leaves the others'
    files alone and uncounted, and locks `shard_lock(i, n)` instead of ROOT_LOCK (which the supervisor
    holds, so a second service on the root is still refused). The caller passes each shard its part of
    the capacity (engine/host.py build_store: capacity / n); the filesystem's free space is split the same way.
    """

    remote = False  # a lookup is a stat and a header read here: the engine host asks in place
    batch_commits = False  # the writer's threads commit a step's entries one by one (Writer._in_parallel)

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
        exclusive: bool = False,  # the service's own root: checked, locked (see _own_root)
        group: str | None = None,  # with exclusive: a group that may read the store (root 0750, files 0640)
        shard: tuple[int, int] = (0, 1),  # (index, count): see the class NOTE on shards
    ):
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be > 0, got {capacity_bytes}")
        if out_hidden_size <= 0 or deepstack_levels < 0:
            raise ValueError(f"bad out_hidden_size={out_hidden_size} / deepstack_levels={deepstack_levels}")
        if dtype is not None and dtype not in {name for name, _ in _DTYPES.values()}:
            raise ValueError(f"dtype must be float32 or bfloat16, got {dtype!r}")
        self.root = Path(root).absolute()
        self._real_root = os.path.realpath(self.root)
        self.capacity_bytes = capacity_bytes
        self.model_id = model_id
        self.out_hidden_size = out_hidden_size
        self.deepstack_levels = deepstack_levels
        self.dtype = dtype
        self.fsync = fsync
        if min_residency_s < 0:
            raise ValueError(f"min_residency_s must be >= 0, got {min_residency_s}")
        self.min_residency_s = min_residency_s
        self._clock = clock
        if not 0 <= shard[0] < shard[1]:
            raise ValueError(f"shard must be (index, count) with 0 <= index < count, got {shard}")
        self.shard = shard

        self._lock = threading.Lock()
        self._index: OrderedDict[str, _Entry] = OrderedDict()  # LRU first, MRU last
        self._bytes_used = 0
        self._evictions = 0
        self._trash: list[Path] = []  # evicted files renamed aside under _lock, unlinked outside it (_empty_trash)
        self._spare: _Spare | None = None  # under _lock (prepare_spare)

        self.file_mode = FILE_MODE
        self._lock_fd: int | None = None
        if exclusive:
            self._own_root(group, ROOT_LOCK if shard[1] == 1 else shard_lock(*shard))
        else:
            self.root.mkdir(parents=True, exist_ok=True)
        self._rebuild_index()
        self.capacity_bytes = self._fit_capacity(capacity_bytes)
        if exclusive and tmpfs_huge(self._real_root) == "never":
            # Measured on an H200 host (bench/RESULTS.md, 2026-12-03): a 448px image's 4 MB entry reserved and
            # written in 0.6 ms on a tmpfs mounted huge=always, 1.5-2.1 ms on one without huge pages.
            log.info("the store %s is on a tmpfs without huge pages: each write allocates its memory 4 KiB at a "
                     "time; a tmpfs mounted with huge=within_size writes 2-3x faster (docs/operations.md)",
                     self.root)
        self.unwritable: str | None = None  # why the last write failed, until one succeeds (/health reads it)
        with self._lock:
            self._evict_locked(keep=None)
        self._empty_trash()

    def _fit_capacity(self, wanted: int) -> int:
        """`wanted`, or less where the filesystem cannot hold it (Docker's default /dev/shm is 64 MB):
        a capacity above what fits would make every write fail with ENOSPC instead of evicting."""
        st = os.statvfs(self.root)
        # free space (this shard's part of it) plus what our entries hold
        room = st.f_bavail * st.f_frsize // self.shard[1] + self._bytes_used
        fits = int(room * 0.95)  # headroom for temp files in flight and other users of the filesystem
        if wanted <= fits:
            return wanted
        log.warning("store capacity %d bytes is more than %s can hold (%d bytes free, %d used by the store): "
                    "using %d; give the filesystem more room (e.g. docker --shm-size) or lower "
                    "--store-capacity-bytes", wanted, self.root, st.f_bavail * st.f_frsize, self._bytes_used, fits)
        return max(1, fits)

    @classmethod
    def lock_root(cls, root: Path, group: str | None) -> "EmbeddingStore":
        """Only the root checks and ROOT_LOCK (see _own_root), on an instance that indexes nothing: what
        preflight checks (then close()s), and what the supervisor of a sharded service holds until it exits."""
        probe = cls.__new__(cls)
        probe.root, probe._lock_fd = Path(root).absolute(), None
        probe._lock, probe._spare = threading.Lock(), None  # (what close() reads)
        probe._own_root(group, ROOT_LOCK)
        return probe

    def _own_root(self, group: str | None, lock_name: str) -> None:
        """Make the root this service's own: created 0700 (0750 for a reading group), refused when it
        belongs to another user or others may write it (they could plant entries that /encode would
        answer), and locked (`lock_name`) so that a second service on the same root refuses to start."""
        dir_mode, self.file_mode = (0o750, 0o640) if group else (0o700, 0o600)
        try:
            os.makedirs(self.root, mode=dir_mode)
            os.chmod(self.root, dir_mode)  # exactly, whatever the umask
            if group:
                shutil.chown(self.root, group=group)
        except FileExistsError:
            pass
        except (OSError, LookupError) as e:
            raise StoreOwnershipError(f"cannot create the store root {self.root}: {e}; choose another --store") from None
        # NOTE: lstat, not stat: a symbolic link planted where the root will be (the default is in the
        # world-writable /dev/shm) would have the service lock, write and evict inside the link's target,
        # a folder of this user's that passes every check below.
        st = os.lstat(self.root)
        if stat.S_ISLNK(st.st_mode):
            raise StoreOwnershipError(
                f"the store root {self.root} is a symbolic link (to {os.readlink(self.root)}): someone could have "
                "planted it to point the store at another folder; give --store the real path, or remove the link")
        if not stat.S_ISDIR(st.st_mode):
            raise StoreOwnershipError(f"the store root {self.root} is not a directory; choose another --store")
        if st.st_uid != os.geteuid():
            raise StoreOwnershipError(
                f"the store root {self.root} belongs to uid {st.st_uid}, not to this service (uid {os.geteuid()}): "
                "another user could have planted entries in it; choose a --store this service creates")
        if st.st_mode & 0o022:
            # A sticky shared directory (/dev/shm, /tmp) is everyone's: chmod-ing it would break it for every
            # other user and program, so the way out is a folder of the service's own inside it.
            fix = (f"give the service a folder of its own in it, e.g. --store {self.root / 'qwen3vl-encoder-cache'}"
                   if st.st_mode & stat.S_ISVTX else f"run `chmod {dir_mode:o} {self.root}` or choose another --store")
            raise StoreOwnershipError(
                f"the store root {self.root} is writable by {'others' if st.st_mode & 0o002 else 'its group'} "
                f"(mode {stat.S_IMODE(st.st_mode):04o}): they could plant entries that /encode would answer; {fix}")
        fd = os.open(self.root / lock_name, os.O_RDWR | os.O_CREAT | _O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise StoreOwnershipError(
                f"another service (pid {holder}) is writing to the store root {self.root}: one writer per root; "
                "stop it, or give this one another --store") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._lock_fd = fd  # held for the life of the store: the lock goes with the process, or close()

    def close(self) -> None:
        """Remove the spare file, if any; release the root's lock (a later service may then take the root)."""
        with self._lock:
            spare, self._spare = self._spare, None
        if spare is not None:
            spare.drop()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    # ---- public ------------------------------------------------------------------------------------
    @property
    def bytes_used(self) -> int:
        return self._bytes_used

    @property
    def evictions(self) -> int:
        return self._evictions

    def __len__(self) -> int:
        return len(self._index)

    def lru_keys(self) -> list[str]:
        """All indexed keys, least recently used first (for metrics and tests)."""
        with self._lock:
            return list(self._index)

    def abspath(self, item: StoredItem) -> Path:
        return self.root / item.path

    def lookup(self, key: str) -> StoredItem | None:
        """The stored item for `key` if it is a hit for this model; marks it most recently used."""
        validate_key(key)
        with self._lock:
            entry = self._index.get(key)
            if entry is None or entry.item is None:
                return None
            self._index.move_to_end(key)
            entry.keep_until = max(entry.keep_until, self._clock() + self.min_residency_s)  # answered: keep it
        # Outside the lock: touch the mtime, which both checks that the file still exists and makes
        # the recency survive a restart (the index is rebuilt in mtime order).
        try:
            os.utime(self.root / entry.item.path)
        except FileNotFoundError:
            with self._lock:
                if self._index.get(key) is entry:  # not already replaced/evicted by another thread
                    log.warning("store file for key %r was deleted externally; dropping it from the index", key)
                    del self._index[key]
                    self._bytes_used -= entry.nbytes
            return None
        return entry.item

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
                mapped: bool = False) -> PendingEntry:
        """The first half of `put`, for before the embeddings exist: check room, create the temp file
        and allocate its pages. Why: on tmpfs most of a write's cost is allocating and zeroing fresh
        pages (~1.5 ms for one 448px image's 4 MB); the step loop reserves while the GPU computes, and
        `commit` is then a plain copy. Every pending entry must be committed or aborted.

        `mapped`: also map the file with its pages faulted in, so that `commit` is one memmove instead of
        a writev, which goes through the page cache a page at a time. For an entry whose write delays
        its answer (a lone image): the faulting costs more than the writev saves, but it is paid here,
        while the device computes (issue 24: 2026-11-30 probes on an H200 host, writev 0.69-1.07 ms, a
        mapped copy 0.29-0.56 after a 0.75 ms populate and before a 0.22 ms unmap). Not with fsync. Where a
        spare file of its size was made ahead (prepare_spare), it takes that one instead."""
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
            self._check_room_locked(key, total)
            spare = self._spare if mapped and not self.fsync else None
            if spare is not None and spare.nbytes == _spare_size(total):
                # The file made ahead for it (prepare_spare): no create, allocate or map here. It is renamed
                # from the root onto the key's name at commit (which makes the key's directory then).
                self._spare = None
                return PendingEntry(key, key_dir, spare.path, spare.fd, header, (n, width), dtype, grid,
                                    content_sha256, video, mapping=spare.mapping)

        # The temp file is created (empty) under the lock together with the mkdir: from then on the
        # directory is non-empty, so a concurrent eviction of this key cannot rmdir it from under us.
        # NOTE (GIL): every os.* call here releases the GIL, and while another Python thread is busy
        # each retake can cost a switch interval (5 ms); so put keeps its syscalls few (one open,
        # written through that fd) and uses no torch op on the tensor (see _tensor_bytes).
        tmp = key_dir / f"{TMP_PREFIX}{secrets.token_hex(8)}"
        with self._lock:
            key_dir.mkdir(exist_ok=True)
            # (a shared writable mapping needs the file open for reading too)
            fd = os.open(tmp, os.O_CREAT | os.O_EXCL | (os.O_RDWR if mapped else os.O_WRONLY) | _O_CLOEXEC,
                         self.file_mode)
        r = PendingEntry(key, key_dir, tmp, fd, header, (n, width), dtype, grid, content_sha256, video)
        try:
            try:
                allocated = _allocate(fd, total)
            except OSError as e:
                # The filesystem is fuller than our capacity says (other users, temp files): make room
                # by evicting as if over capacity, then try once more.
                if e.errno != errno.ENOSPC or not self._evict_bytes(total, keep=key):
                    raise
                allocated = _allocate(fd, total)
            if mapped and allocated and not self.fsync:  # (a file not allocated would fault past its end)
                r.mapping = _map(fd, total)
        except OSError as e:
            self.abort(r)
            if e.errno == errno.ENOSPC:
                raise StoreFull(f"the store's filesystem ({self.root}) is full and nothing can be evicted now "
                                f"(entries answered in the last {self.min_residency_s:g} s are kept); retry "
                                "shortly, or give it more room", retry_after_s=1) from None
            self.unwritable = f"{type(e).__name__}: {e}"
            raise
        except BaseException:
            self.abort(r)
            raise
        return r

    def prepare_spare(self, like: PendingEntry) -> bool:
        """Make ahead the file that the next mapped reservation of `like`'s size takes, instead of creating,
        allocating and mapping its own: a lone image's reservation (2.4-2.8 ms for a 448px entry on an H200
        host, its pages faulted in) ended after the device and delayed its answer (issue 24, bench/RESULTS.md
        2026-12-04). The writer calls it once a lone image is answered, while the server waits for the next
        request. One spare at a time, the size of the last; none with fsync or above SPARE_MAX_BYTES (or an
        eighth of the capacity): it is held outside the capacity. Returns whether one of that size is ready;
        a failure (a full filesystem) only means there is none."""
        size = _spare_size(like.nbytes)
        if self.fsync or size > min(SPARE_MAX_BYTES, self.capacity_bytes // 8):
            return False
        with self._lock:
            if self._spare is not None and self._spare.nbytes == size:
                return True
        spare = _Spare(self.root / f"{SPARE_PREFIX}{self.shard[0]}-{secrets.token_hex(8)}", -1, size)
        try:
            spare.fd = os.open(spare.path, os.O_CREAT | os.O_EXCL | os.O_RDWR | _O_CLOEXEC, self.file_mode)
            if _allocate(spare.fd, size):  # (a file not allocated would fault past its end)
                spare.mapping = _map(spare.fd, size)
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

    def _evict_bytes(self, nbytes: int, keep: str) -> bool:
        """Evict least recently used entries (not `keep`, not young ones) holding at least `nbytes`;
        False if there were none to evict."""
        with self._lock:
            before = self._bytes_used
            self._evict_locked(keep=keep, limit=max(0, before - nbytes))
            evicted = self._bytes_used < before
        self._empty_trash()  # (the room is there once the files are gone)
        return evicted

    def abort(self, r: PendingEntry) -> None:
        """Give up a pending entry: close and remove its temp file (the key's entry, if any, is untouched)."""
        r.unmap()
        if r.fd >= 0:
            os.close(r.fd)
            r.fd = -1
        with self._lock:
            r.tmp.unlink(missing_ok=True)
            if r.key not in self._index:
                _rmdir_quietly(r.key_dir)

    def commit(self, r: PendingEntry, ec_cache: torch.Tensor,
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
            # Outside the lock, and the bulk copy releases the GIL: lookups, other puts and the service's
            # Python threads run meanwhile. `tmp` is written in place (no further temp file) and only it
            # is renamed onto the final name.
            try:
                nbytes = _write_ec_file(r.fd, r.header, ec_cache, fsync=self.fsync, mode=self.file_mode,
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

        item = StoredItem(
            key=key,
            path=f"{key}/{FILE_NAME}",
            num_tokens=n,
            grid_thw=grid,  # type: ignore[arg-type]
            shape=(n, width),
            dtype=_DTYPES[_CODE_OF[str(r.dtype)]][0],
            nbytes=nbytes,
            content_sha256=content_sha256,
            video=r.video,
        )
        with self._lock:
            if tmp.parent != key_dir:  # a spare (reserve): the key's directory may not exist yet
                key_dir.mkdir(exist_ok=True)
            os.replace(tmp, final)
            old = self._index.pop(key, None)
            if old is not None:
                self._bytes_used -= old.nbytes
            self._index[key] = _Entry(nbytes=nbytes, item=item, keep_until=self._clock() + self.min_residency_s)
            self._bytes_used += nbytes
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
                    _fsync_path(key_dir)  # makes the rename durable
                except FileNotFoundError:
                    pass  # already evicted by a concurrent put
            if answer is not None:
                answer(item)
        finally:
            r.unmap()
            self._empty_trash()
        return item

    # ---- internals ---------------------------------------------------------------------------------
    def _key_dir(self, key: str) -> Path:
        """`_key_dir(root, key)`, with one lstat in the common case instead of realpath's one per path
        component (each a chance to lose the GIL, see put): an entry of root that is not a symlink (or
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

    def _rebuild_index(self) -> None:
        """Index every `<root>/<key>/encoder_cache.safetensors` from its header, LRU order = mtime order.

        Removes temp files left by a crashed writer, this shard's spare file and empty key directories. Leaves anything that is
        not in the store's layout (other names, invalid keys) alone and uncounted, and so the keys of
        other shards (their writers run beside this one).
        """
        found: list[tuple[int, str, _Entry]] = []
        for tmp in self.root.glob(".tmp*"):
            _unlink_quietly(tmp)
        for spare in self.root.glob(f"{SPARE_PREFIX}{self.shard[0]}-*"):  # (other shards' spares are theirs)
            _unlink_quietly(spare)
        with os.scandir(self.root) as it:
            dirs = [e for e in it if e.is_dir(follow_symlinks=False)]
        for d in dirs:
            key = d.name
            if not is_store_key(key) or shard_of(key, self.shard[1]) != self.shard[0]:
                continue
            key_dir = Path(d.path)
            for tmp in key_dir.glob(".tmp*"):
                log.info("removing stale temp file %s", tmp)
                _unlink_quietly(tmp)
            path = key_dir / FILE_NAME
            try:
                fd = os.open(path, os.O_RDONLY | _O_CLOEXEC)
            except FileNotFoundError:
                _rmdir_quietly(key_dir)
                continue
            except OSError as e:
                log.warning("store: cannot open %s (%s); ignoring it", path, e)
                continue
            try:
                st = os.fstat(fd)
                try:
                    h = _read_header(fd, str(path))
                except StoreFormatError as e:
                    log.warning("store: %s; it is counted and evictable but never a hit", e)
                    h = None
            finally:
                os.close(fd)
            item = None
            if h is not None and self._is_hit(h):
                item = StoredItem(
                    key=key,
                    path=f"{key}/{FILE_NAME}",
                    num_tokens=h.shape[0],
                    grid_thw=h.grid_thw,
                    shape=h.shape,
                    dtype=h.dtype,
                    nbytes=st.st_size,
                    content_sha256=h.metadata.get("content_sha256"),
                    video=_video_meta(h.metadata),
                )
            found.append((st.st_mtime_ns, key, _Entry(nbytes=st.st_size, item=item)))
        found.sort(key=lambda f: (f[0], f[1]))
        for _, key, entry in found:
            self._index[key] = entry
            self._bytes_used += entry.nbytes
        if found:
            hits = sum(e.item is not None for _, _, e in found)
            log.info(
                "store %s: indexed %d files (%d bytes), %d usable by model %r",
                self.root, len(found), self._bytes_used, hits, self.model_id,
            )

    def _check_room_locked(self, key: str, incoming: int) -> None:
        """Raise StoreFull if `incoming` bytes for `key` cannot fit without evicting entries still in
        their minimum residency. Caller holds _lock.

        Visits only the entries this put would evict (usually one), not the whole index: the index is
        in LRU order and every touch (commit, answered lookup) moves an entry to the end with
        keep_until = now + min_residency, so keep_until never decreases along it and the entries in
        their residency are a suffix. (Scanning every entry here cost ~0.4 ms of GIL per put with a few
        thousand entries, found with py-spy under HTTP load.)"""
        old = self._index.get(key)
        used = self._bytes_used - (old.nbytes if old is not None else 0)  # a put replaces `key`'s entry
        need = used + incoming - self.capacity_bytes  # bytes the eviction after this put must free
        if need <= 0:
            return
        now, freed = self._clock(), 0
        for k, e in self._index.items():
            if k == key:
                continue
            if e.keep_until > now:  # this one and all after it are kept
                wait = max(1, math.ceil(e.keep_until - now))
                raise StoreFull(
                    f"the embedding store is full of entries answered in the last {self.min_residency_s:g} s "
                    f"({used - freed} of {self.capacity_bytes} bytes), which consumers may still be reading; "
                    f"retry in about {wait} s, or raise --store-capacity-bytes",
                    retry_after_s=wait,
                )
            freed += e.nbytes
            if freed >= need:
                return
        # Nothing young is left and still no room: only an item larger than the whole capacity gets
        # here, and it is written anyway (see the class NOTE on oversize items).

    def _evict_locked(self, keep: str | None, limit: int | None = None) -> None:
        """Evict least recently used entries (never `keep`, never one in its minimum residency) until
        within capacity (or `limit` bytes). Caller holds _lock."""
        now = self._clock()
        limit = self.capacity_bytes if limit is None else limit
        while self._bytes_used > limit:
            # The first entry other than `keep`, unless it is still in its residency: then so are all
            # after it (see _check_room_locked), and nothing may be evicted.
            victim = next((k for k in self._index if k != keep), None)
            if victim is None or self._index[victim].keep_until > now:
                return  # only `keep` and young entries are left (see the class NOTEs)
            entry = self._index.pop(victim)
            self._bytes_used -= entry.nbytes
            self._evictions += 1
            key_dir = self.root / victim
            # Renamed aside (a temp name: a crash leaves it to start-up's cleanup), unlinked by _empty_trash
            # after the lock: freeing a 448px entry's pages took 0.56 ms on a tmpfs of 4 KiB pages (0.02 ms in
            # 2 MiB ones), and every put's commit waited for the lock meanwhile. The entry is gone for readers
            # at the rename, as at an unlink; one that has the file open keeps reading it.
            trash = self.root / f"{TMP_PREFIX}evicted-{secrets.token_hex(8)}"
            try:
                os.rename(key_dir / FILE_NAME, trash)
                self._trash.append(trash)
            except FileNotFoundError:
                pass
            except OSError as e:  # the bytes are probably still used; say so rather than fail the put
                log.error("store: cannot evict %s: %s", key_dir / FILE_NAME, e)
            _rmdir_quietly(key_dir)  # fails harmlessly while a put of this key has its temp file inside

    def _empty_trash(self) -> None:
        """Unlink the files _evict_locked renamed aside. Callers hold no lock."""
        if not self._trash:  # (most commits evict nothing: no second trip through the lock; a file added
            return           # meanwhile is emptied by the thread whose eviction added it)
        with self._lock:
            trash, self._trash = self._trash, []
        for path in trash:
            try:
                _unlink_quietly(path)
            except OSError as e:
                log.error("store: cannot remove evicted file %s: %s", path, e)


def _unlink_quietly(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass


def _rmdir_quietly(path: Path) -> None:
    try:
        path.rmdir()
    except OSError:  # gone already, or not empty (a concurrent put's temp file)
        pass


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _video_meta(metadata: dict[str, str]) -> VideoMeta | None | bool:
    """A video entry's VideoMeta, None for an image's, False for a video entry whose fields do not parse
    (not a hit: its answer would lack them)."""
    try:
        return VideoMeta.from_metadata(metadata)
    except (KeyError, ValueError, TypeError):
        return False
