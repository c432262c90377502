"""service/lm/client.py: the project's clients send an /encode once more after a stale keep-alive
connection, and only then. A raw server scripts when a connection closes without answering."""

import asyncio
import threading

import httpx
import pytest

from service.lm.client import apost, post
from tests.support.live import RawHTTPServer


def _serve(script):
    """RawHTTPServer on 127.0.0.1 in a thread of its own; returns (server, base url, stop)."""
    server, ready, state = RawHTTPServer(script), threading.Event(), {}

    def run():
        async def main():
            tcp = await asyncio.start_server(server.handle, "127.0.0.1", 0)
            state["port"], state["loop"], state["stop"] = tcp.sockets[0].getsockname()[1], asyncio.get_running_loop(), asyncio.Event()
            ready.set()
            await state["stop"].wait()
            tcp.close()
            await tcp.wait_closed()
        asyncio.run(main())

    t = threading.Thread(target=run, daemon=True)
    t.start()
    ready.wait(10)

    def stop():
        state["loop"].call_soon_threadsafe(state["stop"].set)
        t.join(10)

    return server, f"http://127.0.0.1:{state['port']}", stop


STALE_SECOND = lambda conn, req: not (conn == 1 and req == 2)  # noqa: E731  connection 1 closes on its 2nd request
ALWAYS_CLOSE = lambda conn, req: False  # noqa: E731


def test_sync_post_resends_after_a_stale_connection_only():
    server, url, stop = _serve(STALE_SECOND)
    try:
        with httpx.Client(base_url=url, timeout=10) as c:
            assert [(r.status_code, again) for r, again in (post(c, "/encode", json={}) for _ in range(2))] == \
                [(200, False), (200, True)]
        assert (server.connections, server.requests) == (2, 3)
    finally:
        stop()
    server, url, stop = _serve(ALWAYS_CLOSE)
    try:
        with httpx.Client(base_url=url, timeout=10) as c, pytest.raises(httpx.RemoteProtocolError) as e:
            post(c, "/encode", json={})
        assert e.value.sent_twice is False and (server.connections, server.requests) == (1, 1)
    finally:
        stop()


def test_async_post_resends_after_a_stale_connection_only():
    async def scenario(script):
        server = RawHTTPServer(script)
        tcp = await asyncio.start_server(server.handle, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{tcp.sockets[0].getsockname()[1]}"
        out = []
        try:
            async with httpx.AsyncClient(base_url=url, timeout=10) as c:
                for _ in range(2):
                    try:
                        r, again = await apost(c, "/encode", json={})
                        out.append((r.status_code, again))
                    except httpx.TransportError as e:
                        out.append((type(e).__name__, e.sent_twice))
        finally:
            tcp.close()
            await tcp.wait_closed()
        return out, (server.connections, server.requests)

    assert asyncio.run(scenario(STALE_SECOND)) == ([(200, False), (200, True)], (2, 3))
    assert asyncio.run(scenario(ALWAYS_CLOSE)) == ([("RemoteProtocolError", False)] * 2, (2, 2))
