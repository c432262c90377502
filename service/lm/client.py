"""POST to the encoder service the way the project's own clients do (consumer, chat, router, load
tool): an idempotent request that met a stale keep-alive connection is sent once more.

NOTE: a server closes idle keep-alive connections (uvicorn after --keep-alive-s); a request that races
that close fails with no answer (RemoteProtocolError, ReadError, ...) although the server never saw it.
/encode is idempotent (the same image gives the same key and entry), so such a request is sent once
more, on a fresh connection -- but only when it went out on a reused connection: an error on a
connection opened for it says something about the server, and is raised as is. Timeouts are never
retried (the server may still be working on it).
"""

from __future__ import annotations

import httpx

from service import tracing


async def apost(client: httpx.AsyncClient, url: str, **kwargs) -> tuple[httpx.Response, bool]:
    """`await client.post(url, **kwargs)`; returns (response, whether it was sent twice). A transport
    error raised has `sent_twice` set. With tracing on, the current span's `traceparent` goes with it."""
    kwargs["headers"] = tracing.outgoing(kwargs.get("headers"))
    for attempt in (0, 1):
        opened: list[str] = []

        async def trace(event: str, info: dict) -> None:
            if event == "connection.connect_tcp.started":
                opened.append(event)

        try:
            return await client.post(url, extensions={"trace": trace}, **kwargs), attempt > 0
        except httpx.TransportError as e:
            if _final(e, attempt, opened):
                raise
    raise AssertionError("unreachable: the second attempt returns or raises")


def post(client: httpx.Client, url: str, **kwargs) -> tuple[httpx.Response, bool]:
    """`client.post(url, **kwargs)` with the same retry (synchronous clients)."""
    for attempt in (0, 1):
        opened: list[str] = []

        def trace(event: str, info: dict) -> None:
            if event == "connection.connect_tcp.started":
                opened.append(event)

        try:
            return client.post(url, extensions={"trace": trace}, **kwargs), attempt > 0
        except httpx.TransportError as e:
            if _final(e, attempt, opened):
                raise
    raise AssertionError("unreachable: the second attempt returns or raises")


def _final(e: httpx.TransportError, attempt: int, opened: list) -> bool:
    """Whether this error ends the request (see the module's NOTE): a timeout, a second attempt, or a
    connection opened for it. Marks it `sent_twice` for callers that count retries of failed requests."""
    if isinstance(e, httpx.TimeoutException) or attempt or opened:
        e.sent_twice = attempt > 0
        return True
    return False
