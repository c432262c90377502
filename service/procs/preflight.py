"""Start-up checks that run before the model is loaded, cheapest first, so that a mistake costs a
second and one line instead of a model load and a traceback:

    --model   a preset name or an existing directory          (no heavy import)
    --device  cuda asked for: the CUDA driver sees that GPU    (libcuda via ctypes, not torch)
    --devices the same for each of them
    --port    bound now, with uvicorn's SO_REUSEADDR; the socket is the one the server then serves on
    --otlp-endpoint  OpenTelemetry's SDK installed
    --store   a Mooncake master that answers (mooncake://...), or the store's own ownership checks
              (service/store/directory.py): creatable, this user's, not writable
              by others, not locked by another service

Each failure is a StartupError whose message is the line the CLI prints. None of them imports torch
(tests/unit/procs/test_preflight.py checks it): a failed check exits in about half a second (tests/unit/test_main.py
prints it), and a supervisor starts its engine process without waiting seconds on an import it does
not need.
"""

from __future__ import annotations

import ctypes
import errno
import importlib.util
import logging
import socket
import time
from pathlib import Path

from service.store.options import MOONCAKE_START_WAIT_S, parse_mooncake
from service.errors import StartupError, StoreOwnershipError
from service.presets import check_model
from service.store import lock_root

log = logging.getLogger(__name__)


def cuda_device_count() -> int:
    """GPUs the CUDA driver sees (CUDA_VISIBLE_DEVICES applies), asked of libcuda directly: milliseconds,
    where importing torch to ask takes seconds. 0 where there is no driver (or it fails to start)."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return 0
    count = ctypes.c_int(0)
    if cuda.cuInit(0) != 0 or cuda.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return 0
    return count.value


def check_device(device: str, flag: str = "--device") -> None:
    """An explicit cuda / cuda:N needs a driver that sees that GPU. (`auto` needs nothing. A CPU-only
    torch on a GPU machine passes here and is caught by the loader, before it loads anything.)
    `flag`: the setting the message names (--device, or --devices for one of them)."""
    if not device.startswith("cuda"):
        return
    n = cuda_device_count()
    index = int(device.partition(":")[2] or 0)
    if n == 0:
        raise StartupError(f"{flag} {device} asked for CUDA, but there is no CUDA driver or GPU here; "
                           f"use {flag} cpu")
    if index >= n:
        raise StartupError(f"{flag} {device}: the CUDA driver sees {n} GPU(s), cuda:0 to cuda:{n - 1}")


def bind(host: str, port: int) -> socket.socket:
    """The listening socket the server will serve on, bound now: a port in use fails before anything
    loads, and clients that connect during start-up wait in the backlog instead of being refused.
    SO_REUSEADDR as uvicorn (and asyncio) set it: a port left in TIME_WAIT by a stopped server can be
    bound again at once, one with a live listener cannot."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as e:
        sock.close()
        hint = ": another process is listening there; stop it or choose another --port" if (
            e.errno == errno.EADDRINUSE) else ""
        raise StartupError(f"cannot listen on {host}:{port}: {e.strerror or e}{hint}") from None
    sock.set_inheritable(True)  # the supervisor's API processes serve on it too
    return sock


def check_store(root: Path, group: str | None) -> None:
    """Run the store's own root checks now (creating the root if needed), then release its lock: the
    service's store takes it again once the model is loaded."""
    # NOTE: opening the store would also rebuild the index from every file in the root;
    # only its root checks are wanted here (lock_root).
    try:
        lock_root(root, group).close()
    except StoreOwnershipError as e:
        raise StartupError(str(e)) from None


def check_mooncake(url: str, wait_s: float = MOONCAKE_START_WAIT_S, timeout_s: float = 3.0) -> None:
    """`--store mooncake://HOST:PORT`: Mooncake's client is installed here and its master answers a TCP
    connection (its RPC port) within `wait_s` (tried every half second), so a wrong address fails in one
    line, not after the model loads.

    NOTE: why wait: an orchestrator starts the master and the encoders together, or restarts a master
    that died; an encoder that refused at once would exit and be restarted in a loop until it answers."""
    if importlib.util.find_spec("mooncake") is None:
        raise StartupError("--store mooncake://... needs Mooncake's client: pip install "
                           "'qwen3vl-encoder-service[mooncake]' (and Debian's libibverbs1 ibverbs-providers)")
    host, _, port = parse_mooncake(url).rpartition(":")
    deadline, said = time.monotonic() + wait_s, False
    while True:
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
            return
        except OSError as e:
            if time.monotonic() >= deadline:
                raise StartupError(f"cannot reach the Mooncake master at {host}:{port} (--store {url}) within "
                                   f"{wait_s:g} s (--mooncake-start-wait-s): {e.strerror or e}; start "
                                   "mooncake_master there, or fix --store") from None
            if not said:
                log.warning("the Mooncake master at %s:%s does not answer yet (%s): waiting up to %g s for it "
                            "(--mooncake-start-wait-s)", host, port, e.strerror or e, wait_s)
                said = True
        time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))


def check_tracing(endpoint: str | None) -> None:
    """--otlp-endpoint needs OpenTelemetry's SDK and OTLP exporter (the `tracing` extra); found, not imported."""
    if endpoint is None:
        return
    for module in ("opentelemetry.sdk", "opentelemetry.exporter.otlp.proto.http"):
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            raise StartupError(f"--otlp-endpoint needs OpenTelemetry's SDK and OTLP exporter ({module} is not "
                               "installed): pip install 'qwen3vl-encoder-service[tracing]'")


def preflight(settings) -> socket.socket:
    """Every check above, cheapest first. Returns the bound socket; raises StartupError."""
    check_model(settings.model)
    check_tracing(settings.otlp_endpoint)
    if len(settings.engine_devices) > 1:
        for device in settings.engine_devices:
            check_device(device, "--devices")
    else:
        check_device(settings.device)
    sock = bind(settings.host, settings.port)
    try:
        if settings.store_is_mooncake:
            check_mooncake(settings.store, settings.mooncake_start_wait_s)
        else:
            check_store(settings.store, settings.store_group)
    except BaseException:
        sock.close()
        raise
    return sock
