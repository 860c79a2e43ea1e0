"""Ray Serve `RequestRouter` adapters: DeploymentHandle calls routed with sluice's policies.

One generic adapter (`SluiceRequestRouter`) turns Serve's replicas into `ReplicaView`s and asks the policy; each
registered policy gets a subclass named `<Policy>RequestRouter`, made on first use, which Serve imports by its path
(`PolicyEntry.adapter`). Name one in a deployment with `request_router_config(policy, **kwargs)`. How the session
is found: routers/README.md#serve-adapters.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar

from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import PendingRequest, ReplicaID, ReplicaResult, RequestRouter, RunningReplica

from base.contracts import SESSION_HEADER_DEFAULT
from routers.background import run_in_background
from routers.capacity_ledger import DEFAULT_TOKEN_TTL_S
from routers.core import NoReplicaAvailable, ReplicaView, RouteRequest
from routers.entry import PolicyContext, adapter_class_name
from routers.held_tokens import HeldTokens
from routers.registry import build_policy, policy_entry, policy_names, validate_settings

# `sluice_router_events_total{event=...}`: a completion for a request this router had already counted out.
REPEATED_COMPLETION_EVENT = "repeated_completion"


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
    """The adapter of every policy; a subclass per policy names it (`adapter_class`)."""

    policy_name: ClassVar[str]

    def initialize_state(self, **kwargs: Any) -> None:
        # A policy with a ledger uses the actor of this deployment (`ledger_actor_name(app, deployment)`).
        context = PolicyContext(app=self._deployment_id.app_name, deployment=self._deployment_id.name)
        self.policy = build_policy(self.policy_name, kwargs, context)
        self._tokens = HeldTokens(float(kwargs.get("token_ttl_s", DEFAULT_TOKEN_TTL_S)))
        self._releases: set[asyncio.Task] = set()

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        views = [
            ReplicaView(replica_id=replica_id, capacity=replica.max_ongoing_requests)
            for replica_id, replica in by_id.items()
        ]
        request = route_request_from(pending_request)
        # Serve asks again for the same request when every ranked replica rejected it, the token's one included.
        stale = self._tokens.take(request.request_id)
        if stale is not None:
            await self.policy.reject(stale)
        try:
            decision = await self.policy.decide(views, request)
        except NoReplicaAvailable:
            return []
        if decision.token is not None:
            self._tokens.hold(request.request_id, decision.token)
        return [[by_id[view.replica_id] for view in tier] for tier in decision.ranking]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult) -> None:
        # `on_routed` reads only the request id: no need to parse the session again.
        request = RouteRequest(request_id=pending_request.metadata.internal_request_id)
        self.policy.on_routed(request, replica_id.unique_id)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        # Ray fires this twice for a `dispatch` left un-awaited when its `choose_replica` context exits: the second
        # finds the request already counted out and its token gone, and only shows in the events.
        if not self.policy.on_completed(internal_request_id, replica_id.unique_id):
            self.policy.counts.event(REPEATED_COMPLETION_EVENT)
        token = self._tokens.take(internal_request_id)
        if token is not None:
            run_in_background(self._releases, self.policy.release(token))


_MADE: dict[str, type[SluiceRequestRouter]] = {}


def adapter_class(policy: str) -> type[SluiceRequestRouter]:
    """The policy's adapter class, made once; this module's attribute of its name (Serve imports it by path)."""
    entry = policy_entry(policy)
    adapter = _MADE.get(entry.name)
    if adapter is None:
        name = adapter_class_name(entry.name)
        namespace = {"policy_name": entry.name, "__module__": __name__, "__qualname__": name}
        adapter = _MADE[entry.name] = type(name, (SluiceRequestRouter,), namespace)
    return adapter


def __getattr__(name: str) -> type[SluiceRequestRouter]:
    """`routers.serve_adapters.<Policy>RequestRouter` of any registered policy (how Serve finds an adapter)."""
    for policy in policy_names():
        if adapter_class_name(policy) == name:
            return adapter_class(policy)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class _Adapters(Mapping[str, type[SluiceRequestRouter]]):
    """Policy name -> its adapter class, for every registered policy."""

    def __getitem__(self, policy: str) -> type[SluiceRequestRouter]:
        if policy not in policy_names():
            raise KeyError(policy)
        return adapter_class(policy)

    def __iter__(self) -> Iterator[str]:
        return iter(policy_names())

    def __len__(self) -> int:
        return len(policy_names())


ADAPTERS: Mapping[str, type[SluiceRequestRouter]] = _Adapters()


def request_router_config(policy: str, **kwargs: Any) -> RequestRouterConfig:
    """The `RequestRouterConfig` naming a sluice policy; raises `PolicyConfigError` on bad kwargs."""
    validate_settings(policy, kwargs)
    return RequestRouterConfig(request_router_class=adapter_class(policy), request_router_kwargs=kwargs)
