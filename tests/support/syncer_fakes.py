"""The HAProxy syncer against an in-memory runtime API: a fake HAProxy server table and a syncer over it."""

from __future__ import annotations

from pathlib import Path

import httpx

from infra.haproxy.apps import AppRoute
from infra.haproxy.config import HAProxySettings
from infra.haproxy.runtime_api import RuntimeAPIError, ServerStat
from services.frontend.haproxy_syncer import AppSources, HAProxySyncer
from services.serve_internals import ReplicaEndpoint


def settings(tmp_path: Path) -> HAProxySettings:
    return HAProxySettings(workdir=tmp_path, apps=[AppRoute(name="llm")], port=18000, prometheus_port=18404)


class FakeRuntime:
    def __init__(self) -> None:
        self.servers: dict[tuple[str, str], dict[str, object]] = {}
        self.commands: list[str] = []

    def show_stat(self) -> dict[tuple[str, str], ServerStat]:
        status = {"ready": "UP", "maint": "MAINT"}
        return {
            key: ServerStat(key[0], key[1], status[v["state"]], v["scur"], v["addr"])  # type: ignore[arg-type]
            for key, v in self.servers.items()
        }

    def add_server(self, backend: str, server: str, host: str, port: int, options: list[str]) -> None:
        self.commands.append(f"add {server}")
        self.servers[(backend, server)] = {"addr": f"{host}:{port}", "state": "maint", "scur": 0, "options": options}

    def enable_health(self, backend: str, server: str) -> None:
        assert (backend, server) in self.servers

    def set_server_health_down(self, backend: str, server: str) -> None:
        self.commands.append(f"health down {server}")

    def set_server_addr(self, backend: str, server: str, host: str, port: int) -> None:
        self.commands.append(f"addr {server} {port}")
        self.servers[(backend, server)]["addr"] = f"{host}:{port}"

    def set_server_check_port(self, backend: str, server: str, port: int) -> None:
        self.servers[(backend, server)]["check_port"] = port

    def set_server_state(self, backend: str, server: str, state: str) -> None:
        self.commands.append(f"{server} {state}")
        self.servers[(backend, server)]["state"] = state

    def shutdown_sessions(self, backend: str, server: str) -> None:
        self.commands.append(f"shutdown {server}")
        self.servers[(backend, server)]["scur"] = 0

    def del_server(self, backend: str, server: str) -> None:
        entry = self.servers[(backend, server)]
        if entry["state"] != "maint" or entry["scur"]:
            raise RuntimeAPIError(f"del server {backend}/{server}", "Server still has connections attached to it")
        self.commands.append(f"del {server}")
        del self.servers[(backend, server)]


def endpoint(replica_id: str, port: int) -> ReplicaEndpoint:
    return ReplicaEndpoint(replica_id=replica_id, deployment="d", host="127.0.0.1", port=port)


def make_syncer(
    tmp_path: Path,
    runtime: FakeRuntime,
    live: list,
    routers: list,
    now: list[float],
    grace: float = 30,
    publish_transport: httpx.AsyncBaseTransport | None = None,
) -> HAProxySyncer:
    s = settings(tmp_path)
    sources = AppSources(replicas=lambda: _value(list(live)), routers=lambda: _value(list(routers)))
    return HAProxySyncer(
        runtime, s, [sources], drain_grace_s=grace, clock=lambda: now[0], publish_transport=publish_transport
    )


async def _value(value: list[ReplicaEndpoint]) -> list[ReplicaEndpoint]:
    return value
