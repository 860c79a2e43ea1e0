"""The ledger actor: grants and releases through ActorLedgerClient, a wait given up leaves the line at once and
keeps its place, restarts empty after a kill (the restart bound holds through the actor), calls to a dead ledger fail
instead of hanging, a ledger found again takes the finder's token TTL, and deleting its app's stack ends it."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Iterator

import pytest

from routers.capacity_ledger import UnknownReplicas
from routers.capacity_queue import CapacityQueue
from routers.core import CapacityToken, ReplicaView, RouteRequest

pytestmark = pytest.mark.integration

CAPACITIES = {"a": 2, "b": 3}
CALL_TIMEOUT_S = 1.0
# A ledger created anew answers once Ray has started a worker for it: over a second on a loaded 2-core machine (a CI
# run timed out at 1 s). A dead ledger's name answers with an error, or not at all: both are tried again.
NEW_LEDGER_CALL_TIMEOUT_S = 10.0
# A call may take its wait plus the call timeout, plus scheduling slack on a loaded CI machine.
SLACK_S = 1.0


@pytest.fixture
def ledger_name(ray_cluster: None) -> Iterator[str]:
    """A fresh ledger actor's name; the actor is killed for good afterwards."""
    import ray

    from routers.ledger_actor import get_or_create_ledger

    name = f"test-ledger-{uuid.uuid4().hex[:8]}"
    handle = get_or_create_ledger(name, token_ttl_s=600.0)
    snapshot_of(handle)  # started: the first call to a new actor waits for its worker process
    yield name
    ray.kill(handle, no_restart=True)


def handle_of(name: str):
    from routers.ledger_actor import get_or_create_ledger

    return get_or_create_ledger(name)


def snapshot_of(handle) -> dict:
    import ray

    return ray.get(handle.snapshot.remote(), timeout=60)


async def fill(client, replica_ids: list[str]) -> list[CapacityToken]:
    tokens = []
    while (token := await client.acquire(replica_ids, f"req-{len(tokens)}", 0.0)) is not None:
        tokens.append(token)
    return tokens


async def bounded(call: Awaitable, limit_s: float) -> object:
    """The call's result or exception; it must end within `limit_s` (a call timeout is a fault)."""
    task = asyncio.ensure_future(call)
    done, _ = await asyncio.wait([task], timeout=limit_s)
    if not done:
        task.cancel()
        raise AssertionError(f"the call hung past {limit_s}s")
    return task.exception() or task.result()


def test_actor_grants_waits_and_releases(ledger_name: str) -> None:
    from routers.ledger_actor import ActorLedgerClient

    async def run() -> str:
        client = ActorLedgerClient(handle_of(ledger_name), call_timeout_s=CALL_TIMEOUT_S)
        with pytest.raises(UnknownReplicas):
            await client.acquire(list(CAPACITIES), "before-set", 0.0)
        await client.set_replicas(CAPACITIES)
        tokens = await fill(client, list(CAPACITIES))
        assert sorted(t.replica_id for t in tokens) == ["a", "a", "b", "b", "b"]
        waiting = asyncio.create_task(client.acquire(list(CAPACITIES), "waiter", 5.0))
        await asyncio.sleep(0.2)
        assert not waiting.done()
        assert await client.release(tokens[0].token_id) is True
        assert await client.release(tokens[0].token_id) is False
        granted = await asyncio.wait_for(waiting, 2.0)
        assert granted.replica_id == tokens[0].replica_id
        policy = CapacityQueue(client, max_wait_s=5.0, seed=0)
        views = [ReplicaView(replica_id=r, capacity=c) for r, c in CAPACITIES.items()]
        assert await client.release(granted.token_id) is True
        decision = await policy.decide(views, RouteRequest(request_id="via-policy"))
        assert (decision.reason, decision.token.replica_id) == ("acquired", tokens[0].replica_id)
        assert await policy.release(decision.token) is True
        return tokens[0].replica_id

    freed = asyncio.run(run())
    # Another router of the deployment finds the same ledger by name.
    snapshot = snapshot_of(handle_of(ledger_name))
    assert snapshot["double_releases"] == 1
    assert {r: s["in_flight"] for r, s in snapshot["replicas"].items()} == {
        r: c - (r == freed) for r, c in CAPACITIES.items()
    }


async def waiting_becomes(client, count: int, limit_s: float) -> None:
    """Returns once the ledger has `count` waiters; fails past `limit_s`."""
    deadline = time.monotonic() + limit_s
    while (await client.snapshot())["waiting"] != count:
        assert time.monotonic() < deadline, f"the ledger's waiters never became {count} within {limit_s}s"
        await asyncio.sleep(0.02)


def test_a_wait_given_up_leaves_the_line_at_once_and_its_next_ask_keeps_its_place(ledger_name: str) -> None:
    """A caller that stops waiting (the route agent at HAProxy's deadline) takes its wait out of the ledger at once
    rather than after its slice; the same request asking again (HAProxy's HTTP route call) is served before one that
    queued after its first ask (review #8 across the agent's hand-over)."""
    from routers.ledger_actor import ActorLedgerClient

    async def run() -> None:
        client = ActorLedgerClient(handle_of(ledger_name), call_timeout_s=CALL_TIMEOUT_S)
        await client.set_replicas({"a": 1})
        held = await client.acquire(["a"], "holder", 0.0)
        first_ask = asyncio.create_task(client.acquire(["a"], "first", 30.0))
        await waiting_becomes(client, 1, SLACK_S)
        first_ask.cancel()
        await waiting_becomes(client, 0, SLACK_S)
        later = asyncio.create_task(client.acquire(["a"], "later", 30.0))
        await waiting_becomes(client, 1, SLACK_S)
        asked_again = asyncio.create_task(client.acquire(["a"], "first", 30.0))
        await waiting_becomes(client, 2, SLACK_S)
        assert await client.release(held.token_id) is True
        token = await bounded(asked_again, SLACK_S)
        assert isinstance(token, CapacityToken) and not later.done()
        assert await client.release(token.token_id) is True
        assert isinstance(await bounded(later, SLACK_S), CapacityToken)

    asyncio.run(run())
    snapshot = snapshot_of(handle_of(ledger_name))
    assert (snapshot["granted"], snapshot["released"], snapshot["outstanding"]) == (3, 2, 1)


def test_killed_actor_restarts_empty_and_calls_to_it_do_not_hang(ledger_name: str) -> None:
    import ray

    from routers.ledger_actor import ActorLedgerClient

    handle = handle_of(ledger_name)
    client = ActorLedgerClient(handle, call_timeout_s=CALL_TIMEOUT_S)

    async def before_kill() -> tuple[list[CapacityToken], asyncio.Task]:
        await client.set_replicas(CAPACITIES)
        old = await fill(client, list(CAPACITIES))
        waiting = asyncio.create_task(client.acquire(list(CAPACITIES), "waiter", 5.0))
        await asyncio.sleep(0.2)
        return old, waiting

    async def run() -> int:
        old, waiting = await before_kill()
        ray.kill(handle, no_restart=False)
        # The waiting call was in flight when the ledger died: it fails, it does not hang.
        outcome = await bounded(waiting, 5.0 + CALL_TIMEOUT_S + SLACK_S)
        assert isinstance(outcome, Exception)
        # Calls while the ledger is down or restarting are faults (or already see the new, empty
        # ledger); none hangs past its wait plus the call timeout.
        deadline = time.monotonic() + 60.0
        while True:
            outcome = await bounded(client.acquire(list(CAPACITIES), "probe", 0.0), CALL_TIMEOUT_S + SLACK_S)
            assert isinstance(outcome, Exception), f"a restarted ledger knows no replica, got {outcome!r}"
            if isinstance(outcome, UnknownReplicas):
                break
            assert time.monotonic() < deadline, "the ledger did not come back"
            await asyncio.sleep(0.2)
        # Restarted empty: after the replica set is pushed again, each replica takes `capacity`
        # new tokens on top of the `capacity` old requests: at most 2 x capacity admitted.
        await client.set_replicas(CAPACITIES)
        new = await fill(client, list(CAPACITIES))
        for replica_id, capacity in CAPACITIES.items():
            old_here = sum(t.replica_id == replica_id for t in old)
            new_here = sum(t.replica_id == replica_id for t in new)
            assert old_here == new_here == capacity
        for token in old:
            assert await client.release(token.token_id) is False
        return len(old)

    old_count = asyncio.run(run())
    snapshot = snapshot_of(handle)
    assert snapshot["unknown_releases"] == old_count
    assert snapshot["granted"] == sum(CAPACITIES.values())
    assert {r: s["in_flight"] for r, s in snapshot["replicas"].items()} == CAPACITIES


def test_policy_does_not_hang_while_the_ledger_restarts(ledger_name: str) -> None:
    import ray

    from routers.ledger_actor import ActorLedgerClient

    handle = handle_of(ledger_name)

    async def run() -> None:
        policy = CapacityQueue(ActorLedgerClient(handle, call_timeout_s=CALL_TIMEOUT_S), seed=0)
        views = [ReplicaView(replica_id=r, capacity=c) for r, c in CAPACITIES.items()]
        assert (await policy.decide(views, RouteRequest(request_id="up"))).reason == "acquired"
        ray.kill(handle, no_restart=False)
        # Three faults at most (each bounded by the call timeout) and 75 ms of backoff, then fallback.
        outcome = await bounded(policy.decide(views, RouteRequest(request_id="down")), 3 * (CALL_TIMEOUT_S + 1))
        assert not isinstance(outcome, Exception), outcome
        assert outcome.reason in {"acquired", "ledger_fault_fallback"}
        assert (outcome.token is None) == (outcome.reason == "ledger_fault_fallback")

    asyncio.run(run())


def test_a_replica_releases_to_the_ledger_created_anew_after_its_ledger_was_killed_for_good(ledger_name: str) -> None:
    """A ledger killed with no restart is created anew under its name by the next router; a replica that had looked
    up the dead one must give the new one's tokens back to it (or every token waits for the reaper)."""
    import ray

    from routers.ledger_actor import ActorLedgerClient
    from services.replica.middleware.capacity_release import NamedLedgerClient

    replica_side = NamedLedgerClient(ledger_name)

    async def grant(handle) -> str:
        client = ActorLedgerClient(handle, call_timeout_s=NEW_LEDGER_CALL_TIMEOUT_S)
        await client.set_replicas(CAPACITIES)
        return (await client.acquire(["a"], str(uuid.uuid4()), 0.0)).token_id

    first = handle_of(ledger_name)
    assert asyncio.run(replica_side.release(asyncio.run(grant(first))))
    ray.kill(first, no_restart=True)
    # The name is free once the control store saw the death: until then get_if_exists returns the dead actor.
    deadline = time.monotonic() + 30
    while True:
        renewed = handle_of(ledger_name)
        try:
            token = asyncio.run(grant(renewed))
            break
        except (ray.exceptions.RayActorError, TimeoutError):
            assert time.monotonic() < deadline, "no new ledger under the name"
            time.sleep(0.2)
    try:
        assert asyncio.run(replica_side.release(token)) is True
        assert snapshot_of(renewed)["released"] == 1
    finally:
        ray.kill(renewed, no_restart=True)


def test_a_router_finds_the_ledger_created_anew_after_its_ledger_was_killed_for_good(ray_cluster: None) -> None:
    """A router's policy holds the ledger's handle: once that ledger is dead for good it falls back (bounded) until
    the name holds a new ledger, then takes its tokens from that one again, never for good from a dead one."""
    import ray

    from routers.ledger_actor import actor_ledger_client, ledger_actor_name

    app = f"test-app-{uuid.uuid4().hex[:8]}"
    name = ledger_actor_name(app, "router")
    policy = CapacityQueue(actor_ledger_client(app, "router", token_ttl_s=600.0), max_wait_s=1.0, seed=0)
    views = [ReplicaView(replica_id=r, capacity=c) for r, c in CAPACITIES.items()]

    async def run() -> list[str]:
        first = policy.ledger.handle
        assert (await policy.decide(views, RouteRequest(request_id="before"))).reason == "acquired"
        ray.kill(first, no_restart=True)
        reasons = []
        deadline = time.monotonic() + 30
        while not reasons or reasons[-1] != "acquired":
            assert time.monotonic() < deadline, f"no token from a new ledger: {reasons[-3:]}"
            decision = await bounded(policy.decide(views, RouteRequest(request_id=f"after-{len(reasons)}")), 10.0)
            reasons.append(decision.reason)
            await asyncio.sleep(0.1)
        assert policy.ledger.handle is not first
        return reasons

    try:
        reasons = asyncio.run(run())
        assert set(reasons[:-1]) <= {"ledger_fault_fallback"}
        assert snapshot_of(handle_of(name))["granted"] == 1
    finally:
        ray.kill(handle_of(name), no_restart=True)


def test_a_ledger_found_again_takes_the_new_ttl_and_ending_its_app_ends_it(ray_cluster: None) -> None:
    import ray

    from base.waiting import wait_until
    from routers.ledger_actor import LEDGER_NAMESPACE, end_ledgers, get_or_create_ledger, ledger_actor_name

    app = f"ledger-app-{uuid.uuid4().hex[:8]}"
    name = ledger_actor_name(app, "LLMReplica")
    assert snapshot_of(get_or_create_ledger(name, token_ttl_s=600.0))["token_ttl_s"] == 600.0
    # A redeploy's router with another TTL finds the ledger that outlived the last one (the setting is a call of its
    # own: applied by the time a later call runs, in any order with the finder's first calls).
    found = get_or_create_ledger(name, token_ttl_s=30.0)
    wait_until(10, lambda: snapshot_of(found)["token_ttl_s"] == 30.0, "the ledger to take the new TTL", poll_s=0.1)
    assert end_ledgers([f"other-{app}", app]) == [name]

    def gone() -> bool:
        try:
            ray.get_actor(name, namespace=LEDGER_NAMESPACE)
        except ValueError:
            return True
        return False

    wait_until(30, gone, "the ended ledger's name to be free", poll_s=0.2)
