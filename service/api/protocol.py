"""uvicorn's HTTP protocol with a request-head timeout, and its protocol-level errors in the service's
JSON error shape.

uvicorn keeps no timer while a request head (request line and headers) arrives: a client that opens a
connection and sends nothing, or a few bytes of headers now and then (slowloris), holds that connection
(a file descriptor, and one of --max-connections) forever. Here, from the moment a connection opens, or
the first byte of its next request arrives, the whole head must be in within `header_timeout_s`;
otherwise a 408 (when some of the head came) or a plain close (when nothing came: an idle connection
is closed as uvicorn's keep-alive timeout closes one). Between requests uvicorn's keep-alive timeout
applies, and once the head is in, the body timeout (server.BodyLimit). A head over MAX_HEAD_BYTES gets a
431 at once: httptools has no cap of its own and buffered a 64 MB header line until the timer. At the
connection limit, a new connection closes those that have waited longest for a head (`_make_room`).
"""

from __future__ import annotations

import asyncio
import sys
from http import HTTPStatus

from service import errors
from service.errors import RequestError, ServiceError, Unavailable

# NOTE: a fixed cap, as nginx's header buffers (4 x 8 KB) are: a real request head is a few hundred
# bytes (a browser's with cookies a few KB); h11's own cap is set above it (server_options) so both
# protocols answer alike.
MAX_HEAD_BYTES = 65536
# h11's cap on what it buffers (uvicorn's h11_max_incomplete_event_size): above the most the parser can
# hold when HeaderTimeout counts, the cap plus one read. NOTE: one read can be 256 KiB (asyncio's socket
# reads); at 2 x MAX_HEAD_BYTES a fresh-clone run on a loaded machine got one read large enough that h11
# answered 400 before the cap's 431 (tests/unit/api/test_protocol.py feeds such a read).
H11_MAX_INCOMPLETE_BYTES = MAX_HEAD_BYTES + 1024 * 1024
LINGER_S = 0.5  # how long a connection refused with 431 is still read (and dropped) before it closes


def _raw_response(err: ServiceError) -> bytes:
    """The whole HTTP/1.1 answer to `err` on a connection it then closes (errors.response builds it)."""
    status, headers, body = errors.response(err)
    headers["connection"] = "close"
    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    return f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\n{head}content-length: {len(body)}\r\n\r\n".encode() + body


class HeaderTimeout:
    """Mixin for uvicorn's HttpToolsProtocol and H11Protocol (both keep `self.cycle`, the current
    request's RequestResponseCycle, set once a head is complete). Use `header_timeout_protocol`."""

    header_timeout_s: float = 20.0
    _head_timer: asyncio.TimerHandle | None = None
    _head_bytes = False  # some of the awaited head has arrived
    _head_len = 0  # bytes received while the head is awaited
    _refused = False  # a 431 was sent; the connection closes after LINGER_S
    _waiting_since = 0.0  # when this connection began to wait for its next head (loop time)

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._waiting_since = self.loop.time()
        self._arm_head_timer()
        self._make_room()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._waiting_since = self.loop.time()

    def _make_room(self) -> None:
        """At the connection limit (--max-connections), close the connections that have waited longest for
        a request head, so that this one is served: a connection that sends nothing holds a file
        descriptor and a place, not work. 2,500 idle connections made every new request 503 until the
        head timer closed them, 20 s later. Busy connections (a request being read
        or answered) are never closed for it: beyond them, a new request still gets 503.
        NOTE: nginx reuses idle keep-alive connections so when it runs out of connections."""
        limit = self.limit_concurrency
        excess = len(self.connections) - limit + 1 if limit else 0  # (uvicorn counts this one too)
        if excess <= 0:
            return
        waiting = sorted((c for c in self.connections if c is not self and isinstance(c, HeaderTimeout)
                          and c._awaiting_head() and not c._refused and not c.transport.is_closing()),
                         key=lambda c: c._waiting_since)
        for c in waiting[:excess]:
            c._disarm_head_timer()
            c.transport.close()
            # (uvicorn's connection_lost, a loop callback later, discards it too: under uvloop that can come
            # after this connection's head has been read and counted against the limit)
            self.connections.discard(c)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # (a 431 was sent: the rest is read and dropped until the connection closes)
        head_before = self._awaiting_head()
        super().data_received(data)  # may complete a head (a new cycle), answer 400, or close
        if not self._awaiting_head():
            self._disarm_head_timer()
            return
        if head_before:
            # NOTE: counted only when the parser awaited a head before and after these bytes: a chunk that
            # completes a head (and carries the start of its body) is not head, nor one that ends a body
            # (of a request answered before its body was read) and starts the next head. The parser holds
            # at most the cap and one read.
            self._head_len += len(data)
            if self._head_len > MAX_HEAD_BYTES and not self.transport.is_closing():
                self._disarm_head_timer()
                self.transport.write(_raw_response(RequestError(
                    f"the request head (request line and headers) is over {MAX_HEAD_BYTES} bytes", code="header_too_large")))
                # NOTE: closed a moment later, reading and dropping meanwhile (nginx's lingering close):
                # closed at once with the client's bytes unread, the kernel answers a reset, which can
                # destroy the 431 before the client reads it.
                self._refused = True
                self.loop.call_later(LINGER_S, self.transport.close)
                return
            self._head_bytes = True
        # (after a body's last bytes the timer closes an idle connection silently: uvicorn's keep-alive
        # timer, armed when the answer went, was cancelled by those bytes)
        self._arm_head_timer()

    def connection_lost(self, exc) -> None:
        self._disarm_head_timer()
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        # uvicorn's own answer to a malformed request (text/plain): the service's one error shape instead.
        self.transport.write(_raw_response(RequestError(msg)))
        self.transport.close()

    def _awaiting_head(self) -> bool:
        # NOTE: an answer can go before its request's body has arrived (a refusal that reads no body): the
        # rest of that body is still the parser's body, not a head.
        # (_body_arriving: from the protocol's own mixin below)
        return (self.cycle is None or self.cycle.response_complete) and not self._body_arriving()

    def _arm_head_timer(self) -> None:
        # NOTE: armed once per head, never pushed back: a client trickling a byte now and then gains nothing.
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_timed_out)

    def _disarm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        self._head_bytes = False
        self._head_len = 0

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or not self._awaiting_head():
            return
        if self._head_bytes:
            self.transport.write(_raw_response(RequestError(
                f"the request head (request line and headers) did not arrive within {self.header_timeout_s:g} s "
                "(--header-timeout-s); send it without pauses", code="request_timeout")))
        self.transport.close()


class _HttpToolsBody:
    """httptools: between a head's end and its message's end the parser reads a body."""

    _in_body = False

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        self._in_body = True

    def on_message_complete(self) -> None:
        self._in_body = False  # (before uvicorn's own, which returns early when the answer went already)
        super().on_message_complete()

    def _body_arriving(self) -> bool:
        return self._in_body


class _H11Body:
    """h11: the peer's state says it."""

    def _body_arriving(self) -> bool:
        import h11  # (h11 is uvicorn's dependency; imported only where its protocol is used)
        return self.conn.their_state is h11.SEND_BODY


async def over_limit(scope, receive, send) -> None:
    """The answer to a request beyond --max-connections (uvicorn's `limit_concurrency`): uvicorn's own is
    a text/plain "Service Unavailable"; this is the service's JSON error shape, with Retry-After."""
    status, headers, body = errors.response(Unavailable(
        "this server has too many open connections and requests in progress (--max-connections); retry shortly",
        retry_after_s=1))
    raw = [(k.encode(), v.encode()) for k, v in headers.items()]
    await send({"type": "http.response.start", "status": status,
                "headers": [*raw, (b"content-length", str(len(body)).encode()), (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def header_timeout_protocol(timeout_s: float, base: type | None = None) -> type:
    """uvicorn's HTTP protocol class with HeaderTimeout. `base`: the uvicorn protocol to extend; default
    what uvicorn's "auto" picks (httptools where it is installed, else h11).

    Also makes `over_limit` the protocol's answer beyond the concurrency limit. uvicorn picks that app
    inside its head parser by the module-level name `service_unavailable` (uvicorn 0.2x-0.54), so the
    name is rebound in the protocol's module: every server of this process answers so, which is what
    the service wants (tests/unit/api/test_protocol.py fails if uvicorn stops looking it up there)."""
    if base is None:
        try:
            from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as base
        except ImportError:
            from uvicorn.protocols.http.h11_impl import H11Protocol as base
    module = sys.modules[base.__module__]
    if hasattr(module, "service_unavailable"):
        module.service_unavailable = over_limit
    body = _HttpToolsBody if hasattr(base, "on_headers_complete") else _H11Body
    return type(f"HeaderTimeout{base.__name__}", (HeaderTimeout, body, base), {"header_timeout_s": timeout_s})
