import math
import statistics

import pytest

from routers.core import InFlightTracker, NoReplicaAvailable, ReplicaView, RouteRequest
from routers.power_of_two import PowerOfTwo
from routers.round_robin import RoundRobin


def _views(n: int, **overrides) -> list[ReplicaView]:
    return [ReplicaView(replica_id=f"replica-{i:03d}", **overrides) for i in range(n)]


def test_round_robin_cycles_strictly_over_sorted_ids() -> None:
    policy = RoundRobin()
    views = list(reversed(_views(5)))
    picked = [policy.rank(views, RouteRequest(request_id=str(i)))[0][0].replica_id for i in range(23)]
    ordered = sorted(v.replica_id for v in views)
    assert picked == [ordered[i % 5] for i in range(23)]


def test_round_robin_fallbacks_are_the_next_replicas_in_cycle_order() -> None:
    policy = RoundRobin()
    ranking = policy.rank(_views(4), RouteRequest(request_id="a"))
    assert [t[0].replica_id for t in ranking] == [f"replica-{i:03d}" for i in (0, 1, 2)]
    for request_id in "bc":
        ranking = policy.rank(_views(4), RouteRequest(request_id=request_id))
    assert [t[0].replica_id for t in ranking] == [f"replica-{i:03d}" for i in (2, 3, 0)]
    assert [t[0].replica_id for t in policy.rank(_views(2), RouteRequest(request_id="d"))] == [
        "replica-001",
        "replica-000",
    ]


def test_round_robin_spread_has_low_variation_without_sessions() -> None:
    policy = RoundRobin()
    counts = dict.fromkeys((v.replica_id for v in _views(8)), 0)
    for i in range(10_000):
        counts[policy.rank(_views(8), RouteRequest(request_id=str(i)))[0][0].replica_id] += 1
    assert statistics.pstdev(counts.values()) / statistics.mean(counts.values()) <= 0.1


def test_unroutable_replicas_are_never_chosen_and_none_left_is_an_error() -> None:
    views = _views(3)
    views[1] = ReplicaView(replica_id=views[1].replica_id, draining=True)
    views[2] = ReplicaView(replica_id=views[2].replica_id, healthy=False)
    for policy in (RoundRobin(), PowerOfTwo(seed=1)):
        for i in range(20):
            ranking = policy.rank(views, RouteRequest(request_id=str(i)))
            assert {r.replica_id for tier in ranking for r in tier} == {"replica-000"}
        with pytest.raises(NoReplicaAvailable) as error:
            policy.rank(views[1:], RouteRequest(request_id="x"))
        assert error.value.reason == "no_replica"


@pytest.mark.parametrize("n", [2, 3, 4, 5, 8, 16, 64])
@pytest.mark.parametrize("seed", range(10))
def test_power_of_two_burst_counts_in_flight_at_decision_time(n: int, seed: int) -> None:
    policy = PowerOfTwo(seed=seed)
    views = _views(n)
    placed = dict.fromkeys((v.replica_id for v in views), 0)
    for i in range(200):  # all 200 decided before any completes: a simultaneous burst
        placed[policy.rank(views, RouteRequest(request_id=f"burst-{i}"))[0][0].replica_id] += 1
    assert max(placed.values()) <= math.ceil(200 / n) + 2
    assert all(policy.tracker.count(r) == c for r, c in placed.items())


def test_power_of_two_prefers_the_less_loaded_candidate() -> None:
    policy = PowerOfTwo(seed=3)
    views = [ReplicaView(replica_id="busy", in_flight=9), ReplicaView(replica_id="idle", in_flight=0)]
    for i in range(20):
        ranking = policy.rank(views, RouteRequest(request_id=str(i)))
        assert ranking[0][0].replica_id == "idle"
        policy.on_completed(str(i), "idle")
    assert policy.counts.decisions["fewer_in_flight"] == 20


def test_completion_and_moves_keep_live_counts_right() -> None:
    policy = PowerOfTwo(seed=0)
    views = _views(2)
    ranking = policy.rank(views, RouteRequest(request_id="r1"))
    primary, other = ranking[0][0].replica_id, ranking[1][0].replica_id
    assert policy.tracker.count(primary) == 1
    policy.on_routed(RouteRequest(request_id="r1"), other)  # the primary rejected it
    assert (policy.tracker.count(primary), policy.tracker.count(other)) == (0, 1)
    assert policy.counts.decisions["fallback_1"] == 1
    policy.on_completed("r1", other)
    assert policy.tracker.count(other) == 0


def test_unreported_completions_are_forgotten() -> None:
    now = [0.0]
    policy = PowerOfTwo(seed=0)
    policy.tracker = InFlightTracker(forget_after_s=60, clock=lambda: now[0])
    policy.rank(_views(1), RouteRequest(request_id="lost"))
    assert policy.tracker.count("replica-000") == 1
    now[0] = policy.tracker.forget_after_s + 2
    policy.rank(_views(1), RouteRequest(request_id="next"))
    assert policy.tracker.count("replica-000") == 1


class _CountSeeing(PowerOfTwo):
    """Power of two that records the first replica's in-flight count each ranking saw."""

    def __init__(self) -> None:
        super().__init__(seed=0)
        self.seen: list[int] = []

    def _rank(self, replicas: list[ReplicaView], request: RouteRequest) -> tuple[list[list[ReplicaView]], str]:
        self.seen.append(self.tracker.count(replicas[0].replica_id))
        return super()._rank(replicas, request)


def test_a_ranking_counts_exactly_the_placements_younger_than_forget_after_s() -> None:
    now = [0.0]
    policy = _CountSeeing()
    policy.tracker = InFlightTracker(forget_after_s=2.0, clock=lambda: now[0])
    for at in (0.0, 0.5, 1.5, 2.0, 2.6):
        now[0] = at
        policy.rank(_views(1), RouteRequest(request_id=f"at-{at}"))
    # The placements of the last 2 s, none kept into a later second.
    assert policy.seen == [0, 1, 2, 2, 2]


def test_placements_since_the_last_sample_are_counted_until_they_end_or_a_new_sample_holds_them() -> None:
    now = [0.0]
    tracker = InFlightTracker(forget_after_s=2.0, clock=lambda: now[0])
    tracker.place("before", ("a", "b"))
    tracker.sampled()
    tracker.place("x", ("a", "b"))
    tracker.place("y", ("a", "b"))
    assert (tracker.placed_since_sample("a"), tracker.count("a")) == (2, 3)
    tracker.move("y", "b")  # went to its fallback
    tracker.finish("before")  # placed before the sample: the sample held it, nothing since changes
    assert (tracker.placed_since_sample("a"), tracker.placed_since_sample("b")) == (1, 1)
    now[0] = 2.0
    tracker.expire()  # forgotten after forget_after_s
    assert (tracker.placed_since_sample("a"), tracker.placed_since_sample("b")) == (0, 0)
    tracker.place("z", ("a",))
    tracker.sampled()  # the new sample holds z
    tracker.finish("z")
    assert tracker.placed_since_sample("a") == 0 and tracker.count("a") == 0


def test_a_request_finished_twice_is_counted_out_once() -> None:
    """Ray reports an un-awaited `dispatch` complete twice; the second report must change no count."""
    policy = RoundRobin()
    views = _views(2)
    chosen = policy.rank(views, RouteRequest(request_id="twice"))[0][0].replica_id
    policy.rank(views, RouteRequest(request_id="other"))
    assert policy.tracker.count(chosen) == 1
    assert policy.on_completed("twice", chosen) is True
    assert policy.on_completed("twice", chosen) is False
    assert policy.tracker.count(chosen) == 0 and sum(policy.tracker.count(v.replica_id) for v in views) == 1
