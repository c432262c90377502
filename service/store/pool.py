"""Joining a Mooncake Store pool: a set-up client (`connect`), and, for a host that adds a segment, its
memory faulted in at start so that its first puts pay no page faults. The store itself (its layout, writes
and lookups) is service/store/mooncake.py."""

from __future__ import annotations

import ctypes
import logging
import os
import time

from service.errors import Unavailable
from service.store.options import MooncakeOptions

log = logging.getLogger(__name__)


def connect(options: MooncakeOptions):
    """A set-up Mooncake client, or Unavailable saying why not."""
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as e:
        raise Unavailable(f"Mooncake's client is not installed here ({e}): pip install "
                          "'qwen3vl-encoder-service[mooncake]' (and Debian's libibverbs1 ibverbs-providers)") from None
    # NOTE: Mooncake's transfer engine takes the address it advertises to peers from this variable, read
    # when the client is set up (no parameter carries it); unset, it advertises the first non-loopback
    # interface, whatever --mooncake-local-host says.
    os.environ["MC_TCP_BIND_ADDRESS"] = options.local_host
    client = MooncakeDistributedStore()
    before = anonymous_mappings() if options.segment_bytes else set()
    rc = client.setup(options.local_host, "P2PHANDSHAKE", options.segment_bytes, options.buffer_bytes,
                      options.protocol, "", options.master)
    if rc != 0:
        raise Unavailable(f"cannot join the Mooncake pool at {options.master} (setup returned {rc}): is "
                          "mooncake_master running there, and is --mooncake-local-host this host's address?",
                          retry_after_s=5)
    if options.segment_bytes:
        fault_in(added_ranges(before, anonymous_mappings()), options.segment_bytes + options.buffer_bytes)
    return client


MADV_POPULATE_WRITE = 23  # Linux 5.14: allocate and map every page of a range, its contents untouched
FAULT_CHUNK = 256 * 1024**2
# Mappings under this are not faulted in: the threads setup starts (three dozen with the TCP transport)
# each map an 8 MiB stack, which would otherwise all become resident (280 MiB seen with a 256 MiB segment).
FAULT_MIN_MAPPING = 16 * 1024**2


def anonymous_mappings() -> set[tuple[int, int]]:
    """(start, end) of this process's private read-write mappings of no file (/proc/self/maps; a line with
    no path), the memory malloc and mmap hand out. Empty where there is no /proc."""
    try:
        with open("/proc/self/maps") as f:
            lines = f.read().splitlines()
    except OSError:
        return set()
    out = set()
    for line in lines:
        fields = line.split()
        if len(fields) == 5 and fields[1] == "rw-p":
            start, end = fields[0].split("-")
            out.add((int(start, 16), int(end, 16)))
    return out


def added_ranges(before: set[tuple[int, int]], after: set[tuple[int, int]]) -> set[tuple[int, int]]:
    """The address ranges of `after`'s mappings that no mapping of `before` covered: a new mapping whole,
    and of a mapping the kernel merged with an older neighbour only the part that was added.

    NOTE: why not `after - before`: a merged mapping brings its old neighbour along, and a full-suite run
    saw the segment merged into a 1.6 GB older one; fault_in then skipped it (far more than the segment),
    and the first puts paid the page faults."""
    old = sorted(before)
    out = set()
    for start, end in after - before:
        at = start
        for a, b in old:  # disjoint, in address order
            if b <= at or a >= end:
                continue
            if a > at:
                out.add((at, a))
            at = max(at, b)
        if at < end:
            out.add((at, end))
    return out


def fault_in(ranges: set[tuple[int, int]], expected: int) -> None:
    """Fault in now every page of the mappings Mooncake's setup made (its segment and transfer buffer),
    with madvise(MADV_POPULATE_WRITE) from several threads, a chunk each.

    NOTE: why: Mooncake allocates the segment and leaves its pages untouched, so each page's first put
    paid a page fault and the kernel's zeroing of it, all in Mooncake's one memcpy thread (a put into
    this host's own segment is a local memcpy). On the H200 that thread was the engine's busiest (7.6
    CPU-s, 5.85 of them in the kernel, in 9 s of load) and held HTTP img/s at 1 image per request to
    0.62 of the directory's until the 12 GiB segment had been written once; faulted in at start, 0.96
    and 0.99. On the 2-core machine (a probe now in git history, 1 GiB): puts into a fresh segment
    271.8 MB/s with 3.39 s in the kernel, into one faulted in at start 11,572.7 MB/s. The segment is
    memory promised to the pool: it is taken now.

    `ranges`: the address ranges that setup mapped (added_ranges). Skipped, with a warning, where they
    hold far more than `expected` (not Mooncake's alone) or the kernel lacks MADV_POPULATE_WRITE. Ranges
    under FAULT_MIN_MAPPING (thread stacks) are left as they are."""
    ranges = {(start, end) for start, end in ranges if end - start >= FAULT_MIN_MAPPING}
    total = sum(end - start for start, end in ranges)
    if not ranges or total > 2 * expected + FAULT_CHUNK:
        log.warning("Mooncake segment: not faulted in at start (%d new mappings of %d bytes for a segment and "
                    "buffer of %d); its first puts pay the page faults", len(ranges), total, expected)
        return
    import concurrent.futures

    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    chunks = [(a, min(end, a + FAULT_CHUNK)) for start, end in ranges for a in range(start, end, FAULT_CHUNK)]

    def one(chunk: tuple[int, int]) -> int:
        return 0 if libc.madvise(chunk[0], chunk[1] - chunk[0], MADV_POPULATE_WRITE) == 0 else ctypes.get_errno()

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(min(8, os.cpu_count() or 1), thread_name_prefix="mc-fault") as pool:
        errors = {e for e in pool.map(one, chunks) if e}
    if errors:
        log.warning("Mooncake segment: faulting it in failed (%s); its first puts pay the page faults",
                    ", ".join(os.strerror(e) for e in sorted(errors)))
        return
    log.info("Mooncake segment: %.2f GiB faulted in in %.2f s", total / 1024**3, time.perf_counter() - t0)
