"""Keeps HAProxy's replica and router servers equal to the live endpoint sets, through the runtime API only, and
tells the routers which replicas this frontend can route to.

Each pass adds a server per new replica (DOWN until its checks pass), puts a leaving one in maintenance at once and
deletes it once idle or after the drain grace, then publishes each app's routable replicas (in HAProxy, UP, not
leaving) to that app's routers: one membership truth. How and why: services/frontend/README.md (the syncer).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable

import httpx

from base.contracts import DEFAULT_DRAIN_GRACE_S, MEMBERSHIP_PATH, PUBLISH_HEARTBEAT_S
from base.route_wire import Membership
from infra.haproxy.config import SERVER_NAME_PATTERN, HAProxySettings, is_internal_server
from infra.haproxy.runtime_api import RuntimeAPI, RuntimeAPIError, ServerStat
from services.frontend.server_pools import (
    AppPools,
    AppSources,
    Endpoints,
    Member,
    ServerPool,
    SyncReport,
    check_port_option,
    same_address,
)
from services.serve_internals import ReplicaEndpoint

logger = logging.getLogger(__name__)
# How often HAProxy's servers are compared with the endpoint sources (and memberships published).
SYNC_INTERVAL_S = 0.25

PUBLISH_TIMEOUT_S = 1.0


class HAProxySyncer:
    """Reconciles each app's HAProxy servers with its sources (`sources[i]` for `settings.apps[i]`) and publishes
    each app's routable replicas to that app's routers."""

    def __init__(
        self,
        runtime: RuntimeAPI,
        settings: HAProxySettings,
        sources: list[AppSources],
        drain_grace_s: float = DEFAULT_DRAIN_GRACE_S,
        clock: Callable[[], float] = time.monotonic,
        publish_transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        if len(sources) != len(settings.apps):
            raise ValueError(f"{len(sources)} endpoint sources for {len(settings.apps)} apps")
        self.runtime = runtime
        self.settings = settings
        self.drain_grace_s = drain_grace_s
        self.clock = clock
        self.apps = [
            AppPools(i, app, src, settings) for i, (app, src) in enumerate(zip(settings.apps, sources, strict=True))
        ]
        self._adopted = False
        self._publish_failing: set[str] = set()
        self._refused_logged: set[str] = set()
        # The kept-open publication client while `run` runs; a lone `sync_once` opens one for its pass.
        self._client: httpx.AsyncClient | None = None
        self._publish_transport = publish_transport
        # Set once a pass found every app's live replicas UP in HAProxy (a new HAProxy routes as the old one did).
        self.serving = threading.Event()

    async def sync_once(self) -> SyncReport:
        """One reconciliation pass, then the publication. A source that fails leaves HAProxy as it is and its
        error propagates."""
        endpoints = [
            (
                await app.sources.replicas(),
                await app.sources.routers(),
                await app.sources.legacy() if app.sources.legacy is not None else [],
            )
            for app in self.apps
        ]
        report = await asyncio.to_thread(self._sync, endpoints)
        for app, in_flight in zip(self.apps, report.in_flight_by_app, strict=True):
            await self._publish(
                app, Membership(frontend=self.settings.frontend_id, replica_ids=list(in_flight), in_flight=in_flight)
            )
        return report

    async def run(self, interval_s: float = SYNC_INTERVAL_S) -> None:
        """Reconcile every `interval_s` until cancelled; a failed pass is logged and retried. The publications go
        over one kept-open client (a new client costs tens of ms of CPU: its TLS context)."""
        async with self._publish_client() as client:
            self._client = client
            try:
                while True:
                    try:
                        report = await self.sync_once()
                        if report.changed:
                            logger.info("haproxy sync: %s", report)
                        if self._all_routable(report):
                            self.serving.set()
                    except Exception:
                        logger.exception("haproxy sync pass failed; retrying in %.2f s", interval_s)
                    await asyncio.sleep(interval_s)
            finally:
                self._client = None

    def _all_routable(self, report: SyncReport) -> bool:
        return all(
            app.replicas.live and set(routable) == set(app.replicas.live)
            for app, routable in zip(self.apps, report.in_flight_by_app, strict=True)
        )

    # Blocking part (runs in a worker thread; the runtime API is a unix socket round trip per command).
    def _sync(self, endpoints: Endpoints) -> SyncReport:
        stats = self.runtime.show_stat()
        # This HAProxy's first pass: what Serve lists now already serves (the HAProxy before this one routed to it),
        # so its servers start UP, as a config file's would; one that appears later waits for its health checks.
        first_pass = not self._adopted
        if first_pass:
            self._adopt(stats, endpoints)
            self._adopted = True
        report = SyncReport()
        for app, (replicas, routers, legacy) in zip(self.apps, endpoints, strict=True):
            for pool, wanted in app.pools(replicas, routers, legacy):
                self._sync_pool(pool, wanted, stats, SyncReport() if app.mirrors(pool) else report, first_pass)
            # `stats` predates this pass's additions: a server added now is published once a later pass sees it UP.
            backend = app.replicas.backend
            routable = {
                name: stat.scur
                for name in sorted(app.replicas.live)
                if (stat := stats.get((backend, name))) is not None and stat.confirmed_up
            }
            report.in_flight_by_app.append(routable)
        return report

    def _sync_pool(
        self,
        pool: ServerPool,
        endpoints: list[ReplicaEndpoint],
        stats: dict[tuple[str, str], ServerStat],
        report: SyncReport,
        up_at_once: bool = False,
    ) -> None:
        wanted: dict[str, ReplicaEndpoint] = {}
        for endpoint in endpoints:
            if SERVER_NAME_PATTERN.match(endpoint.replica_id):
                wanted[endpoint.replica_id] = endpoint
            else:
                report.refused.append(endpoint.replica_id)
                if endpoint.replica_id not in self._refused_logged:
                    self._refused_logged.add(endpoint.replica_id)
                    logger.warning("%s: id %r cannot name an HAProxy server; not routable", pool.backend, endpoint)
        now = self.clock()
        # 1. Members that left: maintenance at once (nothing new is pinned to them), in-flight streams go on.
        #    Members that stayed but moved: the new address in place.
        for name, member in sorted(pool.members.items()):
            live = wanted.get(name)
            if live is not None and member.leaving_since is None and (pool.backend, name) not in stats:
                # Deleted behind the syncer's back (by hand, or a lost command): added again below.
                logger.warning("%s/%s was missing from HAProxy: adding it again", pool.backend, name)
                del pool.members[name]
                continue
            if live is None:
                if member.leaving_since is None:
                    self.runtime.set_server_state(pool.backend, name, "maint")
                    member.leaving_since = now
                    report.left.append(name)
                continue
            if not same_address(live, member.endpoint):
                self.runtime.set_server_addr(pool.backend, name, live.host, live.haproxy_port)
                self.runtime.set_server_check_port(pool.backend, name, live.port)
                member.endpoint = live
                report.moved.append(name)
            if member.leaving_since is not None:  # came back before it was deleted
                self.runtime.set_server_state(pool.backend, name, "ready")
                member.leaving_since = None
                report.added.append(name)
        # 2. Leaving members with no stream left (or past the grace): deleted.
        for name in pool.leaving():
            member = pool.members[name]
            stat = stats.get((pool.backend, name))
            idle = stat is not None and stat.scur == 0 and member.leaving_since != now
            overdue = now - member.leaving_since >= self.drain_grace_s  # type: ignore[operator]
            if not (idle or overdue or stat is None):
                continue
            try:
                if overdue and stat is not None and stat.scur:
                    self.runtime.shutdown_sessions(pool.backend, name)
                if stat is not None:
                    self.runtime.del_server(pool.backend, name)
            except RuntimeAPIError as error:
                # Connections still attached (HAProxy releases them asynchronously): the next pass tries again.
                logger.debug("%s", error)
                continue
            del pool.members[name]
            report.deleted.append(name)
        # 3. New members: a server each.
        for name, endpoint in sorted(wanted.items()):
            if name in pool.members:
                continue
            options = pool.options + check_port_option(endpoint)
            self.runtime.add_server(pool.backend, name, endpoint.host, endpoint.haproxy_port, options)
            if pool.checked:
                self.runtime.enable_health(pool.backend, name)
                if not up_at_once:
                    # Routable only once its checks say so: HAProxy would otherwise assume a new server UP.
                    self.runtime.set_server_health_down(pool.backend, name)
            self.runtime.set_server_state(pool.backend, name, "ready")
            pool.members[name] = Member(endpoint)
            report.added.append(name)

    def _adopt(self, stats: dict[tuple[str, str], ServerStat], endpoints: Endpoints) -> None:
        """Take over what an earlier syncer left in this HAProxy: a server that is live under its name and address
        is kept, any other is treated as leaving (deleted once idle)."""
        now = self.clock()
        pools = [
            (pool, wanted)
            for app, (replicas, routers, legacy) in zip(self.apps, endpoints, strict=True)
            for pool, wanted in app.pools(replicas, routers, legacy)
        ]
        for pool, endpoints_of_pool in pools:
            wanted = {e.replica_id: e for e in endpoints_of_pool}
            for (backend, name), stat in stats.items():
                if backend != pool.backend or is_internal_server(name):
                    continue
                host, _, port = stat.addr.rpartition(":")
                found = ReplicaEndpoint(replica_id=name, deployment="", host=host, port=int(port or 0))
                live = wanted.get(name)
                if live is not None and (live.host, live.haproxy_port) == (host, found.port) and not stat.admin_maint:
                    pool.members[name] = Member(live)
                else:
                    pool.members[name] = Member(found, leaving_since=now)
            if pool.members:
                logger.info("adopted %s servers: %s", pool.backend, sorted(pool.members))

    async def _publish(self, app: AppPools, membership: Membership) -> None:
        """Send the app's routable set and open requests to every live router of the app that lacks them or is due
        a heartbeat."""
        now = self.clock()
        live = app.routers.live
        due = [endpoint for name, endpoint in live.items() if self._due(app, name, membership, now)]
        for name in app.published.keys() - live.keys():
            del app.published[name]
        if not due:
            return
        body = membership.model_dump_json()
        url_path = app.app.router_route_prefix + MEMBERSHIP_PATH
        urls = [f"{endpoint.url}{url_path}" for endpoint in due]
        if self._client is not None:
            results = await self._post_all(self._client, urls, body)
        else:
            async with self._publish_client() as client:
                results = await self._post_all(client, urls, body)
        for endpoint, result in zip(due, results, strict=True):
            name = endpoint.replica_id
            if isinstance(result, BaseException):
                if name not in self._publish_failing:
                    logger.warning("publishing the routable replicas to router %s failed: %r", name, result)
                self._publish_failing.add(name)
                continue
            self._publish_failing.discard(name)
            app.published[name] = (membership, now)

    def published_replicas(self) -> int:
        """The fewest replicas any app's live routers have all been told about (0 while one has been told nothing)."""
        return min(app.published_replicas() for app in self.apps)

    @staticmethod
    def _due(app: AppPools, router: str, membership: Membership, now: float) -> bool:
        """New to the router, a heartbeat due, or open requests: counted afresh at every pass while any are open."""
        last = app.published.get(router)
        stale = last is None or last[0] != membership or now - last[1] >= PUBLISH_HEARTBEAT_S
        return stale or any(membership.in_flight.values())

    def _publish_client(self) -> httpx.AsyncClient:
        headers = dict([internal]) if (internal := self.settings.internal_header()) is not None else None
        return httpx.AsyncClient(timeout=PUBLISH_TIMEOUT_S, transport=self._publish_transport, headers=headers)

    @staticmethod
    async def _post_all(client: httpx.AsyncClient, urls: list[str], body: str) -> list[None | BaseException]:
        async def post(url: str) -> None:
            response = await client.post(url, content=body, headers={"content-type": "application/json"})
            response.raise_for_status()

        return await asyncio.gather(*(post(url) for url in urls), return_exceptions=True)
