"""One router, whatever runs it: the policy, the live views of its target replicas, what feeds the policy (the
engines' KV events and load), its HTTP app and its route agent. `service.RouterReplica` runs one over Serve's
endpoint lists; a benchmark runs one over replicas it started itself (`sluice bench policies`), so both route with
the same code.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from fastapi import FastAPI

from base.contracts import INTERNAL_CREDENTIAL_HEADER
from base.tracing import ROUTER_SERVICE, ProcessTracer
from routers.core import Decision, ReplicaView, RouteRequest
from routers.registry import policy_entry
from routers.shadows import SHADOWS_KEY
from services.internal_credential import InternalCredentialMiddleware
from services.router.engine_load_poller import EngineLoadPoller
from services.router.http_app import build_router_app
from services.router.kv_subscriber import KVEventSubscriber
from services.router.live_replicas import LiveReplicas
from services.router.prefill_side import PrefillChooser
from services.router.route_listener import DecisionObserver, RouteListener
from services.router.route_span import RouteSpans
from services.router.settings import RouterSettings, build_policy, build_prefill_policy, build_shadows
from services.serve_internals import REPLICA_LOGGER, ReplicaEndpoint

logger = logging.getLogger(REPLICA_LOGGER)

# Where a target app's (or prefill app's) replica endpoints come from.
EndpointSource = Callable[[], Awaitable[Sequence[ReplicaEndpoint]]]


class RouterRuntime:
    def __init__(
        self,
        settings: RouterSettings,
        replicas: EndpointSource,
        credential: str,
        prefill_replicas: EndpointSource | None = None,
        what: str = "the target replicas' endpoints",
        observe_decision: DecisionObserver | None = None,
    ) -> None:
        """`credential`: the cluster's internal credential, which the app requires and its calls to replicas send;
        `observe_decision`: told each decision's CPU seconds, transport included (the route agent's)."""
        self.settings = settings
        self.policy = build_policy(settings)
        self.shadows = build_shadows(settings)
        self.replicas = LiveReplicas(
            replicas, settings.target_capacity, settings.refresh_interval_s, settings.data_parallel_size, what
        )
        self._prefill_source = prefill_replicas
        self._credential = credential
        self._observe = observe_decision
        self._tasks: list[asyncio.Task] = []
        self.kv_events: KVEventSubscriber | None = None
        self.engine_loads: EngineLoadPoller | None = None
        self.app: FastAPI | None = None
        self.listener: RouteListener | None = None
        self.tracer = ProcessTracer(settings.tracing, ROUTER_SERVICE) if settings.tracing.enabled else None

    async def start(self, host: str) -> int:
        """Start everything once the target replicas are known; returns the route agent's port on `host`."""
        settings, policy = self.settings, self.policy
        await self.replicas.start()
        headers = {INTERNAL_CREDENTIAL_HEADER: self._credential}
        event_target = policy_entry(settings.policy).kv_event_target
        loop = asyncio.get_running_loop()
        target = event_target(policy) if event_target is not None else self.shadows
        if self.shadows is not None and target is not None:
            self.shadows.target = target
        if target is not None:
            self.engine_loads = EngineLoadPoller(
                target.engine_loads, settings.target_route_prefix, settings.data_parallel_size, headers=headers
            )
            self._tasks.append(loop.create_task(self.engine_loads.run(self.replicas.views)))
            self.kv_events = KVEventSubscriber(
                target, settings.target_route_prefix, settings.data_parallel_size, headers=headers
            )
            await self.kv_events.sync(self.replicas.views())
            self._tasks.append(loop.create_task(self._follow_kv_events(self.kv_events)))
        prefill = None
        if settings.prefill is not None:
            side = settings.prefill
            if self._prefill_source is None:
                raise ValueError("a prefill/decode router needs the prefill replicas' source")
            self._prefill_replicas = LiveReplicas(self._prefill_source, side.capacity, settings.refresh_interval_s)
            await self._prefill_replicas.start()
            prefill = PrefillChooser(
                build_prefill_policy(settings, side), self._prefill_replicas.views, side.route_prefix, side.required
            )
        shadows = self.shadows
        refresh = (lambda: shadows.refresh_metrics(settings.target_app)) if shadows is not None else None
        spans = RouteSpans(self.tracer.tracer, settings.target_app, policy.name) if self.tracer is not None else None
        self.app = build_router_app(
            settings, policy, self.replicas.views, prefill, self._after_decision, refresh, spans
        )
        # Route calls, membership and tables come from the frontend's HAProxy and replica; nobody else's count.
        self.app.add_middleware(InternalCredentialMiddleware, credential=self._credential)
        self.listener = RouteListener(
            self.app.state.answer_route, settings.session_header, settings.agent_deadline_s, self._observe
        )
        self.app.state.route_listener_port = await self.listener.start(host)
        return self.app.state.route_listener_port

    def _after_decision(self, views: Sequence[ReplicaView], request: RouteRequest, decision: Decision) -> None:
        """What follows each answered decision, off its path: the policy's deferred work, then the shadows."""
        self.policy.after_decision()
        if self.shadows is not None and decision.primary is not None:
            self.shadows.observe(views, request, decision.primary.replica_id)

    async def _follow_kv_events(self, subscriber: KVEventSubscriber) -> None:
        while True:
            await asyncio.sleep(self.settings.refresh_interval_s)
            try:
                await subscriber.sync(self.replicas.views())
            except Exception:
                logger.exception("following the replicas' KV events failed; trying again")

    def describe(self) -> dict[str, Any]:
        """The policy this router runs, and the policy's own report under its key when its registry entry has one
        (kv_aware: where each replica's scores come from)."""
        prefill = self.settings.prefill
        described: dict[str, Any] = {
            "policy": self.settings.policy,
            "policy_kwargs": self.settings.policy_kwargs,
            "prefill_policy": prefill.policy if prefill is not None else None,
        }
        report = policy_entry(self.settings.policy).report
        if report is not None:
            described[report.key] = report.build(self.policy)
        if self.shadows is not None:
            described[SHADOWS_KEY] = self.shadows.report()
        return described

    async def close(self) -> None:
        if self.listener is not None:
            self.listener.close()
        for task in self._tasks:
            task.cancel()
        self.replicas.stop()
        if self.kv_events is not None:
            await self.kv_events.close()
        if self.engine_loads is not None:
            await self.engine_loads.close()
        self.stop_tracing()

    def stop_tracing(self) -> None:
        """Send the decisions' spans still batched, and stop tracing."""
        if self.tracer is not None:
            self.tracer.shutdown()
            self.tracer = None
