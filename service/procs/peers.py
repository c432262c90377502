"""The API processes of one service, each reachable by the others: a Unix datagram socket each, in the
service's run directory (api/sglang/rendezvous.py passes SGLang's registrations between them). Datagrams
on a Unix socket are not lost, but a receiver's queue is short (net.unix.max_dgram_qlen, 10 by default on
Linux): what does not fit waits in the sender's outbox until the receiver has room. Only a sibling that is
gone (restarting) loses a message, said in the log; the part that waited for it times out on its own."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections import deque
from collections.abc import Callable

log = logging.getLogger(__name__)

MAX_DATAGRAM = 64 * 1024  # (a registration is ~100 bytes)
MAX_OUTBOX = 100_000  # messages waiting for one sibling's room; past it the oldest are lost (said in the log)


def peer_path(rundir: str, index: int) -> str:
    return os.path.join(rundir, f"peer{index}.sock")


class UnixPeers:
    def __init__(self, rundir: str, index: int, count: int):
        self.rundir, self.index, self.count = rundir, index, count
        path = peer_path(rundir, index)
        if os.path.exists(path):
            os.unlink(path)  # (a socket left by a process of this run that was restarted)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(path)
        self.sock.setblocking(False)
        self._to: dict[int, socket.socket] = {}  # a connected socket per sibling: it polls writable when there is room
        self._outbox: dict[int, deque[bytes]] = {}

    def send(self, to: int, payload: bytes) -> None:
        box = self._outbox.setdefault(to, deque())
        if len(box) >= MAX_OUTBOX:
            box.popleft()
            log.warning("API process %d takes no messages: the oldest waiting is lost", to)
        box.append(payload)
        if len(box) == 1:
            self._flush(to)

    def _flush(self, to: int) -> None:
        box = self._outbox[to]
        try:
            sock = self._to.get(to)
            if sock is None:
                sock = self._to[to] = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                sock.setblocking(False)
                sock.connect(peer_path(self.rundir, to))
            while box:
                sock.send(box[0])
                box.popleft()
        except (BlockingIOError, InterruptedError):  # its queue is full: again when it has room
            asyncio.get_running_loop().add_writer(sock.fileno(), self._writable, to)
            return
        except OSError as e:  # (gone, or restarting: its socket is not there)
            log.warning("%d messages to API process %d were lost: %s", len(box), to, e)
            box.clear()
            self._drop(to)
        if to in self._to:
            asyncio.get_running_loop().remove_writer(self._to[to].fileno())

    def _writable(self, to: int) -> None:
        asyncio.get_running_loop().remove_writer(self._to[to].fileno())
        self._flush(to)

    def _drop(self, to: int) -> None:
        sock = self._to.pop(to, None)
        if sock is not None:
            try:
                asyncio.get_running_loop().remove_writer(sock.fileno())
            except RuntimeError:  # (closed outside the loop: nothing is registered with one)
                pass
            sock.close()

    def listen(self, deliver: Callable[[bytes], None]) -> None:
        """Deliver each datagram that arrives, on the running event loop."""
        def readable() -> None:
            while True:
                try:
                    payload = self.sock.recv(MAX_DATAGRAM)
                except (BlockingIOError, InterruptedError):
                    return
                deliver(payload)

        asyncio.get_running_loop().add_reader(self.sock.fileno(), readable)

    def close(self) -> None:
        for to in list(self._to):
            self._drop(to)
        self.sock.close()
