"""The frontend as a Serve application (one replica per stack), so a stack outlives the CLI that deployed it.

The replica supervises HAProxy (restarted at once if it dies alone), runs the syncer, the API key and certificate
watchers and the ingress controller on a background loop of its own, and answers the CLI (`status`, `shift`,
`ingress`, `requests`). Its declared ingress is the deployment's `user_config`. How and why:
services/frontend/README.md.

A redeploy hands over: Serve starts the new frontend beside the old one (`max_surge_percent` 100) and stops the old
one only once the new one runs, its HAProxy listening on the same port (HAProxy binds with SO_REUSEPORT). The old
replica's stop then soft-stops its HAProxy, which closes its listeners and serves the streams it holds to their end,
for up to `HANDOVER_DRAIN_S`; the replica's graceful-shutdown budget is that plus `SHUTDOWN_MARGIN_S`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import shutil
import threading
from typing import Any

import ray
from pydantic import BaseModel, ConfigDict
from ray import serve
from ray.serve import Application

from base.contracts import DEFAULT_BIND_HOST, NodeRole, node_role_resources
from base.rollout import config_version
from base.runtime import cache_dir, free_port
from infra.haproxy.apps import AppRoute
from infra.haproxy.canary import legacy_backend
from infra.haproxy.config import FRONTEND, HAProxySettings, is_internal_server
from infra.haproxy.process import HAProxyProcess
from infra.haproxy.runtime_api import RuntimeAPI
from services import attachments
from services.attachments import AttachedModel, AttachedStack
from services.frontend.api_key_watcher import ApiKeyWatcher
from services.frontend.background_loop import BackgroundLoop
from services.frontend.haproxy_supervision import SUPERVISE_INTERVAL_S, retire, start_until_up
from services.frontend.haproxy_syncer import AppSources, HAProxySyncer
from services.frontend.ingress_control import IngressConfig, IngressController, ingress_store_key
from services.frontend.path_log import PathLog
from services.frontend.tls_watcher import TLSWatcher
from services.internal_credential import internal_credential
from services.router.route_listener import router_source
from services.serve_internals import list_replica_endpoints, with_rollout_version

logger = logging.getLogger(__name__)

FRONTEND_DEPLOYMENT_NAME = "Frontend"
FIRST_START_TIMEOUT_S = 30.0
# How long a new HAProxy stays paused waiting to route every live replica (then it listens anyway).
FIRST_SYNC_WAIT_S = 10.0
# How long a stopping frontend's HAProxy serves the streams it still holds (an SSE answer of a few thousand tokens
# takes seconds to a minute); a stream past it is cut when the replica ends.
HANDOVER_DRAIN_S = 60.0
# How often an attached stack's frontend checks that its record on the platform is current.
ATTACHMENT_PUBLISH_S = 1.0
# Serve's budget for the stop beyond the drain: stopping the background loop and removing the workdir.
SHUTDOWN_MARGIN_S = 10.0


class ServedApp(BaseModel):
    """The Serve apps behind one of the frontend's apps: its LLM replicas and its routers."""

    model_config = ConfigDict(extra="forbid")

    llm_app: str
    router_app: str
    # The app's retained legacy ingress (served while deployed; None: the app has no legacy path).
    legacy_app: str | None = None


class AttachedApp(BaseModel):
    """One app of a stack attached to a platform, as the platform queues for it."""

    model_config = ConfigDict(extra="forbid")

    model: str
    max_ongoing_requests: int


class Attachment(BaseModel):
    """A stack attached to a platform (services/attachments.py): its HAProxy takes free loopback ports and the
    frontend publishes where it listens and each model's capacity."""

    model_config = ConfigDict(extra="forbid")

    platform: str
    team: str
    # In the order of `haproxy.apps`.
    apps: list[AttachedApp]


class FrontendArgs(BaseModel):
    """What `build_frontend_application` takes from a Serve config's `args`."""

    model_config = ConfigDict(extra="forbid")

    stack: str  # names the frontend's working folder
    # In the order of `haproxy.apps`.
    apps: list[ServedApp]
    # HAProxySettings without `workdir` (chosen on the node the replica runs on).
    haproxy: dict[str, Any]
    # The declared ingress: becomes the deployment's `user_config`.
    ingress: IngressConfig = IngressConfig()
    # A stack across nodes: the frontend runs on the head node and binds its address; None: one machine, loopback.
    node_role: NodeRole | None = None
    # A stack attached to a platform: no public port of its own (None: a stack with its own frontend).
    attachment: Attachment | None = None


class FrontendReplica:
    def __init__(self, args: dict[str, Any]) -> None:
        parsed = FrontendArgs.model_validate(args)
        self._apps = parsed.apps
        haproxy = dict(parsed.haproxy)
        if parsed.node_role is not None:
            haproxy["bind_host"] = ray.util.get_node_ip_address()
        self._stack = parsed.stack
        self._attachment = parsed.attachment
        if parsed.attachment is not None:
            # Ports of its own choosing, kept across HAProxy restarts: the platform learns them from the record.
            host = haproxy.get("bind_host", DEFAULT_BIND_HOST)
            haproxy.update(port=free_port(host), prometheus_port=free_port(host))
        # A folder per frontend process: a redeploy's new frontend runs beside the old one until the old one drains,
        # and their HAProxies' runtime and log sockets must not meet.
        workdir = cache_dir() / f"frontend-{parsed.stack}-{os.getpid()}"
        shutil.rmtree(workdir, ignore_errors=True)  # left by a dead process that had this PID
        workdir.mkdir(parents=True)
        self._settings = HAProxySettings(workdir=workdir, internal_credential=internal_credential(), **haproxy)
        self._haproxy: HAProxyProcess | None = None
        self._syncer: HAProxySyncer | None = None
        self.restarts = 0
        self._first_start = threading.Event()
        # Set when Serve stops this replica: the supervisor starts no HAProxy any more.
        self._retiring = threading.Event()
        # Set once HAProxy's public frontend listens (after its first servers are in).
        self._listening = threading.Event()
        self._log = PathLog()
        self._ingress = IngressController(
            self._settings,
            self._runtime,
            self._log,
            self._live_replicas,
            self._legacy_up,
            ingress_store_key(parsed.stack),
        )
        tasks = [self._listen, self._supervise, self._ingress.guard]
        if parsed.attachment is not None:
            tasks.append(self._publish_attachment)
        self._loop = BackgroundLoop(tasks)
        self._loop.start()
        # Serve checks the replica's health as soon as it is constructed: HAProxy must be up by then.
        if not self._first_start.wait(FIRST_START_TIMEOUT_S):
            raise RuntimeError(f"HAProxy did not start within {FIRST_START_TIMEOUT_S} s")
        # A redeploy's old frontend stops once this one runs: this one's HAProxy listens by then (`_open`).
        if not self._listening.wait(FIRST_SYNC_WAIT_S + FIRST_START_TIMEOUT_S):
            raise RuntimeError("HAProxy's public frontend was not opened")

    def _runtime(self) -> RuntimeAPI | None:
        return self._haproxy.runtime if self._running() and self._haproxy is not None else None

    def _live_replicas(self) -> dict[str, list[str]]:
        if self._syncer is None:
            return {}
        return {pools.app.name: sorted(pools.replicas.live) for pools in self._syncer.apps}

    def _legacy_up(self) -> bool:
        """Whether every app with a legacy path has a legacy ingress server UP in HAProxy."""
        runtime = self._runtime()
        if runtime is None:
            return False
        stats = runtime.show_stat()
        return all(
            any(b == legacy_backend(i) and s.up and not is_internal_server(n) for (b, n), s in stats.items())
            for i, app in enumerate(self._settings.apps)
            if app.legacy_route_prefix is not None
        )

    async def _listen(self) -> None:
        transport = await self._log.listen(self._settings.log_socket_path)
        try:
            await asyncio.Event().wait()
        finally:
            transport.close()

    def _running(self) -> bool:
        return self._haproxy is not None and self._haproxy.process is not None and self._haproxy.process.poll() is None

    def _attachment_record(self) -> AttachedStack | None:
        """Where this attached stack's HAProxy listens and each model's capacity now (None: not listening yet)."""
        attachment = self._attachment
        if attachment is None or not self._listening.is_set():
            return None
        live = self._live_replicas()
        models = [
            AttachedModel(name=app.model, capacity=len(live.get(route.name, [])) * app.max_ongoing_requests)
            for app, route in zip(attachment.apps, self._settings.apps, strict=True)
        ]
        return AttachedStack(
            platform=attachment.platform,
            stack=self._stack,
            team=attachment.team,
            host=self._settings.bind_host,
            port=self._settings.port,
            models=models,
        )

    async def _publish_attachment(self) -> None:
        """Keep the stack's record on its platform current (services/attachments.py)."""
        published: AttachedStack | None = None
        while not self._retiring.is_set():
            record = self._attachment_record()
            if record is not None and record != published:
                await asyncio.to_thread(attachments.publish, record)
                published = record
            await asyncio.sleep(ATTACHMENT_PUBLISH_S)

    async def _supervise(self) -> None:
        while not self._retiring.is_set():
            self._haproxy = await self._start_haproxy()
            runtime = self._haproxy.runtime
            # Paused until its servers are in: beside a redeploy's old frontend (both bound with SO_REUSEPORT) it
            # would otherwise take connections it cannot route yet.
            await asyncio.to_thread(runtime.pause_frontend, FRONTEND)
            await asyncio.to_thread(self._ingress.publish_rollbacks)
            sources = [_sources(app, route) for app, route in zip(self._apps, self._settings.apps, strict=True)]
            self._syncer = HAProxySyncer(runtime, self._settings, sources)
            self._first_start.set()
            tasks = [asyncio.create_task(self._syncer.run()), asyncio.create_task(self._open(runtime, self._syncer))]
            for watcher in (
                ApiKeyWatcher.for_settings(runtime, self._settings),
                TLSWatcher.for_settings(runtime, self._settings),
            ):
                if watcher is not None:
                    tasks.append(asyncio.create_task(watcher.run()))
            try:
                while self._running():
                    await asyncio.sleep(SUPERVISE_INTERVAL_S)
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
            if self._retiring.is_set():
                return
            logger.error("HAProxy exited (status %s): starting a new one", self._haproxy.process.returncode)
            self._haproxy.stop()
            self.restarts += 1

    async def _open(self, runtime: RuntimeAPI, syncer: HAProxySyncer) -> None:
        """Resume HAProxy's public frontend once it routes every live replica (`FIRST_SYNC_WAIT_S` at most: a first
        deploy's replicas are still starting)."""
        if not await asyncio.to_thread(syncer.serving.wait, FIRST_SYNC_WAIT_S):
            logger.warning(
                "HAProxy does not route every live replica after %.0f s; listening anyway", FIRST_SYNC_WAIT_S
            )
        await asyncio.to_thread(runtime.resume_frontend, FRONTEND)
        self._listening.set()

    async def _start_haproxy(self) -> HAProxyProcess:
        """A new HAProxy, which starts with the weight in force, not the one it was first declared with."""

        def start() -> HAProxyProcess:
            settings = self._settings.model_copy(update={"direct_weight": self._ingress.weight})
            return HAProxyProcess(settings, die_with_parent=True).start()

        return await start_until_up(start)

    async def check_health(self) -> None:
        if not self._loop.is_running():
            raise RuntimeError("the frontend's background loop ended")
        if not self._running():
            raise RuntimeError("HAProxy is not running (the supervisor is starting a new one)")

    async def reconfigure(self, user_config: dict[str, Any]) -> None:
        """The declared ingress (Serve calls this at start and whenever the deployment's `user_config` changes)."""
        await self._loop.submit(self._ingress.declare(IngressConfig.model_validate(user_config)))

    async def shift(self, weight: int, wait: bool = False) -> dict[str, Any]:
        """Set the direct weight now (`sluice canary`, `sluice rollback`); with `wait`, return once a path that lost
        all its traffic has drained (or its deadline passed)."""
        self._ingress.abort = None
        await self._loop.submit(self._ingress.shift(weight))
        if wait:
            await self._loop.submit(self._ingress.wait_drained())
        return self._ingress.status().model_dump(mode="json")

    async def ingress(self) -> dict[str, Any]:
        """The weight, the last drain, the last abort and both paths' measures."""
        return self._ingress.status().model_dump(mode="json")

    async def requests(self, request_ids: list[str]) -> list[dict[str, Any]]:
        """The log records of these request ids (finished requests only)."""
        return [dataclasses.asdict(record) for record in self._log.find(set(request_ids))]

    async def status(self) -> dict[str, Any]:
        """HAProxy's PIDs and restarts, and each replica and router server with its state."""
        if not self._running() or self._haproxy is None:
            return {"running": False, "restarts": self.restarts}
        stats = await asyncio.to_thread(self._haproxy.runtime.show_stat)
        weights = await asyncio.to_thread(self._haproxy.runtime.show_map, self._settings.weights_map_path)
        servers = [
            {"backend": backend, "server": name, "status": stat.status, "addr": stat.addr, "sessions": stat.scur}
            for (backend, name), stat in sorted(stats.items())
            if not is_internal_server(name)
        ]
        return {
            "running": True,
            "replica_pid": os.getpid(),
            "master_pid": self._haproxy.pid,
            "worker_pid": self._haproxy.worker_pid,
            "restarts": self.restarts,
            "url": f"{'https' if self._settings.tls else 'http'}://{self._settings.bind_host}:{self._settings.port}",
            "runtime_socket": str(self._haproxy.runtime.socket_path),
            # Per app: how many replicas all its routers were last told about.
            "published": [app.published_replicas() for app in self._syncer.apps] if self._syncer is not None else [],
            "servers": servers,
            "direct_weight": self._ingress.weight,
            # Each app's direct weight as HAProxy holds it (what the Lua action reads).
            "haproxy_weights": {app: int(weight) for app, weight in weights.items()},
        }

    def __del__(self) -> None:
        """Serve stops this replica (a redeploy's new frontend already runs, or the stack is deleted): HAProxy
        soft-stops and serves what it holds for up to `HANDOVER_DRAIN_S`, while the loop whose thread started it
        (its death signal) lives; then the loop ends. The run-time weight stays in Ray's KV store for the next
        frontend (`sluice down` drops it)."""
        attachment = getattr(self, "_attachment", None)
        if attachment is not None:
            self._retiring.set()  # no record published after the withdrawal
            attachments.withdraw(attachment.platform, self._stack, port=self._settings.port)
        retire(self, HANDOVER_DRAIN_S)


def _sources(app: ServedApp, route: AppRoute) -> AppSources:
    legacy_app = app.legacy_app
    return AppSources(
        replicas=lambda: list_replica_endpoints(app.llm_app),
        routers=router_source(app.router_app, route.router_route_prefix),
        legacy=(lambda: list_replica_endpoints(legacy_app)) if legacy_app is not None else None,
    )


def build_frontend_application(args: dict[str, Any]) -> Application:
    """Serve's application builder (`import_path: services.frontend.app:build_frontend_application`).

    One replica, no CPU reserved (HAProxy and the syncer mostly wait), never an HTTP ingress. Its version is its
    args: a redeploy that changes only the ingress (`user_config`) reconfigures the running replica; one that changes
    the rest hands over (the module's docstring)."""
    parsed = FrontendArgs.model_validate(args)
    deployment = serve.deployment(FrontendReplica).options(
        name=FRONTEND_DEPLOYMENT_NAME,
        num_replicas=1,
        max_surge_percent=100,
        graceful_shutdown_timeout_s=HANDOVER_DRAIN_S + SHUTDOWN_MARGIN_S,
        max_ongoing_requests=8,
        ray_actor_options={"num_cpus": 0, "resources": node_role_resources(parsed.node_role)},
        user_config=parsed.ingress.model_dump(mode="json"),
    )
    version = config_version([parsed.model_dump(mode="json", exclude={"ingress"}), FRONTEND_DEPLOYMENT_NAME])
    return with_rollout_version(deployment, version).bind(parsed.model_dump(exclude={"ingress"}))
