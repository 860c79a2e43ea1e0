"""The direct-streaming topology: HAProxy -> router service -> vLLM replicas, composed from one spec.

Order matters: the LLM app first (the router waits for its replica set), then the router app,
then HAProxy and the syncer that keeps HAProxy's servers equal to the live endpoint sets. The syncer
runs in a thread of its own with its own event loop, so it keeps HAProxy current whatever the
caller does; every change goes through HAProxy's runtime API, never a reload.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from ray import serve

from base.contracts import (
    DEFAULT_MAX_ONGOING_REQUESTS,
    HAPROXY_PORT_DEFAULT,
    HAPROXY_PROMETHEUS_PORT_DEFAULT,
    ROUTE_TIMEOUT_S_DEFAULT,
    SESSION_HEADER_DEFAULT,
)
from base.runtime import cache_dir
from base.tracing import Tracing
from base.waiting import wait_until
from infra.haproxy.apps import BODY_BUFFER_BYTES_DEFAULT, AppRoute
from infra.haproxy.config import (
    CHECK_INTER_S_DEFAULT,
    REPLICA_BACKEND,
    ROUTER_BACKEND,
    HAProxySettings,
    is_internal_server,
)
from infra.haproxy.process import HAProxyProcess
from infra.haproxy.protection import FrontendProtection
from infra.haproxy.runtime_api import RuntimeAPI
from routers.registry import DEFAULT_POLICY, policy_entry
from services.frontend.api_key_watcher import ApiKeyWatcher
from services.frontend.background_loop import BackgroundLoop
from services.frontend.haproxy_syncer import AppSources, HAProxySyncer
from services.internal_credential import internal_credential
from services.replica.llm_config import EngineConfig, LLMAppConfig, ReplicaDeploymentConfig
from services.replica.llm_replica import llm_application
from services.router.route_listener import router_source
from services.router.service import router_application
from services.router.settings import RouterSettings
from services.serve_internals import list_replica_endpoints, wait_for_endpoints


class DirectStreamSpec(BaseModel):
    """One team's direct-streaming app: what to serve, how to route, where to listen."""

    model_config = ConfigDict(extra="forbid")

    app: str = "llm"
    model: str | None = None
    replicas: int = Field(2, ge=1)
    max_ongoing_requests: int = Field(DEFAULT_MAX_ONGOING_REQUESTS, ge=1)
    routers: int = Field(1, ge=1)
    # Name of the router app; None: "<app>-router". Two stacks in front of one LLM app need two names.
    router_name: str | None = None
    policy: str = DEFAULT_POLICY
    policy_kwargs: dict[str, Any] = Field(default_factory=dict)
    session_header: str = SESSION_HEADER_DEFAULT
    fail_open: bool = False
    # The frontend ranks requests from the routers' table (round_robin, consistent_hash): no route call.
    table_decisions: bool = False
    forward_body: bool = False
    body_buffer_bytes: int = BODY_BUFFER_BYTES_DEFAULT
    haproxy_port: int = HAPROXY_PORT_DEFAULT
    prometheus_port: int = HAPROXY_PROMETHEUS_PORT_DEFAULT
    route_timeout_s: float = ROUTE_TIMEOUT_S_DEFAULT
    check_inter_s: float = CHECK_INTER_S_DEFAULT
    # Timeouts, size limits, per-client limits and API keys of the frontend.
    protection: FrontendProtection = FrontendProtection()
    # Config, Lua, key list and runtime socket; None: a folder per HAProxy port in the cache.
    workdir: Path | None = None
    # The LLM app's route prefix, which HAProxy puts before a client's `/v1/...` path ("": the app holds "/").
    replica_route_prefix: str = ""
    # The routers' decisions as spans, and the frontend handing on their traceparent (base/tracing.py); off unless
    # it names a receiver. The LLM app traces as it was deployed.
    tracing: Tracing = Tracing()

    @property
    def router_app(self) -> str:
        return self.router_name or f"{self.app}-router"

    @property
    def router_route_prefix(self) -> str:
        return f"/{self.router_app}"

    def haproxy_settings(self, internal_credential: str | None = None) -> HAProxySettings:
        """The HAProxy in front of the stack; `internal_credential`: the cluster's, which it sends past itself."""
        return HAProxySettings(
            workdir=self.workdir or cache_dir() / f"haproxy-{self.haproxy_port}",
            internal_credential=internal_credential,
            port=self.haproxy_port,
            prometheus_port=self.prometheus_port,
            route_timeout_s=self.route_timeout_s,
            check_inter_s=self.check_inter_s,
            protection=self.protection,
            tracing=self.tracing.enabled,
            apps=[
                AppRoute(
                    name=self.app,
                    fail_open=self.fail_open,
                    table_decisions=self.table_decisions,
                    forward_body=self.forward_body,
                    body_buffer_bytes=self.body_buffer_bytes,
                    session_header=self.session_header,
                    router_route_prefix=self.router_route_prefix,
                    replica_route_prefix=self.replica_route_prefix,
                )
            ],
        )


def deploy_llm(spec: DirectStreamSpec) -> LLMAppConfig:
    """Deploy the LLM app of `spec` (without waiting for its replicas) and return its config."""
    if spec.model is None:
        raise ValueError("deploy_llm needs spec.model")
    config = LLMAppConfig(
        engine=EngineConfig(model=spec.model),
        deployment=ReplicaDeploymentConfig(
            num_replicas=spec.replicas,
            max_ongoing_requests=spec.max_ongoing_requests,
            capacity_ledger=policy_entry(spec.policy).needs_ledger,
        ),
    )
    serve.run(llm_application(config), name=spec.app, route_prefix="/", blocking=False)
    return config


class DirectStreamStack:
    """Router app + HAProxy + syncer in front of an LLM app (deployed here or already running)."""

    def __init__(self, spec: DirectStreamSpec) -> None:
        self.spec = spec
        self.haproxy: HAProxyProcess | None = None
        self.runtime: RuntimeAPI | None = None
        self.syncer: HAProxySyncer | None = None
        self.key_watcher: ApiKeyWatcher | None = None
        self._frontend_thread: BackgroundLoop | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.spec.haproxy_port}"

    def start(self, deploy_model: bool = True, timeout_s: float = 300.0) -> DirectStreamStack:
        spec = self.spec
        if deploy_model:
            deploy_llm(spec)
        wait_for_endpoints(spec.app, spec.replicas, timeout_s=timeout_s)
        router = RouterSettings(
            target_app=spec.app,
            target_capacity=spec.max_ongoing_requests,
            policy=spec.policy,
            policy_kwargs=spec.policy_kwargs,
            session_header=spec.session_header,
            tracing=spec.tracing,
        )
        serve.run(
            router_application(router, num_replicas=spec.routers),
            name=spec.router_app,
            route_prefix=spec.router_route_prefix,
            blocking=False,
        )
        wait_for_endpoints(spec.router_app, spec.routers, timeout_s=timeout_s)
        settings = spec.haproxy_settings(internal_credential())
        settings.workdir.mkdir(parents=True, exist_ok=True)
        self.haproxy = HAProxyProcess(settings).start()
        self.runtime = self.haproxy.runtime
        sources = AppSources(
            replicas=lambda: list_replica_endpoints(spec.app),
            routers=router_source(spec.router_app, spec.router_route_prefix),
        )
        syncer = HAProxySyncer(self.runtime, settings, [sources])
        self.syncer = syncer
        tasks = [syncer.run]
        self.key_watcher = ApiKeyWatcher.for_settings(self.runtime, settings)
        if self.key_watcher is not None:
            tasks.append(self.key_watcher.run)
        self._frontend_thread = BackgroundLoop(tasks)
        self._frontend_thread.start()
        self.wait_until_serving(spec.replicas, spec.routers, timeout_s=60)
        return self

    def _up_counts(self) -> Counter[str]:
        """Backend -> number of its replica (or router) servers UP, from one `show stat`."""
        assert self.runtime is not None
        stats = self.runtime.show_stat().items()
        return Counter(backend for (backend, name), stat in stats if stat.up and not is_internal_server(name))

    def up_servers(self, backend: str) -> int:
        return self._up_counts()[backend]

    def wait_until_serving(self, replicas: int, routers: int, timeout_s: float) -> None:
        """Until HAProxy has `replicas` replicas and `routers` routers UP and every router knows the replicas."""
        syncer = self.syncer
        assert syncer is not None

        def serving() -> bool:
            up = self._up_counts()
            return (
                up[REPLICA_BACKEND] >= replicas
                and up[ROUTER_BACKEND] >= routers
                and syncer.published_replicas() >= replicas
            )

        what = "HAProxy to see every replica and router UP and the routers to learn the replicas"
        wait_until(timeout_s, serving, what, poll_s=0.2)

    def stop(self, delete_apps: bool = True, wait_for_delete: bool = True) -> None:
        """Stop HAProxy and the syncer; delete the router app (`wait_for_delete` False: Serve drains it while the
        caller goes on, which a later stack may do only under another router name)."""
        try:
            if self._frontend_thread is not None:
                self._frontend_thread.stop()
        finally:
            if self.haproxy is not None:
                self.haproxy.stop()
        if delete_apps:
            serve.delete(self.spec.router_app, _blocking=wait_for_delete)
