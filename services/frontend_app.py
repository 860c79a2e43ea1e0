"""The frontend as a Serve application, so a stack outlives the CLI that deployed it.

One replica supervises HAProxy and runs its syncer (and the API key watcher when the stack uses a key file) on a
background loop of its own. HAProxy is started from that loop's thread with PR_SET_PDEATHSIG, so it dies with
the replica; if HAProxy dies alone, the supervisor starts a new one at once and a fresh syncer adds every server
again (no LLM replica is touched). `check_health` fails while HAProxy is down, and `status()` tells the CLI what
the frontend sees: HAProxy's PIDs, its restarts, and its server map.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from typing import Any

from pydantic import BaseModel, ConfigDict
from ray import serve
from ray.serve import Application

from base.runtime import cache_dir
from infra.haproxy_config import HAProxySettings, is_internal_server
from infra.haproxy_process import HAProxyProcess, HAProxyStartError
from services.api_key_watcher import ApiKeyWatcher
from services.background_loop import BackgroundLoop
from services.haproxy_syncer import AppSources, HAProxySyncer
from services.serve_internals import list_replica_endpoints

logger = logging.getLogger(__name__)

FRONTEND_DEPLOYMENT_NAME = "Frontend"
# How often the supervisor looks at HAProxy's master process.
SUPERVISE_INTERVAL_S = 0.2
FIRST_START_TIMEOUT_S = 30.0


class ServedApp(BaseModel):
    """The Serve apps behind one of the frontend's apps: its LLM replicas and its routers."""

    model_config = ConfigDict(extra="forbid")

    llm_app: str
    router_app: str


class FrontendArgs(BaseModel):
    """What `build_frontend_application` takes from a Serve config's `args`."""

    model_config = ConfigDict(extra="forbid")

    stack: str  # names the frontend's working folder
    # In the order of `haproxy.apps`.
    apps: list[ServedApp]
    # HAProxySettings without `workdir` (chosen on the node the replica runs on).
    haproxy: dict[str, Any]


class FrontendReplica:
    def __init__(self, args: dict[str, Any]) -> None:
        parsed = FrontendArgs.model_validate(args)
        self._apps = parsed.apps
        self._settings = HAProxySettings(workdir=cache_dir() / f"frontend-{parsed.stack}", **parsed.haproxy)
        self._settings.workdir.mkdir(parents=True, exist_ok=True)
        self._haproxy: HAProxyProcess | None = None
        self._syncer: HAProxySyncer | None = None
        self.restarts = 0
        self._first_start = threading.Event()
        self._loop = BackgroundLoop([self._supervise])
        self._loop.start()
        # Serve checks the replica's health as soon as it is constructed: HAProxy must be up by then.
        if not self._first_start.wait(FIRST_START_TIMEOUT_S):
            raise RuntimeError(f"HAProxy did not start within {FIRST_START_TIMEOUT_S} s")

    def _running(self) -> bool:
        return self._haproxy is not None and self._haproxy.process is not None and self._haproxy.process.poll() is None

    async def _supervise(self) -> None:
        while True:
            self._haproxy = await self._start_haproxy()
            self._first_start.set()
            runtime = self._haproxy.runtime
            self._syncer = HAProxySyncer(runtime, self._settings, [_sources(app) for app in self._apps])
            tasks = [asyncio.create_task(self._syncer.run())]
            watcher = ApiKeyWatcher.for_settings(runtime, self._settings)
            if watcher is not None:
                tasks.append(asyncio.create_task(watcher.run()))
            try:
                while self._running():
                    await asyncio.sleep(SUPERVISE_INTERVAL_S)
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
            logger.error("HAProxy exited (status %s): starting a new one", self._haproxy.process.returncode)
            self._haproxy.stop()
            self.restarts += 1

    async def _start_haproxy(self) -> HAProxyProcess:
        """A new HAProxy, retried while the old one's port is still held (its worker exits after its master)."""
        while True:
            try:
                return HAProxyProcess(self._settings, die_with_parent=True).start()
            except HAProxyStartError as error:
                logger.error("HAProxy did not start, retrying: %s", error)
                await asyncio.sleep(SUPERVISE_INTERVAL_S)

    async def check_health(self) -> None:
        if not self._running():
            raise RuntimeError("HAProxy is not running (the supervisor is starting a new one)")

    async def status(self) -> dict[str, Any]:
        """HAProxy's PIDs and restarts, and each replica and router server with its state."""
        if not self._running() or self._haproxy is None:
            return {"running": False, "restarts": self.restarts}
        stats = await asyncio.to_thread(self._haproxy.runtime.show_stat)
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
            "url": f"http://{self._settings.bind_host}:{self._settings.port}",
            # Per app: how many replicas all its routers were last told about.
            "published": [app.published_replicas() for app in self._syncer.apps] if self._syncer is not None else [],
            "servers": servers,
        }

    def __del__(self) -> None:
        loop = getattr(self, "_loop", None)
        if loop is not None:
            loop.stop()
        haproxy = getattr(self, "_haproxy", None)
        if haproxy is not None:
            haproxy.stop(grace_s=1)


def _sources(app: ServedApp) -> AppSources:
    return AppSources(
        replicas=lambda: list_replica_endpoints(app.llm_app), routers=lambda: list_replica_endpoints(app.router_app)
    )


def build_frontend_application(args: dict[str, Any]) -> Application:
    """Serve's application builder (`import_path: services.frontend_app:build_frontend_application`).

    One replica, no CPU reserved (HAProxy and the syncer mostly wait), never an HTTP ingress."""
    deployment = serve.deployment(FrontendReplica).options(
        name=FRONTEND_DEPLOYMENT_NAME, num_replicas=1, max_ongoing_requests=8, ray_actor_options={"num_cpus": 0}
    )
    return deployment.bind(FrontendArgs.model_validate(args).model_dump())
