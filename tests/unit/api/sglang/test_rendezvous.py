"""Where a scheduler-path part's ranks are found (service/api/sglang/rendezvous.py): registrations that reach
any API process, before or after the part's /encode reaches another, get to the process serving the part;
what nobody claims is forgotten. Three processes' Registrations joined by an in-memory link (the datagrams of
procs/peers.py: tests/unit/procs/test_peers.py)."""

import asyncio
import zlib

import pytest

from service.api.sglang import rendezvous
from service.api.sglang.rendezvous import Registrations


class _Link:
    def __init__(self, net: dict, index: int, count: int):
        self.net, self.index, self.count, self.sent = net, index, count, 0

    def send(self, to: int, payload: bytes) -> None:
        self.sent += 1
        asyncio.get_running_loop().call_soon(self.net[to], payload)  # (a datagram arrives later, not in the call)

    def listen(self, deliver) -> None:
        self.net[self.index] = deliver


def _processes(n: int) -> tuple[list[Registrations], list[_Link]]:
    net: dict = {}
    links = [_Link(net, i, n) for i in range(n)]
    return [Registrations(link, keep_s=60) for link in links], links


def _req_ids(n: int, registrar: int, processes: int) -> list[str]:
    """n req_ids whose registrar is process `registrar`."""
    out, i = [], 0
    while len(out) < n:
        rid = f"r{i}_local_part_0"
        if zlib.crc32(rid.encode()) % processes == registrar:
            out.append(rid)
        i += 1
    return out


@pytest.mark.parametrize("registrar", [0, 1, 2])
def test_ranks_registering_anywhere_reach_the_process_serving_the_part(registrar):
    async def run():
        procs, links = _processes(3)
        (rid,) = _req_ids(1, registrar, 3)
        procs[1].register(rid, 2, "127.0.0.1:5001")  # one rank before the part arrives, at process 1
        await asyncio.sleep(0)
        waiting = asyncio.ensure_future(procs[2].urls(rid, asyncio.get_running_loop().time() + 5))  # served by 2
        await asyncio.sleep(0.05)
        assert not waiting.done()
        procs[0].register(rid, 2, "127.0.0.1:5002")  # the other after it, at process 0
        urls, whole = await waiting
        assert whole and sorted(urls) == ["127.0.0.1:5001", "127.0.0.1:5002"]
        await asyncio.sleep(0.01)
        assert rid not in procs[registrar]._held  # done: forgotten by its registrar
        return sum(link.sent for link in links)

    assert asyncio.run(run()) > 0  # (they did travel between the processes)


def test_a_part_whose_ranks_do_not_all_register_gets_those_that_did_at_its_deadline():
    async def run():
        procs, _ = _processes(2)
        procs[0].register("p_local_part_0", 3, "127.0.0.1:1")
        procs[1].register("p_local_part_0", 3, "127.0.0.1:1")  # (the same rank twice counts once)
        procs[1].register("p_local_part_0", 3, "127.0.0.1:2")
        return await procs[0].urls("p_local_part_0", asyncio.get_running_loop().time() + 0.2)

    urls, whole = asyncio.run(run())
    assert not whole and sorted(urls) == ["127.0.0.1:1", "127.0.0.1:2"]


def test_one_process_needs_no_link_and_unclaimed_registrations_expire(monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(rendezvous.time, "monotonic", lambda: clock[0])

    async def run():
        alone = Registrations(None, keep_s=10)
        alone.register("a_local_part_0", 1, "127.0.0.1:9")
        urls, whole = await alone.urls("a_local_part_0", asyncio.get_running_loop().time() + 1)
        assert whole and urls == ["127.0.0.1:9"]
        alone.register("never_local_part_0", 1, "127.0.0.1:9")  # its part went to another encoder
        assert "never_local_part_0" in alone._held
        clock[0] += 11
        alone.register("b_local_part_0", 1, "127.0.0.1:9")
        assert "never_local_part_0" not in alone._held and "b_local_part_0" in alone._held

    asyncio.run(run())
