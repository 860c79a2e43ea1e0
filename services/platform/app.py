"""A platform's frontend as a Serve application (one replica): its own HAProxy on the platform's public port, in
front of every attached team stack's frontend (services/platform/README.md).

The replica supervises HAProxy (a new one at once if it dies) and runs the syncer (`services.platform.syncer`) on a
background loop of its own; a new HAProxy starts empty and the syncer fills it again. It answers `sluice status`
(`status`): the tenants, the attached models with their slot, team, capacity and what HAProxy holds of them now.
"""

from __future__ import annotations

import asyncio
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
from infra.api_keys import ApiKeySource
from infra.haproxy.platform_cfg import write_platform_files
from infra.haproxy.platform_runtime import PlatformRuntime
from infra.haproxy.platform_settings import (
    PLATFORM_FRONTEND,
    SLOT_SERVER,
    TENANT_TABLE,
    TOKENS_TABLE,
    PlatformHAProxySettings,
    TenantRoute,
    slot_backend,
)
from infra.haproxy.process import HAProxyProcess
from services import attachments
from services.frontend.background_loop import BackgroundLoop
from services.frontend.haproxy_supervision import SUPERVISE_INTERVAL_S, retire, start_until_up
from services.internal_credential import internal_credential
from services.platform.syncer import PlatformSyncer
from services.serve_internals import with_rollout_version

logger = logging.getLogger(__name__)

PLATFORM_DEPLOYMENT_NAME = "Platform"
FIRST_START_TIMEOUT_S = 30.0
# How long a stopping platform's HAProxy serves the streams it holds (a redeploy's new one listens beside it).
HANDOVER_DRAIN_S = 60.0
SHUTDOWN_MARGIN_S = 10.0


class PlatformTenant(BaseModel):
    """A tenant as the platform's replica takes it: its keys' source, the models it may call, its HAProxy side."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    team: str
    api_keys: ApiKeySource
    # None: every model its own team attached.
    models: list[str] | None = None
    route: TenantRoute

    def may_call(self, model: str, owner_team: str) -> bool:
        return model in self.models if self.models is not None else owner_team == self.team


class PlatformArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    platform: str
    stack: str
    # PlatformHAProxySettings without `workdir` (chosen on the node the replica runs on).
    haproxy: dict[str, Any]
    tenants: list[PlatformTenant]
    node_role: NodeRole | None = None


class PlatformReplica:
    def __init__(self, args: dict[str, Any]) -> None:
        parsed = PlatformArgs.model_validate(args)
        haproxy = dict(parsed.haproxy)
        if parsed.node_role is not None:
            haproxy["bind_host"] = ray.util.get_node_ip_address()
        workdir = cache_dir() / f"platform-{parsed.platform}-{os.getpid()}"
        shutil.rmtree(workdir, ignore_errors=True)
        workdir.mkdir(parents=True)
        self._platform = parsed.platform
        self._tenants = parsed.tenants
        if any(tenant.route.tokens_per_minute is not None for tenant in parsed.tenants):
            # The replicas report a token-quota tenant's tokens here: a port of its own choosing, kept across
            # HAProxy restarts (each request tells its replica where).
            haproxy["usage_port"] = free_port(haproxy.get("bind_host", DEFAULT_BIND_HOST))
        self._settings = PlatformHAProxySettings(workdir=workdir, internal_credential=internal_credential(), **haproxy)
        self._haproxy: HAProxyProcess | None = None
        self._syncer: PlatformSyncer | None = None
        self.restarts = 0
        self._started = threading.Event()
        self._retiring = threading.Event()
        self._loop = BackgroundLoop([self._supervise])
        self._loop.start()
        if not self._started.wait(FIRST_START_TIMEOUT_S):
            raise RuntimeError(f"the platform's HAProxy did not start within {FIRST_START_TIMEOUT_S} s")

    def _running(self) -> bool:
        return self._haproxy is not None and self._haproxy.process is not None and self._haproxy.process.poll() is None

    async def _supervise(self) -> None:
        while not self._retiring.is_set():
            self._haproxy = await self._start_haproxy()
            runtime = self._haproxy.runtime
            control = PlatformRuntime(runtime, self._settings)
            self._syncer = PlatformSyncer(
                control, list(self._tenants), lambda: attachments.attached(self._platform), self._settings.model_slots
            )
            # Paused until every attached model is in: beside a redeploy's old platform (both bound with
            # SO_REUSEPORT) it would otherwise take connections and answer 404 for models it has not attached yet.
            await asyncio.to_thread(runtime.pause_frontend, PLATFORM_FRONTEND)
            await asyncio.to_thread(self._syncer.sync_once)
            await asyncio.to_thread(runtime.resume_frontend, PLATFORM_FRONTEND)
            self._started.set()
            task = asyncio.create_task(self._syncer.run())
            try:
                while self._running():
                    await asyncio.sleep(SUPERVISE_INTERVAL_S)
            finally:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
            if self._retiring.is_set():
                return
            logger.error(
                "the platform's HAProxy exited (status %s): starting a new one", self._haproxy.process.returncode
            )
            self._haproxy.stop()
            self.restarts += 1

    async def _start_haproxy(self) -> HAProxyProcess:
        """A new HAProxy with no model attached yet (the syncer attaches them)."""
        settings = self._settings

        def start() -> HAProxyProcess:
            write = lambda: write_platform_files(settings, keys={}, access=set(), models={})  # noqa: E731
            return HAProxyProcess(settings, die_with_parent=True, write=write).start()

        return await start_until_up(start)

    async def check_health(self) -> None:
        if not self._loop.is_running():
            raise RuntimeError("the platform's background loop ended")
        if not self._running():
            raise RuntimeError("the platform's HAProxy is not running (the supervisor is starting a new one)")

    async def status(self) -> dict[str, Any]:
        """HAProxy's PIDs, the tenants, and each attached model with its slot, owner and HAProxy's view of it."""
        if not self._running() or self._haproxy is None or self._syncer is None:
            return {"running": False, "restarts": self.restarts}
        stats = await asyncio.to_thread(self._haproxy.runtime.show_stat)
        queues = await asyncio.to_thread(self._haproxy.runtime.backend_queues)
        usage = await asyncio.to_thread(self._haproxy.runtime.show_table, TENANT_TABLE)
        tokens = await asyncio.to_thread(self._haproxy.runtime.show_table, TOKENS_TABLE)
        models = []
        for name, entry in sorted(self._syncer.entries.items()):
            stat = stats.get((slot_backend(entry.slot), SLOT_SERVER))
            models.append(
                {
                    "model": name,
                    "stack": entry.stack,
                    "team": entry.team,
                    "slot": entry.slot,
                    "capacity": entry.capacity,
                    "address": f"{entry.host}:{entry.port}",
                    "status": stat.status if stat is not None else "absent",
                    "in_flight": stat.scur if stat is not None else 0,
                    "queued": queues.get(slot_backend(entry.slot), 0),
                }
            )
        return {
            "running": True,
            "replica_pid": os.getpid(),
            "master_pid": self._haproxy.pid,
            "worker_pid": self._haproxy.worker_pid,
            "restarts": self.restarts,
            "url": f"http://{self._settings.bind_host}:{self._settings.port}",
            "tenants": [
                {
                    "team": tenant.team,
                    "models": sorted(m for t, m in self._syncer.access if t == tenant.team),
                    "usage": _usage(usage.get(tenant.team, {}), tokens.get(tenant.team, {})),
                }
                for tenant in self._tenants
            ],
            "models": models,
            "refused": [{"model": model, "stack": stack} for model, stack in self._syncer.refused],
        }

    def __del__(self) -> None:
        """Serve stops this replica (a redeploy's new platform runs already, or it is deleted): its HAProxy serves
        the streams it holds for up to `HANDOVER_DRAIN_S`."""
        retire(self, HANDOVER_DRAIN_S)


def _usage(counters: dict[str, int], tokens: dict[str, int]) -> dict[str, int]:
    """A tenant's live usage from its stick-table entries (no entry: nothing yet; tokens are counted only for a
    tenant with a token quota)."""
    return {
        "in_flight": counters.get("conn_cur", 0),
        "requests_last_minute": counters.get("http_req_rate", 0),
        "requests": counters.get("http_req_cnt", 0),
        "queue_timeouts": counters.get("gpc0", 0),
        "tokens_last_minute": tokens.get("gpc0_rate", 0),
    }


def build_platform_application(args: dict[str, Any]) -> Application:
    """Serve's application builder (`import_path: services.platform.app:build_platform_application`): one replica,
    no CPU reserved, never an HTTP ingress; its version is its args (a redeploy with other args hands over)."""
    parsed = PlatformArgs.model_validate(args)
    deployment = serve.deployment(PlatformReplica).options(
        name=PLATFORM_DEPLOYMENT_NAME,
        num_replicas=1,
        max_surge_percent=100,
        graceful_shutdown_timeout_s=HANDOVER_DRAIN_S + SHUTDOWN_MARGIN_S,
        max_ongoing_requests=8,
        ray_actor_options={"num_cpus": 0, "resources": node_role_resources(parsed.node_role)},
    )
    version = config_version([parsed.model_dump(mode="json"), PLATFORM_DEPLOYMENT_NAME])
    return with_rollout_version(deployment, version).bind(parsed.model_dump(mode="json"))
