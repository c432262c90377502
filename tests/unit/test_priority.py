"""service/priority.py: the order key and its starvation bound, urgency from a request's fields, the batcher's
Levels, and PriorityGate (the decoders' waiting room) with real asyncio."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import pytest

from service.errors import DeadlineExceeded
from service.priority import Levels, PriorityGate, Urgency, due


def test_due_orders_by_aged_priority_and_bounds_how_late_more_urgent_work_overtakes():
    aging = 2.0
    old_bulk = due(100.0, 3, aging)
    # Priority 1 overtakes priority 3 only if it arrives within (3 - 1) * 2 = 4 s after it.
    assert due(103.9, 1, aging) < old_bulk < due(104.1, 1, aging)
    assert due(100.0, 0, aging) < due(100.5, 0, aging)  # first come, first served within a level
    assert due(10_000.0, 0, 0.0) < due(0.0, 1, 0.0)  # aging 0: strict priority, however long it waited


def test_urgency_counts_its_budget_from_arrival_and_the_default_applies_only_when_none_is_sent():
    assert Urgency.at_arrival(50.0, 2, 250, default_deadline_ms=10_000) == Urgency(2, 50.25)
    assert Urgency.at_arrival(50.0, 0, None, default_deadline_ms=1000) == Urgency(0, 51.0)
    assert Urgency.at_arrival(50.0, 0, None, None) == Urgency(0, None)
    u = Urgency(0, 10.0)
    assert not u.expired(9.99) and u.expired(10.0) and not Urgency().expired()
    with pytest.raises(DeadlineExceeded, match="before its decode started") as e:
        u.check("its decode started", now=11.0)
    assert e.value.status == 504 and e.value.code == "deadline_exceeded"


@dataclass
class _Item:
    key: str
    priority: int
    due: tuple
    tokens: int = 1


def test_levels_merge_their_heads_most_urgent_first_and_shed_the_least_urgent_newest_first():
    q: Levels[_Item] = Levels()
    for i, (key, p) in enumerate([("b1", 5), ("c1", 0), ("b2", 5), ("x", 9), ("c2", 0)]):
        q.add(_Item(key, p, due(float(i), p, 1.0), tokens=i + 1))
    assert [it.key for it in q.ordered()] == ["c1", "c2", "b1", "b2", "x"]
    assert [it.key for it in q.least_urgent(0)] == ["x", "b2", "b1"]
    assert q.tokens == 15 and len(q) == 5
    q.remove(q.get("x"))
    assert set(q.by_level()) == {0, 5} and q.get("x") is None and q.tokens == 11


async def _order_through(gate: PriorityGate, arrivals: list[tuple[str, Urgency]]) -> list[str]:
    order: list[str] = []

    async def one(name: str, u: Urgency):
        async with gate.hold(u):
            order.append(name)
            await asyncio.sleep(0.01)

    tasks = []
    for name, u in arrivals:
        tasks.append(asyncio.create_task(one(name, u)))
        await asyncio.sleep(0.001)  # each arrives in turn
    await asyncio.gather(*tasks, return_exceptions=True)
    return order


def test_the_gate_lets_waiters_in_by_priority_then_arrival():
    async def main():
        gate = PriorityGate(1, aging_s=10.0)
        return await _order_through(gate, [("first", Urgency(5)), ("bulk1", Urgency(5)), ("bulk2", Urgency(5)),
                                           ("chat1", Urgency(0)), ("chat2", Urgency(0))])

    assert asyncio.run(main()) == ["first", "chat1", "chat2", "bulk1", "bulk2"]


def test_a_waiter_whose_deadline_passes_leaves_with_a_504_and_the_permit_goes_on():
    async def main():
        gate = PriorityGate(1, aging_s=0.0)
        await gate.acquire(Urgency())
        late = asyncio.create_task(gate.acquire(Urgency(0, time.monotonic() + 0.05)))
        later = asyncio.create_task(gate.acquire(Urgency(1)))
        gone = asyncio.create_task(gate.acquire(Urgency(0)))
        await asyncio.sleep(0.01)
        gone.cancel()  # a client that left while waiting holds nothing
        with pytest.raises(DeadlineExceeded, match="before its decode started"):
            await late
        assert gate.waiting() == 1 and gate.held == 1
        gate.release()
        await asyncio.wait_for(later, 1)  # the permit went to the one still waiting
        assert gate.held == 1 and gate.waiting() == 0
        gate.release()
        assert gate.held == 0
        with pytest.raises(DeadlineExceeded):  # already past: refused without waiting
            await gate.acquire(Urgency(0, time.monotonic() - 1))

    asyncio.run(main())
