"""The directory store's files: writing an entry's file (allocated ahead, mapped, or with writev), the spare
file made ahead for a lone image, the tmpfs check, and the root: its entries' headers read at start, made
the service's own and locked, one writer per root (or per shard). No index and no policy here (service/store/index.py, directory.py).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import mmap
import os
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from service.errors import StoreOwnershipError
from service.store.format import (_O_CLOEXEC, FILE_MODE, FILE_NAME, StoreFormatError, VideoMeta, _Header, _read_header,
                                  tensor_bytes)
from service.store.keys import is_store_key, shard_of

if TYPE_CHECKING:  # torch is not imported here: preflight's root check (and so every start-up) would wait on it
    import torch

log = logging.getLogger(__name__)

# A lone image's next store file, made ahead (DirectoryStore.prepare_next): "<prefix><shard index>-<random>" in
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



def write_all(fd: int, bufs: list) -> None:
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


def allocate(fd: int, size: int) -> bool:
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


def map_file(fd: int, size: int) -> mmap.mmap | None:
    """The allocated file open as `fd`, mapped shared with its pages faulted in; None where that fails
    (the write then goes through writev). See DirectoryStore.reserve's `lone`."""
    try:
        return mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except (OSError, ValueError) as e:
        log.debug("store: mapping a reserved file failed (%s); it is written with writev", e)
        return None


def copy_into(mapping: mmap.mmap, header: bytes, address: int, nbytes: int) -> None:
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


def write_ec_file(fd: int, header: bytes, ec_cache: torch.Tensor, *, fsync: bool, mode: int = FILE_MODE,
                   mapping: mmap.mmap | None = None) -> int:
    """Write header + tensor data to the new, empty file open as `fd` (or into its `mapping`, the file
    allocated to that size and mapped), make it `mode` (exactly, whatever the umask); return the file
    size. The caller closes `fd`. Only the store's temp files are written this way; `put` renames them
    onto the final name."""
    os.fchmod(fd, mode)
    if mapping is not None:
        nbytes = ec_cache.numel() * ec_cache.element_size()
        copy_into(mapping, header, ec_cache.data_ptr(), nbytes)
        if len(mapping) != len(header) + nbytes:  # a spare, rounded up: trim it (nothing is written past here)
            os.ftruncate(fd, len(header) + nbytes)
        # Its pages were faulted in for writing when it was mapped (a spare: perhaps long before), which is when
        # the kernel stamped its mtime; start-up's LRU order is by mtime.
        os.utime(fd)
    else:
        data = tensor_bytes(ec_cache)  # borrows ec_cache's memory: the caller holds ec_cache meanwhile
        write_all(fd, [header, data])
        nbytes = len(data)
    if fsync:
        os.fsync(fd)
    return len(header) + nbytes


@dataclass
class PendingEntry:
    """A write in progress (DirectoryStore.reserve): an open, pre-allocated temp file for one key."""

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
    mapping: mmap.mmap | None = None  # the file mapped ahead (DirectoryStore.reserve's `lone`); closed after the commit

    def unmap(self) -> None:
        if self.mapping is not None:
            self.mapping.close()
            self.mapping = None

    @property
    def nbytes(self) -> int:
        """The entry's file size."""
        return len(self.header) + self.shape[0] * self.shape[1] * self.dtype.itemsize


@dataclass
class Spare:
    """A file made ahead for a lone image's entry (DirectoryStore.prepare_next): allocated and mapped."""

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
        unlink_quietly(self.path)


def spare_size(nbytes: int) -> int:
    return -(-nbytes // SPARE_ROUND) * SPARE_ROUND


@dataclass
class RootLock:
    """A store root's lock, held by its one writer (own_root), or by the supervisor of a sharded service."""

    fd: int | None

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def lock_root(root: Path, group: str | None) -> RootLock:
    """The root's checks and ROOT_LOCK, as a store's own (own_root), without a store: what preflight checks
    (then closes), and what the supervisor of a sharded service holds until it exits."""
    return RootLock(own_root(Path(root).absolute(), group, ROOT_LOCK)[0])


def scan_root(root: Path, shard: tuple[int, int]) -> list[tuple[int, str, int, _Header | None]]:
    """Every `<root>/<key>/encoder_cache.safetensors` of shard (i, n) as (mtime_ns, key, file size, its header,
    None where it does not parse).

    Removes temp files left by a crashed writer, this shard's spare file and empty key directories. Leaves
    anything that is not in the store's layout (other names, invalid keys) alone and uncounted, and so the
    keys of other shards (their writers run beside this one)."""
    found = []
    for tmp in root.glob(".tmp*"):
        unlink_quietly(tmp)
    for spare in root.glob(f"{SPARE_PREFIX}{shard[0]}-*"):  # (other shards' spares are theirs)
        unlink_quietly(spare)
    with os.scandir(root) as it:
        dirs = [e for e in it if e.is_dir(follow_symlinks=False)]
    for d in dirs:
        key = d.name
        if not is_store_key(key) or shard_of(key, shard[1]) != shard[0]:
            continue
        key_dir = Path(d.path)
        for tmp in key_dir.glob(".tmp*"):
            log.info("removing stale temp file %s", tmp)
            unlink_quietly(tmp)
        path = key_dir / FILE_NAME
        try:
            fd = os.open(path, os.O_RDONLY | _O_CLOEXEC)
        except FileNotFoundError:
            rmdir_quietly(key_dir)
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
        found.append((st.st_mtime_ns, key, st.st_size, h))
    return found


def own_root(root: Path, group: str | None, lock_name: str) -> tuple[int, int]:
    """Make `root` this service's own: created 0700 (0750 for a reading group), refused when it belongs to
    another user or others may write it (they could plant entries that /encode would answer), and locked
    (`lock_name`) so that a second service on the same root refuses to start. Returns (the lock's file
    descriptor, held for the life of the store: the lock goes with the process, or when it is closed; the
    mode of the files the store writes)."""
    dir_mode, file_mode = (0o750, 0o640) if group else (0o700, 0o600)
    try:
        os.makedirs(root, mode=dir_mode)
        os.chmod(root, dir_mode)  # exactly, whatever the umask
        if group:
            shutil.chown(root, group=group)
    except FileExistsError:
        pass
    except (OSError, LookupError) as e:
        raise StoreOwnershipError(f"cannot create the store root {root}: {e}; choose another --store") from None
    # NOTE: lstat, not stat: a symbolic link planted where the root will be (the default is in the
    # world-writable /dev/shm) would have the service lock, write and evict inside the link's target,
    # a folder of this user's that passes every check below.
    st = os.lstat(root)
    if stat.S_ISLNK(st.st_mode):
        raise StoreOwnershipError(
            f"the store root {root} is a symbolic link (to {os.readlink(root)}): someone could have "
            "planted it to point the store at another folder; give --store the real path, or remove the link")
    if not stat.S_ISDIR(st.st_mode):
        raise StoreOwnershipError(f"the store root {root} is not a directory; choose another --store")
    if st.st_uid != os.geteuid():
        raise StoreOwnershipError(
            f"the store root {root} belongs to uid {st.st_uid}, not to this service (uid {os.geteuid()}): "
            "another user could have planted entries in it; choose a --store this service creates")
    if st.st_mode & 0o022:
        # A sticky shared directory (/dev/shm, /tmp) is everyone's: chmod-ing it would break it for every
        # other user and program, so the way out is a folder of the service's own inside it.
        fix = (f"give the service a folder of its own in it, e.g. --store {root / 'qwen3vl-encoder-cache'}"
               if st.st_mode & stat.S_ISVTX else f"run `chmod {dir_mode:o} {root}` or choose another --store")
        raise StoreOwnershipError(
            f"the store root {root} is writable by {'others' if st.st_mode & 0o002 else 'its group'} "
            f"(mode {stat.S_IMODE(st.st_mode):04o}): they could plant entries that /encode would answer; {fix}")
    fd = os.open(root / lock_name, os.O_RDWR | os.O_CREAT | _O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise StoreOwnershipError(
            f"another service (pid {holder}) is writing to the store root {root}: one writer per root; "
            "stop it, or give this one another --store") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    return fd, file_mode


def unlink_quietly(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass


def rmdir_quietly(path: Path) -> None:
    try:
        path.rmdir()
    except OSError:  # gone already, or not empty (a concurrent put's temp file)
        pass


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
