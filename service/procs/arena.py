"""A shared-memory arena for decoded pixels: how an API process hands images to the engine process
without pickling or piping them.

One arena per API process, one POSIX shared-memory segment (in /dev/shm), carved into cells by a
first-fit allocator that only the owning process touches. The API process writes an image's pixels
into a cell and sends the engine (segment name, offset, size); the engine reads them in place while
staging a step and says when it is done with the cell (see ipc.py: CELL_FREE). Nothing else crosses.

Why per process and not one shared allocator: no cross-process lock, and a crashed API process takes
its whole segment with it (the supervisor unlinks it) instead of leaking cells in a shared one.
"""

from __future__ import annotations

import bisect
import mmap
import os
import threading

import numpy as np

from service.errors import Overloaded

SHM_DIR = "/dev/shm"

ALIGN = 64  # bytes; cells start on cache-line boundaries


def _cell_size(nbytes: int) -> int:
    return max(ALIGN, -(-nbytes // ALIGN) * ALIGN)


class Arena:
    """Owner side: allocate and free cells of one segment. Thread-safe (decode threads allocate)."""

    def __init__(self, name: str, size: int):
        self.size = size - size % ALIGN
        self.name = name
        # NOTE: a file in /dev/shm made by hand, not multiprocessing.shared_memory: that registers every
        # segment with Python's resource tracker, which then unlinks or warns about segments this
        # service hands between processes on purpose. Lifetime here: the owner unlinks it at exit; the
        # supervisor unlinks the segment of an API process that died.
        self.path = os.path.join(SHM_DIR, name)
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR | getattr(os, "O_CLOEXEC", 0), 0o600)
        try:
            os.ftruncate(fd, self.size)
            self._map = mmap.mmap(fd, self.size)
        finally:
            os.close(fd)
        self.buf = np.frombuffer(self._map, dtype=np.uint8)
        self._lock = threading.Lock()
        self._free: list[tuple[int, int]] = [(0, self.size)]  # (offset, size), sorted by offset
        self.used = 0  # bytes in cells handed out

    def alloc(self, nbytes: int) -> int:
        """Offset of a new cell of at least `nbytes`. Raises `overloaded`."""
        need = _cell_size(nbytes)
        with self._lock:
            for i, (off, size) in enumerate(self._free):
                if size >= need:
                    if size == need:
                        del self._free[i]
                    else:
                        self._free[i] = (off + need, size - need)
                    self.used += need
                    return off
        raise Overloaded(f"no free {need}-byte cell in the {self.size}-byte pixel arena ({self.used} in use)")

    def free(self, off: int, nbytes: int) -> None:
        need = _cell_size(nbytes)
        with self._lock:
            i = bisect.bisect_left(self._free, (off, 0))
            assert (i == 0 or sum(self._free[i - 1]) <= off) and (i == len(self._free) or off + need <= self._free[i][0]), \
                f"double free of cell {off}: this is a bug"
            self._free.insert(i, (off, need))
            # Merge with the neighbours, so the arena does not fragment into small cells.
            if i + 1 < len(self._free) and off + need == self._free[i + 1][0]:
                self._free[i] = (off, need + self._free.pop(i + 1)[1])
            if i > 0 and sum(self._free[i - 1]) == off:
                prev = self._free.pop(i - 1)
                self._free[i - 1] = (prev[0], prev[1] + self._free[i - 1][1])
            self.used -= need

    def view(self, off: int, nbytes: int) -> np.ndarray:
        return self.buf[off : off + nbytes]

    def close(self) -> None:
        """Unmap and unlink the segment (the engine's mapping, if any, stays valid until it closes)."""
        del self.buf
        try:
            self._map.close()
        except BufferError:
            pass  # a view is still alive somewhere; the mapping goes with the process
        unlink_segment(self.name)


class ArenaReader:
    """Reader side (the engine): map segments by name on first use, read cells in place."""

    def __init__(self) -> None:
        self._maps: dict[str, mmap.mmap] = {}
        self._lock = threading.Lock()

    def view(self, name: str, off: int, nbytes: int) -> np.ndarray:
        with self._lock:
            m = self._maps.get(name)
            if m is None:
                if "/" in name or not name.startswith("qve-"):
                    raise ValueError(f"not a pixel arena: {name!r}")
                fd = os.open(os.path.join(SHM_DIR, name), os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
                try:
                    m = self._maps[name] = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
                finally:
                    os.close(fd)
        if off < 0 or off + nbytes > len(m):
            raise ValueError(f"cell {off}+{nbytes} outside arena {name!r} of {len(m)} bytes")
        return np.frombuffer(m, dtype=np.uint8, count=nbytes, offset=off)

    def forget(self, name: str) -> None:
        """Drop this reader's mapping of `name` (its API process is gone): unmapped once the last view of
        its cells is released, so a dead process's segment, unlinked by the supervisor, does not stay
        mapped in the engine for its whole life (up to the arena's size per restart)."""
        with self._lock:
            self._maps.pop(name, None)


def unlink_segment(name: str) -> None:
    try:
        os.unlink(os.path.join(SHM_DIR, name))
    except FileNotFoundError:
        pass


def segment_name(supervisor_pid: int, index: int, generation: int) -> str:
    """The name of API process `index`'s segment; the supervisor unlinks it if that process dies."""
    return f"qve-{supervisor_pid}-api{index}-{generation}"


def leaked_segments(supervisor_pid: int) -> list[str]:
    """Segments of this supervisor still in /dev/shm (for the supervisor's cleanup and for tests)."""
    try:
        return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(f"qve-{supervisor_pid}-"))
    except FileNotFoundError:
        return []
