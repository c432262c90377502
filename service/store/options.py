"""What a store is opened with (Settings.store_options derives it; service/store/__init__.py's open_store
takes it): a directory, or a Mooncake Store pool and how this host joins it."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path


def default_store_dir() -> Path:
    # /dev/shm is RAM-backed and shared between containers that mount it: the LM consumer reads
    # embeddings at memory speed. Fall back to the temp dir where it does not exist (macOS).
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(os.environ.get("TMPDIR", "/tmp"))
    return base / "qwen3vl-encoder-cache"


MOONCAKE_SCHEME = "mooncake://"
# A Mooncake client's local transfer buffer: staging for one step's puts and a consumer's reads (an
# entry of a 1080p image at 32B-preset width is about 24 MB).
MOONCAKE_BUFFER_BYTES = 64 * 1024**2
# The longest a Mooncake call may take before it counts as failed (--mooncake-timeout-s): a read's is a
# miss, a lookup's or a write's a 503. Loopback calls take a millisecond and a step's puts into this host's
# own segment well under a second; a host that is stopped would hold a read for up to a minute.
MOONCAKE_TIMEOUT_S = 5.0
# How long a service starting waits for its master to answer (--mooncake-start-wait-s): one started beside
# it, or restarted, answers within seconds; a wrong address fails after this.
MOONCAKE_START_WAIT_S = 60.0
_MOONCAKE_RE = re.compile(r"^mooncake://([A-Za-z0-9.\-]+|\[[0-9A-Fa-f:]+\]):(\d{1,5})$")


def parse_mooncake(url: str) -> str:
    """`mooncake://HOST:PORT` -> "HOST:PORT" (the master's RPC address); ValueError with the fix otherwise."""
    m = _MOONCAKE_RE.match(url)
    if m is None or not 0 < int(m[2]) < 65536:
        raise ValueError(f"{url!r} is not a Mooncake master address: write mooncake://MASTER_HOST:RPC_PORT "
                         "(the master's --rpc_address and --rpc_port)")
    return f"{m[1]}:{m[2]}"


@dataclass(frozen=True, kw_only=True)
class MooncakeOptions:
    """One Mooncake client (store/mooncake.py), from --store mooncake://... and the --mooncake-* settings."""

    master: str  # HOST:PORT of mooncake_master's RPC
    local_host: str  # the address the pool's peers reach this host at
    segment_bytes: int  # what this host adds to the pool; 0: a client only (its puts land in others' segments)
    buffer_bytes: int  # the client's local transfer buffer
    protocol: str  # "tcp" | "rdma"
    namespace: str | None  # None: this service's own (store/mooncake.py's default_namespace)
    timeout_s: float = MOONCAKE_TIMEOUT_S  # the deadline of each Mooncake call (store/calls.py)


@dataclass(frozen=True, kw_only=True)
class StoreOptions:
    """What an engine's embedding store and its writer need (Settings.store_options)."""

    root: Path | str  # the directory, or the mooncake:// URL (then `mooncake` says how to join the pool)
    mooncake: MooncakeOptions | None
    capacity_bytes: int  # of the whole store: with n engines, each one's shard gets capacity_bytes // n
    group: str | None  # a group that may read the store, or None (the service's user alone)
    min_residency_s: float  # an answered entry is not evicted for this long
    writers: int  # threads writing one step's entries, the writer thread included
