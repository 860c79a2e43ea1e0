"""Thin adapters that let Ray Serve's DeploymentHandle route with sluice's policies.

Each adapter is a public `ray.serve.request_router.RequestRouter` subclass; it overrides only the
public hooks (`initialize_state`, `choose_replicas`, `on_request_routed`,
`on_request_completed`). It turns Serve's replicas into `ReplicaView`s, asks the policy, and maps
the ranking back. Name one in a deployment with `request_router_config(policy, **kwargs)`, which
validates the kwargs before anything is deployed.

The session comes from the handle's `.options(session_id=...)`, else from a `session_id` kwarg,
else from the session header inside a `headers` dict argument (the legacy ingress passes the
client's headers), else the request is unsessioned.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any, ClassVar

from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import PendingRequest, ReplicaID, ReplicaResult, RequestRouter, RunningReplica

from base.contracts import SESSION_HEADER_DEFAULT
from routers.background import run_in_background
from routers.config import CapacityQueueSettings, build_stateless_policy, validate_settings
from routers.core import CapacityToken, NoReplicaAvailable, ReplicaView, RouteRequest, RoutingPolicy


def _session_from(pending: PendingRequest) -> str | None:
    if pending.metadata.session_id:
        return pending.metadata.session_id
    if isinstance(pending.kwargs.get("session_id"), str):
        return pending.kwargs["session_id"]
    for value in [pending.kwargs.get("headers"), *pending.args]:
        if isinstance(value, dict):
            # Header names match case-insensitively; the last match wins, as in a dict of lowercased keys.
            session = next((v for k, v in reversed(value.items()) if str(k).lower() == SESSION_HEADER_DEFAULT), None)
            if isinstance(session, str) and session:
                return session
    return None


def route_request_from(pending: PendingRequest | None) -> RouteRequest:
    if pending is None:
        return RouteRequest(request_id=uuid.uuid4().hex)
    return RouteRequest(
        request_id=pending.metadata.internal_request_id,
        session_id=_session_from(pending),
        model=pending.metadata.multiplexed_model_id or None,
    )


class SluiceRequestRouter(RequestRouter):
    """Common adapter; subclasses only name their policy."""

    policy_name: ClassVar[str]

    def initialize_state(self, **kwargs: Any) -> None:
        self.policy = self._build_policy(kwargs)
        self._tokens: dict[str, CapacityToken] = {}
        self._releases: set[asyncio.Task] = set()

    def _build_policy(self, kwargs: dict[str, Any]) -> RoutingPolicy:
        return build_stateless_policy(self.policy_name, kwargs)

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        views = [
            ReplicaView(replica_id=replica_id, capacity=replica.max_ongoing_requests)
            for replica_id, replica in by_id.items()
        ]
        request = route_request_from(pending_request)
        # Serve asks again for the same request when every ranked replica rejected it.
        stale = self._tokens.pop(request.request_id, None)
        if stale is not None:
            await self.policy.release(stale)
        try:
            decision = await self.policy.decide(views, request)
        except NoReplicaAvailable:
            return []
        if decision.token is not None:
            self._tokens[request.request_id] = decision.token
        return [[by_id[view.replica_id] for view in tier] for tier in decision.ranking]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult) -> None:
        # `on_routed` reads only the request id: no need to parse the session again.
        request = RouteRequest(request_id=pending_request.metadata.internal_request_id)
        self.policy.on_routed(request, replica_id.unique_id)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self.policy.on_completed(internal_request_id, replica_id.unique_id)
        token = self._tokens.pop(internal_request_id, None)
        if token is not None:
            run_in_background(self._releases, self.policy.release(token))


class RoundRobinRequestRouter(SluiceRequestRouter):
    policy_name = "round_robin"


class PowerOfTwoRequestRouter(SluiceRequestRouter):
    policy_name = "power_of_two"


class ConsistentHashRequestRouter(SluiceRequestRouter):
    policy_name = "consistent_hash"


class CapacityQueueRequestRouter(SluiceRequestRouter):
    """Takes a token from the deployment's central ledger actor; releases it when the call ends."""

    policy_name = "capacity_queue"

    def _build_policy(self, kwargs: dict[str, Any]) -> RoutingPolicy:
        # The ledger actor is a process of its own (services/); only this adapter needs it.
        from routers.ledger_actor import capacity_queue_policy

        settings = validate_settings(self.policy_name, kwargs)
        assert isinstance(settings, CapacityQueueSettings)
        return capacity_queue_policy(self._deployment_id.app_name, self._deployment_id.name, settings)


ADAPTERS: dict[str, type[SluiceRequestRouter]] = {
    cls.policy_name: cls
    for cls in (
        RoundRobinRequestRouter,
        PowerOfTwoRequestRouter,
        ConsistentHashRequestRouter,
        CapacityQueueRequestRouter,
    )
}


def request_router_config(policy: str, **kwargs: Any) -> RequestRouterConfig:
    """The `RequestRouterConfig` naming a sluice policy; raises `PolicyConfigError` on bad kwargs."""
    validate_settings(policy, kwargs)
    return RequestRouterConfig(request_router_class=ADAPTERS[policy], request_router_kwargs=kwargs)
