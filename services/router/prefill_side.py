"""The prefill side of a prefill/decode router: which prefill replica a request's prompt is computed on.

The decode replica's own policy ranks the decode replicas; `PrefillChooser` runs the prefill side's policy (never
one with capacity tokens or KV events: `PolicyEntry.prefill_side`) over the prefill app's replicas and names the
chosen one with the URL its app is served at, which the decode replica calls (services/replica/middleware). With no
prefill replica, a model that allows it prefills on the decode replica (`required: false`); otherwise the route call
is refused with `no_prefill_replica`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pydantic import BaseModel

from base.contracts import REASON_NO_PREFILL_REPLICA
from routers.core import NoReplicaAvailable, ReplicaView, RouteRequest, RoutingPolicy


class PrefillPick(BaseModel):
    """The prefill replica of a request, and the URL its app is served at (its port and the app's route prefix)."""

    replica_id: str
    url: str


class PrefillChooser:
    """The prefill side of a prefill/decode router: its own policy over the prefill app's replicas."""

    def __init__(
        self,
        policy: RoutingPolicy,
        replicas: Callable[[], Sequence[ReplicaView]],
        route_prefix: str,
        required: bool = True,
    ) -> None:
        self.policy = policy
        self._replicas = replicas
        self._route_prefix = route_prefix
        self._required = required

    def choose(self, request: RouteRequest) -> PrefillPick | None:
        """The prefill replica, or None when there is none and the decode side may prefill locally."""
        try:
            view = self.policy.rank(self._replicas(), request)[0][0]
        except NoReplicaAvailable:
            if not self._required:
                return None
            raise NoReplicaAvailable(REASON_NO_PREFILL_REPLICA) from None
        return PrefillPick(replica_id=view.replica_id, url=view.endpoint + self._route_prefix)
