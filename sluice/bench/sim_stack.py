"""A stack of simulated replicas for `sluice bench policies`: the simulator fleet (one process, every replica on its
own port), one router process (the router's own runtime, `sluice.bench.policy_router`) and sluice's HAProxy with its
syncer, over those replicas instead of Serve's endpoint lists.

Everything but the engines is the real path: HAProxy's config, Lua action and SPOE route call, the syncer's servers
and membership (with the in-flight counts it publishes), the router's policy, KV event subscriber and engine load
poller. The processes get a fresh internal credential each, by environment; every port is on loopback; stopping
closes their standard input and waits, then ends them by PID.
"""

from __future__ import annotations

import json
import os
import secrets
import select
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx

from base.contracts import INTERNAL_CREDENTIAL_HEADER
from base.runtime import free_port
from base.waiting import wait_until
from infra.haproxy.apps import AppRoute
from infra.haproxy.config import REPLICA_BACKEND, HAProxySettings, is_internal_server
from infra.haproxy.process import HAProxyProcess
from infra.haproxy.protection import FrontendProtection
from routers.shadows import SHADOWS_KEY
from services.frontend.background_loop import BackgroundLoop
from services.frontend.haproxy_syncer import AppSources, HAProxySyncer
from services.replica.sim.fleet import CREDENTIAL_ENV, FLEET_STATE_PATH
from services.router.settings import RouterSettings
from services.serve_internals import ReplicaEndpoint
from sluice.bench.policy_router import DECISIONS_PATH, DESCRIBE_PATH, SIM_DEPLOYMENT

APP = "sim"
# Starting a process means importing transformers (the tokenizer): seconds on these machines.
START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 10.0
# Bodies up to the longest prompt (8k tokens of JSON) and more.
BODY_BUFFER_BYTES = 1024 * 1024


class _Child:
    """A process this stack started: its first stdout line is its JSON answer (`answered`); closing its stdin stops
    it. Started before it is needed, so two children import their modules side by side."""

    def __init__(self, module: str, args: list[str], env: dict[str, str]) -> None:
        self.module = module
        self.process = subprocess.Popen(
            [sys.executable, "-m", module, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env
        )
        self.answer: dict[str, Any] = {}

    def send(self, line: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(line.encode() + b"\n")
        self.process.stdin.flush()

    def answered(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        ready, _, _ = select.select([self.process.stdout], [], [], START_TIMEOUT_S)
        line = self.process.stdout.readline() if ready else b""
        if not line:
            raise RuntimeError(
                f"{self.module} did not start within {START_TIMEOUT_S:.0f} s (exit {self.process.poll()})"
            )
        self.answer = json.loads(line)
        return self.answer

    def stop(self) -> None:
        if self.process.stdin is not None and not self.process.stdin.closed:
            self.process.stdin.close()
        try:
            self.process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


class SimPolicyStack:
    """`replicas` simulated replicas behind one router running `policy`; `start()`, then `port`, then `stop()`."""

    def __init__(
        self,
        replicas: int,
        router: RouterSettings,
        model_path: str,
        served_name: str,
        workdir: Path,
        sim_model: dict[str, Any] | None = None,
    ) -> None:
        self.count = replicas
        self.router_settings = router
        self.model_path = model_path
        self.served_name = served_name
        self.workdir = workdir
        self.sim_model = sim_model
        self.credential = secrets.token_urlsafe(32)
        self.headers = {INTERNAL_CREDENTIAL_HEADER: self.credential}
        self.fleet: _Child | None = None
        self.router: _Child | None = None
        self.haproxy: HAProxyProcess | None = None
        self._frontend: BackgroundLoop | None = None
        self.syncer: HAProxySyncer | None = None
        self.replicas: list[ReplicaEndpoint] = []
        self._client = httpx.Client(timeout=10)

    @property
    def port(self) -> int:
        """HAProxy's port (loopback)."""
        assert self.haproxy is not None
        return self.haproxy.settings.port

    def start(self) -> SimPolicyStack:
        env = {**os.environ, CREDENTIAL_ENV: self.credential}
        try:
            args = ["--replicas", str(self.count), "--model-path", self.model_path, "--served-name", self.served_name]
            if self.sim_model:
                args += ["--sim-model", json.dumps(self.sim_model)]
            self.fleet = _Child("services.replica.sim.fleet", args, env)
            self.router = _Child("sluice.bench.policy_router", [], env)
            replicas = self.fleet.answered()["replicas"]
            self.replicas = [ReplicaEndpoint(deployment=SIM_DEPLOYMENT, **replica) for replica in replicas]
            self.router.send(
                json.dumps({"settings": self.router_settings.model_dump(mode="json"), "replicas": replicas})
            )
            self.router.answered()
            self._start_haproxy()
        except BaseException:
            self.stop()
            raise
        return self

    def _start_haproxy(self) -> None:
        assert self.router is not None
        router = ReplicaEndpoint(
            replica_id="router-0",
            deployment="Router",
            host="127.0.0.1",
            port=self.router.answer["port"],
            route_port=self.router.answer["route_port"],
        )
        settings = HAProxySettings(
            workdir=self.workdir,
            internal_credential=self.credential,
            port=free_port(),
            prometheus_port=free_port(),
            protection=FrontendProtection(max_body_bytes=BODY_BUFFER_BYTES),
            apps=[
                AppRoute(
                    name=APP,
                    forward_body=True,
                    body_buffer_bytes=BODY_BUFFER_BYTES,
                    session_header=self.router_settings.session_header,
                )
            ],
        )
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.haproxy = HAProxyProcess(settings).start()
        replicas, routers = list(self.replicas), [router]

        async def replica_source() -> list[ReplicaEndpoint]:
            return replicas

        async def router_source() -> list[ReplicaEndpoint]:
            return routers

        self.syncer = HAProxySyncer(
            self.haproxy.runtime, settings, [AppSources(replicas=replica_source, routers=router_source)]
        )
        self._frontend = BackgroundLoop([self.syncer.run])
        self._frontend.start()
        syncer = self.syncer

        def serving() -> bool:
            stats = self.haproxy.runtime.show_stat().items()  # type: ignore[union-attr]
            up = sum(
                1
                for (backend, name), stat in stats
                if backend == REPLICA_BACKEND and stat.up and not is_internal_server(name)
            )
            return up >= self.count and syncer.published_replicas() >= self.count

        wait_until(START_TIMEOUT_S, serving, "HAProxy to see every simulated replica UP and the router to learn them")

    def fleet_state(self) -> dict[str, dict[str, int]]:
        """Each replica's engine figures now: running, waiting, prefix cache queries and hits (tokens)."""
        assert self.fleet is not None
        response = self._client.get(f"http://127.0.0.1:{self.fleet.answer['control_port']}{FLEET_STATE_PATH}")
        response.raise_for_status()
        return response.json()

    def decisions(self) -> list[float]:
        """The CPU seconds of each decision the router's agent answered since the last call."""
        assert self.router is not None
        url = f"http://127.0.0.1:{self.router.answer['port']}{DECISIONS_PATH}"
        response = httpx.get(url, headers=self.headers, timeout=10)
        response.raise_for_status()
        return response.json()["seconds"]

    def shadow_report(self) -> dict[str, Any]:
        """The router's shadow report (`routers.shadows.ShadowPolicies.report`)."""
        assert self.router is not None
        url = f"http://127.0.0.1:{self.router.answer['port']}{DESCRIBE_PATH}"
        response = httpx.get(url, headers=self.headers, timeout=10)
        response.raise_for_status()
        return response.json()[SHADOWS_KEY]

    def stop(self) -> None:
        try:
            if self._frontend is not None:
                self._frontend.stop()
        finally:
            if self.haproxy is not None:
                self.haproxy.stop()
            for child in (self.router, self.fleet):
                if child is not None:
                    child.stop()
            self._client.close()
