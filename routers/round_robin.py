"""RoundRobin: the default policy of a direct-streaming app with no policy set.

Algorithm: one cursor over the replica ids in sorted order; each decision takes the id under the
cursor as primary and advances it, so consecutive decisions cycle strictly through the set. The
next `DEFAULT_NUM_FALLBACK_REPLICAS` replicas in cyclic order follow as single-replica fallback tiers.
The sort runs only when the replica set changes (O(N log N)); a decision is O(1) (the views by id come from
`RoutingPolicy`, built once per views snapshot). It ignores load and sessions by design (use PowerOfTwo or
ConsistentHash for those).
`DEFAULT_NUM_FALLBACK_REPLICAS` = 2 (`routers.core`, also ConsistentHash's default): enough to ride
out a rejecting replica without ranking the whole set on every decision.
"""

from __future__ import annotations

from collections.abc import Sequence

from routers.core import DEFAULT_NUM_FALLBACK_REPLICAS, ReplicaView, RouteRequest, RoutingPolicy


class RoundRobin(RoutingPolicy):
    name = "round_robin"

    def __init__(self) -> None:
        super().__init__()
        self._cursor = 0
        self._ordered: list[str] = []

    def on_replicas_changed(self, replica_ids: Sequence[str]) -> None:
        self._ordered = sorted(replica_ids)
        # Keep cycling from the same position; the modulo keeps it in range for the new set.
        self._cursor %= max(len(self._ordered), 1)

    def _rank(self, replicas: list[ReplicaView], request: RouteRequest) -> tuple[list[list[ReplicaView]], str]:
        views = self.views_by_id
        count = len(self._ordered)
        start = self._cursor % count
        self._cursor = start + 1
        picked = (self._ordered[(start + i) % count] for i in range(min(count, 1 + DEFAULT_NUM_FALLBACK_REPLICAS)))
        return [[views[replica_id]] for replica_id in picked], "cycle"
