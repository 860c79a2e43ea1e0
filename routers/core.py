"""The routing core shared by every policy: replica views in, ranked candidates out. No Ray import.

A policy ranks the live replicas for one request: `rank()` returns tiers, primary tier first,
then fallbacks; the caller tries tiers in order. `decide()` is the full decision: the ranking plus,
for policies that meter capacity, a token that the caller must release exactly once when the
request ends. Policies are told about every routed and completed request and every change of the
replica set, and count *why* each decision went the way it did (see `routers.metrics`).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from base.contracts import REASON_NO_REPLICA
from routers.metrics import DecisionCounts

# Single-replica fallback tiers after the primary, for the policies that rank beyond two: enough to
# ride out a rejecting replica without ranking the whole set on every decision.
DEFAULT_NUM_FALLBACK_REPLICAS = 2


@dataclass(frozen=True, slots=True)
class ReplicaView:
    """What a policy may know about one replica at decision time."""

    replica_id: str
    endpoint: str = ""
    in_flight: int = 0
    capacity: int = 1
    healthy: bool = True
    draining: bool = False
    # `in_flight` is a sample of the replica's open requests (its frontends' HAProxy counts), taken when this router
    # last called `InFlightTracker.sampled()`, rather than a count the caller keeps.
    in_flight_sampled: bool = False

    @property
    def routable(self) -> bool:
        return self.healthy and not self.draining


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """One request to place. `body_prefix` is at most the forwarding buffer; it may be cut. `model` and
    `user` (OpenAI's end-user id) are read from it when the app forwards bodies, else None. `wait_budget_s`: how long
    the caller still waits for the decision (None: no bound of its own); a policy that waits answers within it."""

    request_id: str
    session_id: str | None = None
    model: str | None = None
    user: str | None = None
    body_prefix: bytes = b""
    body_truncated: bool = False
    wait_budget_s: float | None = None


@dataclass(frozen=True, slots=True)
class CapacityToken:
    token_id: str
    replica_id: str


def _ranked_ids(ranking: list[list[ReplicaView]]) -> tuple[str, ...]:
    return tuple(view.replica_id for tier in ranking for view in tier)


@dataclass(slots=True)
class Decision:
    """A ranking and, for capacity-metered policies, the token held on the primary replica."""

    ranking: list[list[ReplicaView]]
    reason: str
    token: CapacityToken | None = None

    @property
    def primary(self) -> ReplicaView | None:
        return self.ranking[0][0] if self.ranking and self.ranking[0] else None

    @property
    def ranked_ids(self) -> tuple[str, ...]:
        """Every ranked replica id, tier by tier: the primary first, then the fallbacks."""
        return _ranked_ids(self.ranking)


class NoReplicaAvailable(Exception):
    """No replica can take the request; `reason` is the low-cardinality label reported upstream."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(slots=True)
class _Placement:
    replica_id: str
    ranked_ids: tuple[str, ...]
    placed_at: float
    # The sample of open requests current when placed (`InFlightTracker.sampled`).
    sample: int


class InFlightTracker:
    """Requests this policy placed and not yet saw complete, counted per replica.

    A request is counted on its primary *at decision time*, so a burst of simultaneous decisions
    sees each earlier one (scraped counts would lag and herd the burst onto one replica). A request
    whose completion is never reported is forgotten once `forget_after_s` old, exactly: `expire()` before
    each ranking, so two routers that placed the same requests count alike. `on_count_changed`, when set, is
    told (replica id, old count, new count) on every change, so a policy can keep a sum over the counts
    current in O(1) instead of adding them up per decision. `placed_since_sample(replica)` counts the placements
    made since the last `sampled()` (a new sample of the replicas' open requests), which the sample cannot hold yet.
    """

    def __init__(self, forget_after_s: float = 900.0, clock=time.monotonic) -> None:
        self.forget_after_s = forget_after_s
        self._clock = clock
        # In placement order (the clock is monotonic and a placed id is re-inserted), so expiring stops early.
        self._placements: dict[str, _Placement] = {}
        self._counts: dict[str, int] = {}
        self.on_count_changed: Callable[[str, int, int], None] | None = None
        self._sample = 0
        self._since_sample: dict[str, int] = {}

    def count(self, replica_id: str) -> int:
        return self._counts.get(replica_id, 0)

    def sampled(self) -> None:
        """A new sample of the replicas' open requests arrived: the placements before now are in it."""
        self._sample += 1
        self._since_sample.clear()

    def placed_since_sample(self, replica_id: str) -> int:
        return self._since_sample.get(replica_id, 0)

    def place(self, request_id: str, ranked_ids: tuple[str, ...]) -> None:
        self.expire()
        self.finish(request_id)
        self._placements[request_id] = _Placement(ranked_ids[0], ranked_ids, self._clock(), self._sample)
        self._add(ranked_ids[0], 1, since_sample=True)

    def move(self, request_id: str, replica_id: str) -> int | None:
        """Re-count the request on the replica it actually went to; return that replica's rank."""
        placement = self._placements.get(request_id)
        if placement is None or placement.replica_id == replica_id:
            return 0 if placement is not None else None
        since_sample = placement.sample == self._sample
        self._add(placement.replica_id, -1, since_sample)
        self._add(replica_id, 1, since_sample)
        placement.replica_id = replica_id
        ranked = placement.ranked_ids
        return ranked.index(replica_id) if replica_id in ranked else None

    def finish(self, request_id: str) -> bool:
        """Count the request out; False when it was not counted in (already finished, or forgotten)."""
        placement = self._placements.pop(request_id, None)
        if placement is None:
            return False
        self._add(placement.replica_id, -1, placement.sample == self._sample)
        return True

    def _add(self, replica_id: str, delta: int, since_sample: bool) -> None:
        if since_sample:
            self._since_sample[replica_id] = self._since_sample.get(replica_id, 0) + delta
        old = self._counts.get(replica_id, 0)
        self._counts[replica_id] = old + delta
        if self.on_count_changed is not None:
            self.on_count_changed(replica_id, old, old + delta)

    def expire(self) -> None:
        """Forget the placements `forget_after_s` old or older."""
        cutoff = self._clock() - self.forget_after_s
        while self._placements:
            request_id, placement = next(iter(self._placements.items()))
            if placement.placed_at > cutoff:
                return
            self.finish(request_id)


class RoutingPolicy(ABC):
    """Base of every policy. Subclasses implement `_rank`; the rest has safe defaults.

    `live_in_flight(view)` is what load-aware policies compare: the larger of the count the caller
    reported in the view and the requests this policy itself placed there and has not seen end.
    """

    name = "policy"
    # Whether the same session keeps landing on the same replica while the replica set is stable.
    sticky = False

    def __init__(self) -> None:
        self.counts = DecisionCounts(self.name)
        self.tracker = InFlightTracker()
        self._replica_ids: frozenset[str] = frozenset()
        # The last views tuple seen, its routable views and those by id: a caller that passes the same tuple
        # again (a tuple cannot change) pays nothing per decision for the replica set (`_routable`).
        self._seen: tuple[ReplicaView, ...] | None = None
        self._seen_routable: list[ReplicaView] = []
        self.views_by_id: dict[str, ReplicaView] = {}

    def live_in_flight(self, view: ReplicaView) -> int:
        return max(view.in_flight, self.tracker.count(view.replica_id))

    def rank(self, replicas: Sequence[ReplicaView], request: RouteRequest) -> list[list[ReplicaView]]:
        """Ranked tiers over the routable replicas; raises `NoReplicaAvailable` when there are none.

        The primary is counted in flight for this request until `on_completed`."""
        routable = self._routable(replicas)
        if not routable:
            self.counts.record(REASON_NO_REPLICA)
            raise NoReplicaAvailable(REASON_NO_REPLICA)
        self.tracker.expire()
        ranking, reason = self._rank(routable, request)
        self.counts.record(reason)
        self.tracker.place(request.request_id, _ranked_ids(ranking))
        return ranking

    async def decide(self, replicas: Sequence[ReplicaView], request: RouteRequest) -> Decision:
        """The full decision. Capacity-metered policies override this to take a token."""
        ranking = self.rank(replicas, request)
        return Decision(ranking=ranking, reason=self.counts.last_reason)

    async def release(self, token: CapacityToken) -> bool:
        """Give back a capacity token; policies without tokens have nothing to release."""
        return False

    async def reject(self, token: CapacityToken) -> bool:
        """Give back the token of a request its replica refused; a policy that learns nothing from it releases it."""
        return await self.release(token)

    def on_routed(self, request: RouteRequest, replica_id: str) -> None:
        """The request was sent to `replica_id`; count a fallback when it is not the primary."""
        rank = self.tracker.move(request.request_id, replica_id)
        if rank:
            self.counts.record(f"fallback_{rank}")

    def on_completed(self, request_id: str, replica_id: str) -> bool:
        """The request ended (success, error or disconnect); False when it had already ended here: a second
        completion of one request changes no count."""
        return self.tracker.finish(request_id)

    def on_replicas_changed(self, replica_ids: Sequence[str]) -> None:
        """The replica set changed; the default keeps nothing per set."""

    def after_decision(self) -> None:
        """Called once a decision's answer is out: work a policy deferred off the decision's path (none by default)."""

    def _routable(self, replicas: Sequence[ReplicaView]) -> list[ReplicaView]:
        """The routable views (and `views_by_id`, and the replica set synced): O(N) for a new sequence, O(1) for
        the tuple of the last call, so a decision's cost does not grow with the replica count."""
        if replicas is self._seen:
            return self._seen_routable
        routable = [r for r in replicas if r.routable]
        self.views_by_id = {r.replica_id: r for r in routable}
        if routable:
            self._sync_replica_set(routable)
        if isinstance(replicas, tuple):
            self._seen, self._seen_routable = replicas, routable
        else:
            self._seen = None
        return routable

    def _sync_replica_set(self, routable: Sequence[ReplicaView]) -> None:
        ids = frozenset(r.replica_id for r in routable)
        if ids != self._replica_ids:
            self._replica_ids = ids
            self.on_replicas_changed(sorted(ids))

    @abstractmethod
    def _rank(self, replicas: list[ReplicaView], request: RouteRequest) -> tuple[list[list[ReplicaView]], str]:
        """Rank routable replicas (never empty); return the tiers and the reason label."""
