"""RoundRobin: a cursor over the sorted replica ids; the default policy of an app with no policy set.

Each decision takes the id under the cursor as primary and the next `DEFAULT_NUM_FALLBACK_REPLICAS` in cyclic order
as fallbacks; O(1) per decision, a sort only when the replica set changes. Ignores load and sessions by design.
Semantics, reasons and rationale: routers/README.md#round_robin.
"""

from __future__ import annotations

from collections.abc import Sequence

from base.contracts import TABLE_ROTATION
from routers.core import DEFAULT_NUM_FALLBACK_REPLICAS, ReplicaView, RouteRequest, RoutingPolicy
from routers.entry import PolicyContext, PolicyEntry, PolicySettings

NAME = "round_robin"


class RoundRobinSettings(PolicySettings):
    pass


class RoundRobin(RoutingPolicy):
    name = NAME

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


def _build(settings: RoundRobinSettings, context: PolicyContext) -> RoundRobin:
    return RoundRobin()


def _table(settings: RoundRobinSettings) -> tuple[str, int]:
    return TABLE_ROTATION, DEFAULT_NUM_FALLBACK_REPLICAS


ENTRY = PolicyEntry(NAME, RoundRobinSettings, _build, table=_table)
