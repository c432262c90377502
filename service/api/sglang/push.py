"""Where SGLang's messages go, and how they get there: ZMQ PUSH to the language side's PULL sockets.

A request names the address its message is pushed to (`prefill_host`, or a rank's `receive_url`), and
anyone who can reach /sglang could name any address: so both the caller and every destination must be in
--sglang-allowed-hosts (CIDRs; loopback only by default), or nothing is sent. A push has a deadline
(--sglang-push-timeout-s) and runs on the event loop without blocking it (pyzmq's asyncio sockets): a
language side that is gone or never reads costs its own part that deadline and nothing else.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from typing import NamedTuple

from service.errors import RequestError

log = logging.getLogger(__name__)

# How long zmq keeps flushing a message already handed to a live connection after its socket is closed
# (SGLang's own encoder closes its sockets with the same linger).
LINGER_MS = 5000


class Endpoint(NamedTuple):
    host: str  # an IP address
    port: int

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"tcp://{host}:{self.port}"


class PushFailed(Exception):
    """A message that did not reach its destination within the deadline (its text says why)."""


class Pusher:
    """Checks destinations against the allow-list and pushes messages; one per serving process."""

    def __init__(self, allowed: list[str], timeout_s: float):
        self.networks = [ipaddress.ip_network(c, strict=False) for c in allowed]
        self.timeout_s = timeout_s
        self._context = None

    def allowed(self, host: str) -> bool:
        try:
            addr = ipaddress.ip_address(host.strip("[]").split("%")[0])
        except ValueError:
            return False
        if addr.version == 6 and addr.ipv4_mapped is not None:
            addr = addr.ipv4_mapped
        return any(addr in net for net in self.networks)

    def endpoint(self, host: str, port: int, what: str) -> Endpoint:
        """The destination `host`:`port` if it is allowed; else 403 `forbidden`, naming it."""
        if not self.allowed(host):
            raise RequestError(f"{what} {host!r} is not in --sglang-allowed-hosts: embeddings are pushed only to "
                               "addresses allowed there (add the language servers' network)", code="forbidden")
        return Endpoint(host.strip("[]"), port)

    def parse_receive_url(self, url: str) -> Endpoint:
        """A rank's `host:port` (an IPv6 host in brackets), allowed; else a 400 or 403 saying why."""
        host, sep, port = url.rpartition(":")
        if not sep or not port.isdigit() or not 0 < int(port) < 65536 or not host:
            raise RequestError(f"receive_url {url!r} is not host:port")
        return self.endpoint(host, int(port), "receive_url's host")

    async def push(self, to: Endpoint, frames: list, deadline: float) -> None:
        """Send one multipart message to `to`, by the loop's time `deadline`; PushFailed if it cannot. Returns
        once the message is queued on a live connection (zmq's IMMEDIATE: never to a peer not there)."""
        import zmq  # (pyzmq is needed only where SGLang's protocol is served)

        sock = self._ctx().socket(zmq.PUSH)
        sock.setsockopt(zmq.IMMEDIATE, 1)
        if ":" in to.host:
            sock.setsockopt(zmq.IPV6, 1)
        sent = False
        try:
            sock.connect(to.url)
            left = deadline - asyncio.get_running_loop().time()
            await asyncio.wait_for(sock.send_multipart(frames, copy=False), max(left, 0.001))
            sent = True
        except (asyncio.TimeoutError, TimeoutError):
            raise PushFailed(f"the language side at {to.url} did not take the message within "
                             f"{self.timeout_s:g} s (--sglang-push-timeout-s)") from None
        except zmq.ZMQError as e:
            raise PushFailed(f"pushing to {to.url} failed: {e}") from None
        finally:
            sock.close(linger=LINGER_MS if sent else 0)

    def _ctx(self):
        if self._context is None:
            import zmq.asyncio

            self._context = zmq.asyncio.Context()
        return self._context

    def close(self) -> None:
        if self._context is not None:
            self._context.term()  # (sockets are closed after each push; their linger bounds this)
            self._context = None
