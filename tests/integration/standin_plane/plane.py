"""The stand-in data plane: one HAProxy with its syncer over static, mutable endpoint sources, and the shared
environment of stand-in replicas and routers the data-plane tests run against (see standins.py)."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from base.contracts import STAGING_SERVER_TIMEOUT_S
from base.waiting import wait_until
from infra.haproxy.apps import AppRoute
from infra.haproxy.config import HAProxySettings
from infra.haproxy.process import HAProxyProcess, pid_alive
from infra.haproxy.protection import FrontendProtection
from infra.haproxy.runtime_api import RuntimeAPI
from infra.haproxy.tls import FrontendTLS
from services.frontend.api_key_watcher import ApiKeyWatcher
from services.frontend.haproxy_syncer import AppSources, HAProxySyncer, ServerPool
from services.frontend.tls_watcher import TLSWatcher
from services.serve_internals import ReplicaEndpoint
from tests.integration.standin_plane.standins import (
    APP,
    BODY_BUFFER_BYTES,
    LOOPBACK,
    PLANE_CREDENTIAL,
    ROUTE_TIMEOUT_S,
    LoopThread,
    ReplicaStandIn,
    RouterBehavior,
    RouterStandIn,
    StandIn,
    rearm_stall,
)
from tests.support.frontend_contract import register_frontend
from tests.support.frontend_metrics import frontend_counts
from tests.support.ports import free_port


@dataclass
class Plane:
    """One HAProxy with its syncer; `replicas`/`routers` are the syncer's (static, mutable) sources."""

    haproxy: HAProxyProcess
    syncer: HAProxySyncer
    sync_future: concurrent.futures.Future[Any] | None = None
    key_watcher: ApiKeyWatcher | None = None
    key_future: concurrent.futures.Future[Any] | None = None
    tls_future: concurrent.futures.Future[Any] | None = None
    replicas: list[ReplicaEndpoint] = field(default_factory=list)
    routers: list[ReplicaEndpoint] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"{'https' if self.haproxy.settings.tls else 'http'}://{LOOPBACK}:{self.haproxy.settings.port}"

    @property
    def runtime(self) -> RuntimeAPI:
        return self.haproxy.runtime

    def status(self, pool: ServerPool, name: str) -> str:
        return self.runtime.show_stat()[(pool.backend, name)].status

    def synced(self) -> bool:
        """HAProxy serves exactly the sources, every server UP, and nothing is left over from earlier members."""
        stats = self.runtime.show_stat()
        for pool, endpoints in (
            (self.syncer.apps[0].replicas, self.replicas),
            (self.syncer.apps[0].routers, self.routers),
        ):
            if set(pool.members) != {e.replica_id for e in endpoints}:
                return False
            if not all((s := stats.get((pool.backend, e.replica_id))) and s.up for e in endpoints):
                return False
        return True

    def published(self, behavior: RouterBehavior) -> list[str] | None:
        """The replica ids this plane's syncer last published to the stand-in routers."""
        frontend = self.haproxy.settings.frontend_id
        return next((m.replica_ids for _, m in reversed(behavior.memberships) if m.frontend == frontend), None)

    def wait_synced(self, timeout_s: float = 5.0) -> None:
        wait_until(timeout_s, self.synced, "HAProxy to match the endpoint sources", poll_s=0.05)


def start_plane(
    loop: LoopThread,
    workdir: Path,
    app: AppRoute,
    replicas: list[ReplicaEndpoint],
    routers: list[ReplicaEndpoint],
    check_inter_s: float = 0.5,
    sync_timeout_s: float = 5.0,
    protection: FrontendProtection | None = None,
    staging_server_timeout_s: float | None = None,
    tls: FrontendTLS | None = None,
    internal_credential: str | None = None,
    tracing: bool = False,
) -> Plane:
    settings = HAProxySettings(
        workdir=workdir,
        internal_credential=internal_credential,
        tracing=tracing,
        apps=[app],
        port=free_port(),
        prometheus_port=free_port(),
        route_timeout_s=ROUTE_TIMEOUT_S,
        check_inter_s=check_inter_s,
        protection=protection or FrontendProtection(),
        staging_server_timeout_s=staging_server_timeout_s,
        tls=tls,
    )
    register_frontend(settings.port)
    haproxy = HAProxyProcess(settings).start()
    plane = Plane(haproxy=haproxy, syncer=None, replicas=list(replicas), routers=list(routers))  # type: ignore[arg-type]

    async def replica_source() -> list[ReplicaEndpoint]:
        return list(plane.replicas)

    async def router_source() -> list[ReplicaEndpoint]:
        return list(plane.routers)

    sources = [AppSources(replicas=replica_source, routers=router_source)]
    plane.syncer = HAProxySyncer(haproxy.runtime, settings, sources, drain_grace_s=10)
    plane.sync_future = loop.submit(plane.syncer.run(interval_s=0.1))
    plane.key_watcher = ApiKeyWatcher.for_settings(haproxy.runtime, settings)
    if plane.key_watcher is not None:
        plane.key_future = loop.submit(plane.key_watcher.run(interval_s=0.2))
    tls_watcher = TLSWatcher.for_settings(haproxy.runtime, settings)
    if tls_watcher is not None:
        plane.tls_future = loop.submit(tls_watcher.run(interval_s=0.2))
    try:
        plane.wait_synced(sync_timeout_s)
    except BaseException:
        stop_plane(plane)
        raise
    return plane


def stop_plane(plane: Plane) -> None:
    for future in (plane.sync_future, plane.key_future, plane.tls_future):
        if future is not None:
            future.cancel()
    worker = plane.haproxy.worker_pid
    master = plane.haproxy.process
    plane.haproxy.stop(grace_s=2)
    assert master is not None and master.poll() is not None, "HAProxy master still running"
    assert worker is None or not pid_alive(worker), "HAProxy worker still running"


@dataclass
class Env:
    loop: LoopThread
    behavior: RouterBehavior
    r1: ReplicaStandIn
    r2: ReplicaStandIn
    router_a: RouterStandIn
    router_b: RouterStandIn
    plane: Plane

    @property
    def replicas(self) -> list[ReplicaStandIn]:
        return [self.r1, self.r2]


@contextmanager
def running_env(workdir: Path) -> Iterator[Env]:
    """Two stand-in replicas and two stand-in routers behind one staging HAProxy + syncer (a body-forwarding app)."""
    loop = LoopThread()
    behavior = RouterBehavior(replica_ids=["r1", "r2"])
    rearm_stall(loop, behavior)
    r1, r2 = ReplicaStandIn("r1"), ReplicaStandIn("r2")
    router_a, router_b = RouterStandIn("router-a", behavior), RouterStandIn("router-b", behavior)
    started: list[StandIn] = []
    plane = None
    try:
        for stand_in in (r1, r2, router_a, router_b):
            loop.run(stand_in.start())
            started.append(stand_in)
        app = AppRoute(name=APP, forward_body=True, body_buffer_bytes=BODY_BUFFER_BYTES)
        replicas, routers = [r1.endpoint, r2.endpoint], [router_a.endpoint, router_b.endpoint]
        plane = start_plane(
            loop,
            workdir,
            app,
            replicas,
            routers,
            staging_server_timeout_s=STAGING_SERVER_TIMEOUT_S,
            internal_credential=PLANE_CREDENTIAL,
        )
        yield Env(loop, behavior, r1, r2, router_a, router_b, plane)
    finally:
        rearm_stall(loop, behavior)
        if plane is not None:
            stop_plane(plane)
        for stand_in in started:
            loop.run(stand_in.stop())
        loop.close()


def fallback_counts(plane: Plane) -> dict[str, int]:
    return frontend_counts(plane.haproxy.settings.prometheus_port, "sluice_frontend_fallbacks_total")
