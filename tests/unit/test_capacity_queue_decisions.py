"""capacity_queue's decisions over a ledger that fails, waits or grants oddly: faults fall back with backoff, a
decision ranks within its own set across the ledger's await, a stray token is given back, and a waiter keeps its
place across wait slices."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from routers.capacity_ledger import CapacityLedger
from routers.capacity_queue import CapacityQueue
from routers.core import CapacityToken
from tests.support.capacity import CAPACITIES, queue, request, views


class FailingLedger:
    """A LedgerClient whose acquire raises `failures` times, then grants on the first replica."""

    def __init__(self, failures: int, release_error: bool = False) -> None:
        self.failures = failures
        self.release_error = release_error
        self.acquires = 0

    async def acquire(self, replica_ids: list[str], request_id: str, wait_s: float) -> CapacityToken | None:
        self.acquires += 1
        if self.acquires <= self.failures:
            raise ConnectionError("ledger unreachable")
        return CapacityToken(token_id="t", replica_id=replica_ids[0])

    async def release(self, token_id: str) -> bool:
        if self.release_error:
            raise TimeoutError
        return True

    async def set_replicas(self, capacities: dict[str, int]) -> None:
        pass


def test_three_ledger_faults_fall_back_to_power_of_two() -> None:
    async def run() -> None:
        sleeps: list[float] = []

        async def sleep(seconds: float) -> None:
            sleeps.append(seconds)

        ledger = FailingLedger(failures=10)
        policy = CapacityQueue(ledger, seed=0, sleep=sleep)
        decision = await policy.decide(views(), request(1))
        assert decision.reason == "ledger_fault_fallback"
        assert decision.token is None
        assert ledger.acquires == 3
        assert policy.counts.events["ledger_fault"] == 3
        assert sleeps == pytest.approx([0.025, 0.05])
        ranked = [r.replica_id for tier in decision.ranking for r in tier]
        assert len(ranked) == len(set(ranked)) == 2 and set(ranked) <= set(CAPACITIES)
        assert [len(tier) for tier in decision.ranking] == [1, 1]
        assert policy.tracker.count(decision.primary.replica_id) == 1

    asyncio.run(run())


def _recording_sleep() -> tuple[list[float], Callable[[float], Awaitable[None]]]:
    """The backoff's sleeps, recorded instead of slept."""
    sleeps: list[float] = []

    async def sleep(seconds: float) -> None:
        sleeps.append(seconds)

    return sleeps, sleep


def test_two_ledger_faults_then_success_does_not_fall_back() -> None:
    async def run() -> None:
        sleeps, sleep = _recording_sleep()
        policy = CapacityQueue(FailingLedger(failures=2), seed=0, sleep=sleep)
        decision = await policy.decide(views(), request(1))
        assert decision.reason == "acquired"
        assert decision.token is not None
        assert policy.counts.events["ledger_fault"] == 2
        assert sleeps == pytest.approx([0.025, 0.05])

    asyncio.run(run())


def test_backoff_doubles_up_to_its_cap() -> None:
    async def run() -> None:
        sleeps, sleep = _recording_sleep()
        policy = CapacityQueue(FailingLedger(failures=10), fault_limit=8, seed=0, sleep=sleep)
        await policy.decide(views(), request(1))
        assert sleeps == pytest.approx([0.025, 0.05, 0.1, 0.2, 0.4, 0.5, 0.5])

    asyncio.run(run())


def test_release_fault_is_counted_and_returns_false() -> None:
    async def run() -> None:
        policy = CapacityQueue(FailingLedger(failures=0, release_error=True), seed=0)
        decision = await policy.decide(views(), request(1))
        assert await policy.release(decision.token) is False
        assert policy.counts.events["release_fault"] == 1

    asyncio.run(run())


class GatedLedger:
    """A LedgerClient that grants on the first candidate; the first acquire waits for `gate`."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.acquires = 0
        self.released: list[str] = []

    async def acquire(self, replica_ids: tuple[str, ...], request_id: str, wait_s: float) -> CapacityToken | None:
        self.acquires += 1
        if self.acquires == 1:
            await self.gate.wait()
        return CapacityToken(token_id=request_id, replica_id=replica_ids[0])

    async def release(self, token_id: str) -> bool:
        self.released.append(token_id)
        return True

    async def set_replicas(self, capacities: dict[str, int]) -> None:
        await asyncio.sleep(0)


def test_a_decision_that_waited_ranks_within_its_own_set_whatever_another_decided_meanwhile() -> None:
    """Review #9: the policy's views were read after the ledger's await, when a concurrent decision with another
    set had replaced them (KeyError: a 500 and a leaked token)."""

    async def run() -> None:
        ledger = GatedLedger()
        policy = CapacityQueue(ledger, seed=0)
        first = asyncio.create_task(policy.decide(tuple(views({"a": 2, "b": 2})), request(1)))
        await asyncio.sleep(0.01)  # the first decision waits in the ledger
        second = await policy.decide(tuple(views({"c": 2})), request(2))
        ledger.gate.set()
        decided = await first
        assert [[v.replica_id for v in tier] for tier in second.ranking] == [["c"]]
        assert decided.token is not None and decided.ranking[0][0].replica_id == "a"
        assert {v.replica_id for tier in decided.ranking for v in tier} <= {"a", "b"}
        assert ledger.released == []

    asyncio.run(run())


def test_a_token_on_a_replica_outside_the_callers_set_is_given_back() -> None:
    class StrayLedger(GatedLedger):
        async def acquire(self, replica_ids: tuple[str, ...], request_id: str, wait_s: float) -> CapacityToken:
            self.acquires += 1
            replica = "gone" if self.acquires == 1 else replica_ids[0]
            return CapacityToken(token_id=f"t{self.acquires}", replica_id=replica)

    ledger = StrayLedger()
    decided = asyncio.run(CapacityQueue(ledger, seed=0).decide(tuple(views({"a": 1})), request(1)))
    assert ledger.released == ["t1"] and decided.token.token_id == "t2" and decided.ranking[0][0].replica_id == "a"


def test_waiters_keep_their_place_across_wait_slices(monkeypatch: pytest.MonkeyPatch) -> None:
    """Review #8: every wait slice re-queued a waiter at the back, so under sustained overload the oldest requests
    timed out first. Slices of 50 ms here; the first waiter has re-asked several times before any slot frees."""
    monkeypatch.setattr("routers.capacity_queue.WAIT_SLICE_S", 0.05)

    async def run() -> None:
        ledger = CapacityLedger()
        ledger.set_replicas({"a": 1})
        held = await ledger.acquire(["a"], "held")
        policy = queue(ledger, max_wait_s=10)
        order: list[str] = []

        async def wait(n: int) -> None:
            decision = await policy.decide(tuple(views({"a": 1})), request(n))
            order.append(f"req-{n}")
            await asyncio.sleep(0.01)
            ledger.release(decision.token.token_id)

        tasks = []
        for n in range(4):
            tasks.append(asyncio.create_task(wait(n)))
            await asyncio.sleep(0.12)  # each arrives after the earlier ones re-asked at least twice
        ledger.release(held.token_id)
        await asyncio.gather(*tasks)
        assert order == [f"req-{n}" for n in range(4)]

    asyncio.run(run())
