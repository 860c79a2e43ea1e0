"""CapacityLedger and CapacityQueue in-process: capacity never exceeded, exactly-once release,
reaping, waiting, ledger faults and fallback, and the restart bound."""

from __future__ import annotations

import asyncio
import random

import pytest

from routers.capacity_ledger import MAX_CANDIDATE_SETS, CapacityLedger, UnknownReplicas
from routers.capacity_queue import CapacityQueue, LocalLedgerClient
from routers.core import CapacityToken, NoReplicaAvailable, ReplicaView
from tests.support.capacity import CAPACITIES, queue, request, views


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_concurrent_cycles_never_exceed_capacity_and_release_exactly_once() -> None:
    ledger = CapacityLedger(seed=1)
    policy = queue(ledger)
    rng = random.Random(2)
    released: list[str] = []
    peak = {r: 0 for r in CAPACITIES}

    async def cycle(n: int) -> None:
        decision = await policy.decide(views(), request(n))
        assert decision.token is not None
        assert decision.primary.replica_id == decision.token.replica_id
        for replica_id, capacity in CAPACITIES.items():
            assert ledger.in_flight(replica_id) <= capacity
            peak[replica_id] = max(peak[replica_id], ledger.in_flight(replica_id))
        await asyncio.sleep(rng.uniform(0, 0.002))
        assert await policy.release(decision.token)
        policy.on_completed(f"req-{n}", decision.token.replica_id)
        released.append(decision.token.token_id)

    async def run() -> None:
        await asyncio.gather(*(cycle(n) for n in range(1000)))

    asyncio.run(run())
    assert len(released) == len(set(released)) == 1000
    assert peak == CAPACITIES  # the ledger was saturated, and never past capacity
    snapshot = ledger.snapshot()
    assert snapshot["granted"] == snapshot["released"] == 1000
    assert snapshot["outstanding"] == snapshot["waiting"] == 0
    assert snapshot["double_releases"] == snapshot["unknown_releases"] == snapshot["reaped"] == 0
    assert all(ledger.in_flight(r) == 0 for r in CAPACITIES)
    assert policy.counts.decisions["acquired"] + policy.counts.decisions["waited"] == 1000
    assert policy.counts.decisions["waited"] > 0


def test_least_loaded_replica_with_room_is_granted() -> None:
    async def run() -> None:
        ledger = CapacityLedger(seed=0)
        ledger.set_replicas({"a": 2, "b": 4})
        first = await ledger.acquire(["a", "b"], "r1")
        second = await ledger.acquire(["a", "b"], "r2")
        assert {first.replica_id, second.replica_id} == {"a", "b"}  # 0/2 == 0/4: one each
        third = await ledger.acquire(["a", "b"], "r3")
        assert third.replica_id == "b"  # 1/4 < 1/2
        assert await ledger.acquire(["a"], "r4") is not None
        assert await ledger.acquire(["a"], "r5") is None  # a is full, no wait

    asyncio.run(run())


def test_double_release_is_a_counted_no_op() -> None:
    async def run() -> None:
        ledger = CapacityLedger()
        policy = queue(ledger)
        decision = await policy.decide(views(), request(1))
        other = await policy.decide(views(), request(2))
        assert await policy.release(decision.token) is True
        before = ledger.snapshot()
        assert await policy.release(decision.token) is False
        after = ledger.snapshot()
        assert after["double_releases"] == 1
        assert after["unknown_releases"] == 0
        assert {k: v for k, v in after.items() if k != "double_releases"} == {
            k: v for k, v in before.items() if k != "double_releases"
        }
        assert ledger.in_flight(other.token.replica_id) == 1
        assert ledger.release("never-issued") is False
        assert ledger.snapshot()["unknown_releases"] == 1

    asyncio.run(run())


def test_reaper_reclaims_only_expired_tokens() -> None:
    async def run() -> None:
        clock = Clock()
        ledger = CapacityLedger(token_ttl_s=50.0, clock=clock)
        ledger.set_replicas({"a": 3})
        old = await ledger.acquire(["a"], "old")
        clock.now = 30.0
        young = await ledger.acquire(["a"], "young")
        assert ledger.reap(now=50.0) == 0  # `old` is exactly 50 s old: not older than the TTL
        assert ledger.reap(now=60.0) == 1
        assert ledger.in_flight("a") == 1
        assert ledger.release(old.token_id) is False  # already reaped: a late release
        assert ledger.release(young.token_id) is True
        snapshot = ledger.snapshot()
        assert (snapshot["reaped"], snapshot["late_releases"], snapshot["double_releases"]) == (1, 1, 0)
        assert ledger.in_flight("a") == 0

    asyncio.run(run())


def test_the_tokens_of_a_replica_gone_from_the_set_are_reaped_after_the_grace_and_not_before() -> None:
    """A killed replica's requests never end there: its tokens go once it has been out of the set for
    `gone_after_s`; a replica back within the grace keeps them."""

    async def run() -> None:
        clock = Clock()
        ledger = CapacityLedger(token_ttl_s=600.0, gone_after_s=30.0, clock=clock)
        ledger.set_replicas({"a": 2, "b": 2})
        on_a = [await ledger.acquire(["a"], f"a{i}") for i in range(2)]
        on_b = await ledger.acquire(["b"], "b")
        ledger.set_replicas({"b": 2})  # a killed
        clock.now = 29.0
        assert ledger.reap() == 0 and ledger.snapshot()["outstanding"] == 3
        clock.now = 30.0
        assert ledger.reap() == 2
        assert ledger.in_flight("a") == 0 and ledger.snapshot()["outstanding"] == 1
        assert ledger.release(on_a[0].token_id) is False  # a release after all: late, counted
        # A blip: b leaves and comes back within the grace, its token stays.
        ledger.set_replicas({})
        clock.now = 50.0
        ledger.set_replicas({"b": 2})
        clock.now = 100.0
        assert ledger.reap() == 0 and ledger.release(on_b.token_id) is True

    asyncio.run(run())


def test_reaper_loop_frees_a_slot_for_a_waiter() -> None:
    async def run() -> None:
        clock = Clock()
        ledger = CapacityLedger(token_ttl_s=10.0, clock=clock)
        ledger.set_replicas({"a": 1})
        lost = await ledger.acquire(["a"], "lost")
        waiter = asyncio.create_task(ledger.acquire(["a"], "next", wait_s=5.0))
        reaper = asyncio.create_task(ledger.run_reaper(interval_s=0.01))
        await asyncio.sleep(0.05)
        assert not waiter.done()
        clock.now = 11.0
        token = await asyncio.wait_for(waiter, 1.0)
        reaper.cancel()
        assert token.replica_id == "a" and token.token_id != lost.token_id
        assert ledger.snapshot()["reaped"] == 1

    asyncio.run(run())


def test_waiting_request_proceeds_when_a_slot_frees() -> None:
    async def run() -> None:
        ledger = CapacityLedger()
        policy = queue(ledger)
        one = {"a": 1, "b": 1}
        first = await policy.decide(views(one), request(1))
        second = await policy.decide(views(one), request(2))
        assert (first.reason, second.reason) == ("acquired", "acquired")
        waiting = asyncio.create_task(policy.decide(views(one), request(3)))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        assert await policy.release(second.token)
        decision = await asyncio.wait_for(waiting, 1.0)
        assert decision.reason == "waited"
        assert decision.token.replica_id == second.token.replica_id
        assert [[r.replica_id for r in tier] for tier in decision.ranking] == [
            [second.token.replica_id],
            [first.token.replica_id],
        ]
        assert ledger.in_flight("a") == ledger.in_flight("b") == 1

    asyncio.run(run())


def test_waiters_are_served_first_come_first_served() -> None:
    async def run() -> None:
        ledger = CapacityLedger()
        ledger.set_replicas({"a": 1})
        held = await ledger.acquire(["a"], "held")
        order: list[str] = []

        async def wait(name: str) -> None:
            token = await ledger.acquire(["a"], name, wait_s=5.0)
            order.append(name)
            ledger.release(token.token_id)

        tasks = [asyncio.create_task(wait(f"w{i}")) for i in range(5)]
        await asyncio.sleep(0.01)
        ledger.release(held.token_id)
        await asyncio.gather(*tasks)
        assert order == [f"w{i}" for i in range(5)]

    asyncio.run(run())


def test_cancelled_waiter_leaves_no_token_behind() -> None:
    async def run() -> None:
        ledger = CapacityLedger()
        ledger.set_replicas({"a": 1})
        held = await ledger.acquire(["a"], "held")
        waiter = asyncio.create_task(ledger.acquire(["a"], "gone", wait_s=5.0))
        await asyncio.sleep(0.01)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert ledger.release(held.token_id)
        assert ledger.in_flight("a") == 0
        assert ledger.snapshot()["waiting"] == 0

    asyncio.run(run())


def test_capacity_timeout() -> None:
    async def run() -> None:
        ledger = CapacityLedger()
        policy = queue(ledger, max_wait_s=0.05)
        one = {"a": 1}
        await policy.decide(views(one), request(1))
        with pytest.raises(NoReplicaAvailable) as raised:
            await policy.decide(views(one), request(2))
        assert raised.value.reason == "capacity_timeout"
        assert policy.counts.decisions["capacity_timeout"] == 1
        assert ledger.snapshot()["waiting"] == 0
        assert ledger.in_flight("a") == 1

    asyncio.run(run())


def test_no_routable_replica() -> None:
    policy = queue(CapacityLedger())
    with pytest.raises(NoReplicaAvailable) as raised:
        asyncio.run(policy.decide([ReplicaView(replica_id="a", healthy=False)], request(1)))
    assert raised.value.reason == "no_replica"


def test_removed_replica_gets_no_new_tokens_but_keeps_its_old_ones() -> None:
    async def run() -> None:
        ledger = CapacityLedger()
        ledger.set_replicas({"a": 1, "b": 1})
        on_b = await ledger.acquire(["b"], "r1")
        ledger.set_replicas({"a": 1})
        with pytest.raises(UnknownReplicas):
            await ledger.acquire(["b"], "r2")
        assert (await ledger.acquire(["a", "b"], "r3")).replica_id == "a"
        assert await ledger.acquire(["a", "b"], "r4") is None
        assert ledger.snapshot()["replicas"]["b"] == {"in_flight": 1, "capacity": 0}
        assert ledger.release(on_b.token_id)
        assert "b" not in ledger.snapshot()["replicas"]

    asyncio.run(run())


def test_restart_bound_admits_at_most_twice_capacity() -> None:
    async def run() -> None:
        ledger = CapacityLedger()
        client = LocalLedgerClient(ledger)
        policy = CapacityQueue(client, max_wait_s=0.01, seed=0)

        async def fill(first: int) -> list[CapacityToken]:
            tokens = []
            for n in range(first, first + 2 * sum(CAPACITIES.values())):
                try:
                    tokens.append((await policy.decide(views(), request(n))).token)
                except NoReplicaAvailable as error:
                    assert error.reason == "capacity_timeout"
                    return tokens
            raise AssertionError("the ledger admitted more than its capacity")

        old = await fill(0)
        client.ledger = restarted = CapacityLedger()  # the ledger restarts: empty, knows no replica
        new = await fill(100)
        assert policy.counts.events["ledger_fault"] == 1  # UnknownReplicas once, then the set is pushed again
        for replica_id, capacity in CAPACITIES.items():
            old_here = sum(t.replica_id == replica_id for t in old)
            new_here = sum(t.replica_id == replica_id for t in new)
            assert old_here == new_here == capacity
            assert old_here + new_here <= 2 * capacity
        for token in old:
            assert await policy.release(token) is False
        snapshot = restarted.snapshot()
        assert snapshot["unknown_releases"] == len(old)
        assert snapshot["released"] == snapshot["double_releases"] == 0
        assert {r: s["in_flight"] for r, s in snapshot["replicas"].items()} == CAPACITIES

    asyncio.run(run())


def test_every_caller_gets_the_least_loaded_replica_with_room_in_its_own_set() -> None:
    """Callers narrow the set differently (tuples reused, equal tuples, lists; more sets than the ledger keeps),
    grants and releases interleave and capacities change: each grant is checked against a scan of the caller's set."""
    rng = random.Random(7)
    ids = [f"r{i}" for i in range(6)]
    capacities = {r: rng.randint(1, 3) for r in ids}
    sets = [tuple(rng.sample(ids, rng.randint(1, 6))) for _ in range(MAX_CANDIDATE_SETS + 4)]

    async def run() -> None:
        ledger = CapacityLedger(seed=3)
        ledger.set_replicas(capacities)
        held: list[CapacityToken] = []
        for step in range(3000):
            if step % 500 == 499:
                capacities.update({r: rng.randint(0, 3) for r in rng.sample(ids, 2)})
                ledger.set_replicas(capacities)
            if held and rng.random() < 0.45:
                assert ledger.release(held.pop(rng.randrange(len(held))).token_id)
                continue
            chosen = rng.choice(sets)
            candidates = chosen if rng.random() < 0.8 else rng.choice([tuple(chosen), list(chosen)])
            room = {r: ledger.in_flight(r) / capacities[r] for r in chosen if ledger.in_flight(r) < capacities[r]}
            token = await ledger.acquire(candidates, f"req-{step}")
            if not room:
                assert token is None
                continue
            assert token.replica_id in room and room[token.replica_id] == min(room.values())
            held.append(token)

    asyncio.run(run())


def test_a_waiter_is_served_after_its_candidate_set_was_dropped() -> None:
    async def run() -> None:
        ledger = CapacityLedger()
        ledger.set_replicas({"a": 1, "b": 1})
        held = {t.replica_id: t for t in [await ledger.acquire(("a", "b"), f"r{i}") for i in range(2)]}
        waiter = asyncio.create_task(ledger.acquire(("a", "b"), "w1", wait_s=5.0))
        await asyncio.sleep(0.01)
        for i in range(MAX_CANDIDATE_SETS):  # other callers' sets push the waiter's out of the ledger
            assert await ledger.acquire(("a", f"gone-{i}"), f"other-{i}") is None
        ledger.release(held["b"].token_id)
        assert (await asyncio.wait_for(waiter, 1.0)).replica_id == "b"
        waiter = asyncio.create_task(ledger.acquire(("a", "b"), "w2", wait_s=5.0))
        await asyncio.sleep(0.01)
        ledger.set_replicas({"a": 1, "b": 2})  # new capacity drops every set, and goes to the waiter
        assert (await asyncio.wait_for(waiter, 1.0)).replica_id == "b"
        assert ledger.in_flight("b") == 2

    asyncio.run(run())
