"""A decision's cost does not grow with the replica count: a policy handed the same views tuple again (as the router
service does between refreshes) reads the replica set from what it built for that tuple, and a new tuple or a list
is read afresh, so a change of the set is never missed."""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import pytest

from routers.consistent_hash import ConsistentHash
from routers.core import NoReplicaAvailable, ReplicaView, RouteRequest, RoutingPolicy
from routers.power_of_two import PowerOfTwo
from routers.round_robin import RoundRobin

POLICIES: dict[str, Callable[[], RoutingPolicy]] = {
    "round_robin": RoundRobin,
    "power_of_two": lambda: PowerOfTwo(seed=0),
    "consistent_hash": ConsistentHash,
}
DECISIONS = 3000


def views(n: int) -> tuple[ReplicaView, ...]:
    return tuple(ReplicaView(replica_id=f"replica-{i:05d}", capacity=1_000_000) for i in range(n))


def best_seconds(policy: RoutingPolicy, replicas: tuple[ReplicaView, ...]) -> float:
    """The fastest of three runs of DECISIONS decisions (the least disturbed by whatever else runs)."""
    requests = [RouteRequest(request_id=f"r{i}", session_id=f"s{i}") for i in range(DECISIONS)]
    policy.rank(replicas, RouteRequest(request_id="warm"))
    best = math.inf
    for _ in range(3):
        start = time.perf_counter()
        for request in requests:
            policy.rank(replicas, request)
            policy.on_completed(request.request_id, "")
        best = min(best, time.perf_counter() - start)
    return best


@pytest.mark.parametrize("name", POLICIES)
def test_a_decision_at_1024_replicas_costs_under_3x_one_at_8(name: str) -> None:
    small = best_seconds(POLICIES[name](), views(8))
    large = best_seconds(POLICIES[name](), views(1024))
    assert large < 3 * small, f"{name}: {large / DECISIONS * 1e6:.1f} µs vs {small / DECISIONS * 1e6:.1f} µs"


@pytest.mark.parametrize("name", POLICIES)
def test_a_new_tuple_or_a_changed_list_changes_the_ranked_set(name: str) -> None:
    policy = POLICIES[name]()
    three = views(3)
    ranked = {
        v.replica_id for i in range(30) for tier in policy.rank(three, RouteRequest(f"a{i}", f"s{i}")) for v in tier
    }
    assert ranked == {v.replica_id for v in three}
    two = three[:2]
    ranked = {
        v.replica_id for i in range(30) for tier in policy.rank(two, RouteRequest(f"b{i}", f"s{i}")) for v in tier
    }
    assert ranked == {v.replica_id for v in two}
    mutable = list(three)
    policy.rank(mutable, RouteRequest("c0", "s0"))
    mutable.pop()
    ranked = {
        v.replica_id for i in range(30) for tier in policy.rank(mutable, RouteRequest(f"c{i}", f"s{i}")) for v in tier
    }
    assert ranked == {v.replica_id for v in two}
    with pytest.raises(NoReplicaAvailable):
        policy.rank((), RouteRequest("d0"))
