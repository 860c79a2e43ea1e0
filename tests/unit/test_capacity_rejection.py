"""THE REJECTION RULE: a replica that refused a request gets no new token until it reports room (one of its tokens
is released) or the hold passes; the refused request's token is given back once."""

from __future__ import annotations

import asyncio

from routers.capacity_ledger import CapacityLedger
from routers.capacity_queue import CapacityQueue, LocalLedgerClient
from routers.core import ReplicaView, RouteRequest

BOTH = ("a", "b")


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _grants(ledger: CapacityLedger, candidates: tuple[str, ...], n: int) -> list[str | None]:
    async def run() -> list[str | None]:
        tokens = [await ledger.acquire(candidates, f"r{i}") for i in range(n)]
        return [token.replica_id if token else None for token in tokens]

    return asyncio.run(run())


def test_after_a_rejection_the_ledger_hands_that_replica_no_token_until_the_hold_passes() -> None:
    clock = Clock()
    ledger = CapacityLedger(clock=clock, seed=0, reject_hold_s=5.0)
    ledger.set_replicas({"a": 4, "b": 4})
    refused = asyncio.run(ledger.acquire(("a",), "refused"))
    assert ledger.reject(refused.token_id)
    assert ledger.in_flight("a") == 0 and ledger.snapshot()["held_full"] == ["a"]
    # a has 4 free slots by count, yet every grant goes to b, and none to a alone.
    assert _grants(ledger, BOTH, 5) == ["b"] * 4 + [None]
    assert _grants(ledger, ("a",), 1) == [None]
    clock.now = 5.0
    assert _grants(ledger, BOTH, 1) == ["a"]
    # The refused token was given back once: a second word about it is a counted no-op.
    assert not ledger.reject(refused.token_id) and not ledger.release(refused.token_id)
    snapshot = ledger.snapshot()
    assert snapshot["rejected"] == 1 and snapshot["double_releases"] == 2 and snapshot["held_full"] == []


def test_a_release_on_the_held_replica_reports_room_and_ends_the_hold_at_once() -> None:
    clock = Clock()
    ledger = CapacityLedger(clock=clock, seed=0, reject_hold_s=60.0)
    ledger.set_replicas({"a": 2, "b": 2})
    running = asyncio.run(ledger.acquire(("a",), "running"))
    refused = asyncio.run(ledger.acquire(("a",), "refused"))
    ledger.reject(refused.token_id)
    assert _grants(ledger, ("a",), 1) == [None]
    assert ledger.release(running.token_id)  # a request ended on a: it has room
    assert _grants(ledger, ("a",), 3) == ["a", "a", None]


def test_a_waiter_for_the_held_replica_is_served_when_the_hold_passes() -> None:
    clock = Clock()
    ledger = CapacityLedger(clock=clock, seed=0, reject_hold_s=1.0)
    ledger.set_replicas({"a": 1})

    async def run() -> str | None:
        refused = await ledger.acquire(("a",), "refused")
        ledger.reject(refused.token_id)
        waiter = asyncio.create_task(ledger.acquire(("a",), "waiting", wait_s=5.0))
        await asyncio.sleep(0.01)
        assert not waiter.done()
        clock.now = 1.0
        ledger.reap()
        token = await waiter
        return token.replica_id if token else None

    assert asyncio.run(run()) == "a"


def test_the_capacity_queue_passes_a_rejection_to_its_ledger() -> None:
    ledger = CapacityLedger(seed=0)
    policy = CapacityQueue(LocalLedgerClient(ledger), seed=0)
    views = [ReplicaView(replica_id=r, capacity=2) for r in BOTH]

    async def run() -> list[str]:
        refused = await policy.decide(views, RouteRequest(request_id="refused"))
        assert refused.token is not None and await policy.reject(refused.token)
        held = refused.token.replica_id
        decisions = [await policy.decide(views, RouteRequest(request_id=f"r{i}")) for i in range(2)]
        assert ledger.snapshot()["held_full"] == [held]
        return [held, *(d.token.replica_id for d in decisions if d.token)]

    held, *granted = asyncio.run(run())
    assert granted and held not in granted
