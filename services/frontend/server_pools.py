"""What the syncer keeps per app: its server pools (replicas, routers, legacy ingress replicas, router metrics
targets), their members by id, where their endpoints come from, and what one reconciliation pass changed
(services/frontend/README.md, the syncer).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from base.route_wire import Membership
from infra.haproxy.apps import AppRoute
from infra.haproxy.canary import legacy_backend
from infra.haproxy.config import HAProxySettings, replica_backend, router_backend
from infra.haproxy.servers import (
    agent_server_options,
    legacy_server_options,
    replica_server_options,
    router_server_options,
)
from infra.haproxy.spoe import agent_backend
from infra.observability.targets import router_targets_backend
from services.serve_internals import ReplicaEndpoint

EndpointSource = Callable[[], Awaitable[list[ReplicaEndpoint]]]


@dataclass
class Member:
    endpoint: ReplicaEndpoint
    leaving_since: float | None = None


@dataclass
class SyncReport:
    added: list[str] = field(default_factory=list)  # replica (or router) ids
    moved: list[str] = field(default_factory=list)
    left: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)  # ids that cannot name an HAProxy server
    # Per app (in the settings' order): each routable replica's open requests (its server's current sessions)
    # when the pass read them; its keys are the replica ids published to the app's routers.
    in_flight_by_app: list[dict[str, int]] = field(default_factory=list)

    @property
    def routable(self) -> list[str]:
        """The first app's routable replicas (a single-model frontend's only app)."""
        return list(self.in_flight_by_app[0])

    @property
    def changed(self) -> bool:
        return bool(self.added or self.moved or self.left or self.deleted)


class ServerPool:
    """The servers of one backend, keyed by replica (or router) id, which is also the server's name. `checked`:
    its servers are health-checked (and start DOWN until their checks pass)."""

    def __init__(self, backend: str, options: list[str], checked: bool = True) -> None:
        self.backend = backend
        self.options = options
        self.checked = checked
        self.members: dict[str, Member] = {}

    @property
    def live(self) -> dict[str, ReplicaEndpoint]:
        """Id -> endpoint of every member not leaving (a fresh dict on every read)."""
        return {name: m.endpoint for name, m in self.members.items() if m.leaving_since is None}

    def leaving(self) -> list[str]:
        return [name for name, m in self.members.items() if m.leaving_since is not None]


@dataclass
class AppSources:
    """Where one app's replica and router endpoints come from (e.g. `list_replica_endpoints` of its Serve apps)."""

    replicas: EndpointSource
    routers: EndpointSource
    # The app's legacy ingress replicas (an app without a legacy path has none).
    legacy: EndpointSource | None = None


class AppPools:
    """One app's servers in HAProxy (its replica backend and router pool) and what its routers were last told."""

    def __init__(self, index: int, app: AppRoute, sources: AppSources, settings: HAProxySettings) -> None:
        self.app = app
        self.sources = sources
        self.replicas = ServerPool(replica_backend(index), replica_server_options(settings))
        # The routers at Serve's port (the HTTP route call), and their route agents where they told its port.
        self.routers = ServerPool(router_backend(index), router_server_options(settings))
        self.agents = ServerPool(agent_backend(index), agent_server_options(settings))
        self.legacy = ServerPool(legacy_backend(index), legacy_server_options(settings))
        # The routers' Serve addresses, for the metrics discovery only.
        self.router_targets = ServerPool(router_targets_backend(index), [], checked=False)
        # Router id -> (what was last published to it, when).
        self.published: dict[str, tuple[Membership, float]] = {}

    def pools(
        self, replicas: list[ReplicaEndpoint], routers: list[ReplicaEndpoint], legacy: list[ReplicaEndpoint]
    ) -> list[tuple[ServerPool, list[ReplicaEndpoint]]]:
        """Each of the app's pools with the endpoints it should hold: a router at its Serve address in the router
        pool and the targets, at its agent's port in the agent pool."""
        at_serve_port = [router.model_copy(update={"route_port": None}) for router in routers]
        return [
            (self.replicas, replicas),
            (self.routers, at_serve_port),
            (self.agents, [router for router in routers if router.route_port is not None]),
            (self.legacy, legacy),
            (self.router_targets, at_serve_port),
        ]

    def mirrors(self, pool: ServerPool) -> bool:
        """Whether the pool holds the app's routers again (not reported twice)."""
        return pool is self.agents or pool is self.router_targets

    def published_replicas(self) -> int:
        """How many replicas every live router has last been told about (0 while one has been told nothing)."""
        live = self.routers.live
        if not live or any(name not in self.published for name in live):
            return 0
        return min(len(self.published[name][0].replica_ids) for name in live)


def same_address(a: ReplicaEndpoint, b: ReplicaEndpoint) -> bool:
    return (a.host, a.port, a.route_port) == (b.host, b.port, b.route_port)


def check_port_option(endpoint: ReplicaEndpoint) -> list[str]:
    """A server at a router's route agent is health-checked on Serve's port (where `/-/healthz` is)."""
    return ["port", str(endpoint.port)] if endpoint.route_port is not None else []


# Per app: its replicas, routers and legacy ingress replicas.
Endpoints = list[tuple[list[ReplicaEndpoint], list[ReplicaEndpoint], list[ReplicaEndpoint]]]
