"""The rendered HAProxy config and Lua action; `haproxy -c` on them; the syncer's slot bookkeeping (fake runtime)."""

from __future__ import annotations

import asyncio
import inspect
import re
import stat
from pathlib import Path

import pytest
from pydantic import ValidationError

from infra import haproxy_config
from infra.haproxy_config import (
    REPLICA_BACKEND,
    ROUTER_BACKEND,
    AppRoute,
    HAProxySettings,
    render_config,
    replica_slot_names,
)
from infra.haproxy_lua import LUA_TEMPLATE, render_lua
from infra.haproxy_process import HAProxyNotFoundError, check_config, find_haproxy_binary, write_files
from infra.runtime_api import ServerStat
from services.haproxy_syncer import HAProxySyncer
from services.serve_internals import ReplicaEndpoint
from sluice import contracts


def settings(tmp_path: Path, **app: object) -> HAProxySettings:
    return HAProxySettings(workdir=tmp_path, app=AppRoute(name="llm", **app), port=18000, prometheus_port=18404)


# Constants the data plane must carry, and where each must appear. Router-side reasons (`no_replica`
# and the like) are passed through from the router's reply, so they appear nowhere here.
CONFIG_CONSTANTS = {
    "REQUEST_ID_HEADER": contracts.REQUEST_ID_HEADER,
    "SERVE_REASON_HEADER": contracts.SERVE_REASON_HEADER,
    "SERVE_FALLBACK_HEADER": contracts.SERVE_FALLBACK_HEADER,
    "HEALTH_PATH": contracts.HEALTH_PATH,
}
LUA_CONSTANTS = {
    "REQUEST_ID_HEADER": contracts.REQUEST_ID_HEADER,
    "SESSION_HEADER_DEFAULT": contracts.SESSION_HEADER_DEFAULT,
    "CAPACITY_TOKEN_HEADER": contracts.CAPACITY_TOKEN_HEADER,
    "BODY_TRUNCATED_HEADER": contracts.BODY_TRUNCATED_HEADER,
    "APP_HEADER": contracts.APP_HEADER,
    "ROUTE_PATH": contracts.ROUTE_PATH,
    **{f"FAIL_CLOSED_REASONS[{i}]": reason for i, reason in enumerate(contracts.FAIL_CLOSED_REASONS)},
}


def test_every_header_constant_is_rendered_or_stripped() -> None:
    header_names = {name: value for name, value in vars(contracts).items() if re.search(r"_HEADER(_DEFAULT)?$", name)}
    assert header_names, "contracts lost its header constants?"
    covered = set(CONFIG_CONSTANTS) | set(LUA_CONSTANTS)
    for name, value in header_names.items():
        if name not in covered:
            # Response-only headers of the replica (x-serve-replica): covered by the stripped prefixes.
            assert value.startswith(contracts.INTERNAL_HEADER_PREFIXES), name


@pytest.mark.parametrize("fail_open", [False, True])
def test_constants_come_from_contracts(tmp_path: Path, fail_open: bool) -> None:
    s = settings(tmp_path, fail_open=fail_open)
    config, lua = render_config(s), render_lua(s)
    for name, value in CONFIG_CONSTANTS.items():
        if name == ("SERVE_REASON_HEADER" if fail_open else "SERVE_FALLBACK_HEADER"):
            assert value not in config, name
        else:
            assert value in config, name
    for name, value in LUA_CONSTANTS.items():
        assert f'"{value}"' in lua, name
    for prefix in contracts.INTERNAL_HEADER_PREFIXES:
        assert f"http-request del-header {prefix} -m beg" in config
    assert f"local ROUTE_TIMEOUT_S = {float(contracts.ROUTE_TIMEOUT_S_DEFAULT)!r}" in lua
    assert f"bind 127.0.0.1:{contracts.HAPROXY_PORT_DEFAULT}" in render_config(
        HAProxySettings(workdir=tmp_path, app=AppRoute(name="x"))
    )


def test_nothing_of_the_contract_is_written_by_hand() -> None:
    """The Lua template and the config renderer carry no literal header/reason/path: only placeholders."""
    template = re.sub(r"\$\w+", "", LUA_TEMPLATE.template)  # placeholder names may spell a constant's name
    sources = template + inspect.getsource(haproxy_config.render_config)
    literals = [
        contracts.REQUEST_ID_HEADER,
        contracts.SESSION_HEADER_DEFAULT,
        contracts.CAPACITY_TOKEN_HEADER,
        contracts.BODY_TRUNCATED_HEADER,
        contracts.SERVE_REASON_HEADER,
        contracts.SERVE_FALLBACK_HEADER,
        contracts.APP_HEADER,
        contracts.HEALTH_PATH,
        *contracts.FAIL_CLOSED_REASONS,
        *contracts.INTERNAL_HEADER_PREFIXES,
    ]
    for literal in literals:
        assert literal not in sources, literal
    assert "/internal/" not in LUA_TEMPLATE.template


def test_frontend_pieces(tmp_path: Path) -> None:
    config = render_config(settings(tmp_path))
    for piece in [
        "master-worker",
        f"stats socket {tmp_path.resolve()}/haproxy.sock mode 600 level admin",
        "hard-stop-after 120s",
        "option http-no-delay",
        "unique-id-format %[uuid()]",
        "http-request set-header x-request-id %[unique-id] unless { req.hdr(x-request-id) -m found }",
        "http-after-response set-header x-request-id %[var(txn.sluice_request_id)]",
        "http-request lua.sluice_route unless METH_GET",
        "balance leastconn",
        "option persist",
        "option httpchk GET /-/healthz",
        "http-check expect status 200",
        "default-server inter 5s fastinter 250ms downinter 250ms fall 2 rise 2",
        "timeout client 3600s",
        "timeout server 3600s",
        "timeout connect 5s",
        "timeout http-keep-alive 90s",
        "bind 127.0.0.1:18404",
        "http-request use-service prometheus-exporter if { path /metrics }",
        f"lua-load-per-thread {tmp_path.resolve()}/sluice_route.lua",
    ]:
        assert piece in config, piece
    # Internal headers are stripped before anything reads or sets them.
    assert config.index("del-header x-serve-") < config.index("set-header x-request-id")
    assert config.index("del-header x-sluice-") < config.index("lua.sluice_route")
    # The 503 precedes the backend choice.
    fail = config.index("http-request return status 503")
    assert config.index("lua.sluice_route") < fail < config.index("default_backend")
    line = next(li for li in config.splitlines() if "http-request return status 503" in li)
    assert "content-type application/json" in line and 'hdr x-serve-reason "%[var(txn.sluice_reason)]"' in line
    assert '"type": "service_unavailable", "code": 503' in line
    assert "http-buffer-request" not in config and "tune.bufsize" not in config


def test_fail_open_has_no_503_but_a_fallback_header(tmp_path: Path) -> None:
    config = render_config(settings(tmp_path, fail_open=True))
    assert "http-request return status 503" not in config
    assert "http-after-response set-header x-serve-fallback %[var(txn.sluice_reason)]" in config


def test_body_forwarding_buffers_the_body(tmp_path: Path) -> None:
    s = settings(tmp_path, forward_body=True, body_buffer_bytes=100_000)
    config, lua = render_config(s), render_lua(s)
    assert "option http-buffer-request" in config
    bufsize = int(re.search(r"tune\.bufsize (\d+)", config)[1])
    maxrewrite = int(re.search(r"tune\.maxrewrite (\d+)", config)[1])
    assert bufsize - maxrewrite > 100_000
    assert "local FORWARD_BODY = true" in lua and "local BODY_BUFFER_BYTES = 100000" in lua
    assert "local FORWARD_BODY = false" in render_lua(settings(tmp_path))


def test_custom_session_header_and_timeout(tmp_path: Path) -> None:
    app = AppRoute(name="chat", session_header="X-Conversation", router_route_prefix="/router/")
    s = HAProxySettings(workdir=tmp_path, app=app, route_timeout_s=1.5)
    lua = render_lua(s)
    assert f'local ROUTE_PATH = "/router{contracts.ROUTE_PATH}"' in lua
    assert f'local ROUTE_PATH = "{contracts.ROUTE_PATH}"' in render_lua(settings(tmp_path))
    assert 'local SESSION_HEADER = "x-conversation"' in lua
    assert 'local APP_NAME = "chat"' in lua
    assert "local ROUTE_TIMEOUT_S = 1.5" in lua


@pytest.mark.parametrize("slots", [1, 3, 16])
def test_one_use_server_rule_per_slot(tmp_path: Path, slots: int) -> None:
    s = HAProxySettings(workdir=tmp_path, app=AppRoute(name="llm"), replica_slots=slots, router_slots=2)
    config = render_config(s)
    rules = re.findall(r"use-server (\S+) if \{ var\(txn\.sluice_server\) -m str (\S+) \}", config)
    assert rules == [(name, name) for name in replica_slot_names(s)]
    assert f"server-template replica 1-{slots} 127.0.0.1:1 check disabled" in config
    assert "server-template router 1-2 127.0.0.1:1 check disabled" in config
    assert 'local ROUTER_SLOTS = {"router1", "router2"}' in render_lua(s)


def test_settings_refuse_bad_values(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="internal prefix"):
        AppRoute(name="a", session_header="x-sluice-session")
    with pytest.raises(ValidationError):
        AppRoute(name="a b")
    with pytest.raises(ValidationError, match="route prefix"):
        AppRoute(name="a", router_route_prefix="router path")
    with pytest.raises(ValidationError, match="longer than"):
        HAProxySettings(workdir=tmp_path / ("d" * 120), app=AppRoute(name="a"))
    with pytest.raises(ValidationError):
        HAProxySettings(workdir=tmp_path, app=AppRoute(name="a"), port=9000, prometheus_port=9000)


@pytest.mark.parametrize(
    "app",
    [
        AppRoute(name="llm"),
        AppRoute(name="llm", fail_open=True),
        AppRoute(name="llm", forward_body=True, body_buffer_bytes=8 * 1024 * 1024, session_header="x-conv"),
    ],
)
def test_haproxy_accepts_the_rendered_config(tmp_path: Path, app: AppRoute) -> None:
    s = HAProxySettings(workdir=tmp_path, app=app, port=18000, prometheus_port=18404, replica_slots=5)
    write_files(s)
    assert "Configuration file is valid" in check_config(s)
    assert s.map_path.read_text() == ""


def test_binary_search_names_what_it_tried(tmp_path: Path) -> None:
    with pytest.raises(HAProxyNotFoundError, match="not an executable file"):
        find_haproxy_binary(tmp_path / "nope")
    old = tmp_path / "haproxy"
    old.write_text("#!/bin/sh\necho 'HAProxy version 2.4.22-1 2023/02/14'\n")
    old.chmod(old.stat().st_mode | stat.S_IXUSR)
    with pytest.raises(HAProxyNotFoundError, match=r"2\.4\.22 < 2\.6"):
        find_haproxy_binary(old)
    assert find_haproxy_binary().is_file()


# The syncer's slot bookkeeping against an in-memory runtime API.
class FakeRuntime:
    def __init__(self, s: HAProxySettings) -> None:
        self.servers = {
            (backend, f"{prefix}{i}"): {"addr": "127.0.0.1:1", "state": "maint", "scur": 0}
            for backend, prefix, n in ((REPLICA_BACKEND, "replica", s.replica_slots), (ROUTER_BACKEND, "router", 2))
            for i in range(1, n + 1)
        }
        self.map: dict[str, str] = {}
        self.commands: list[str] = []

    def show_stat(self) -> dict[tuple[str, str], ServerStat]:
        status = {"ready": "UP", "drain": "DRAIN", "maint": "MAINT"}
        return {
            key: ServerStat(key[0], key[1], status[v["state"]], v["scur"], v["addr"]) for key, v in self.servers.items()
        }

    def show_map(self, map_path: Path) -> dict[str, str]:
        return dict(self.map)

    def set_server_addr(self, backend: str, server: str, host: str, port: int) -> None:
        self.servers[(backend, server)]["addr"] = f"{host}:{port}"

    def set_server_state(self, backend: str, server: str, state: str) -> None:
        self.commands.append(f"{server} {state}")
        self.servers[(backend, server)]["state"] = state

    def add_map(self, map_path: Path, key: str, value: str) -> None:
        self.map[key] = value

    def del_map(self, map_path: Path, key: str, missing_ok: bool = True) -> None:
        self.map.pop(key, None)


def endpoint(replica_id: str, port: int) -> ReplicaEndpoint:
    return ReplicaEndpoint(replica_id=replica_id, deployment="d", host="127.0.0.1", port=port)


def test_syncer_never_reuses_a_draining_slot(tmp_path: Path) -> None:
    s = HAProxySettings(workdir=tmp_path, app=AppRoute(name="llm"), replica_slots=2, router_slots=2)
    runtime = FakeRuntime(s)
    live = [endpoint("a", 1001), endpoint("b", 1002)]
    now = [0.0]
    syncer = HAProxySyncer(
        runtime, s, lambda: _value(list(live)), lambda: _value([]), drain_grace_s=30, clock=lambda: now[0]
    )

    def sync() -> object:
        return asyncio.run(syncer.sync_once())

    sync()
    assert runtime.map == {"a": "replica1", "b": "replica2"}
    assert runtime.servers[(REPLICA_BACKEND, "replica1")]["addr"] == "127.0.0.1:1001"
    # `a` leaves while it still streams; `c` arrives: no slot is free, `a`'s draining slot is not reused.
    runtime.servers[(REPLICA_BACKEND, "replica1")]["scur"] = 3
    live[:] = [endpoint("b", 1002), endpoint("c", 1003)]
    now[0] = 1.0
    report = sync()
    assert report.drained == [("a", "replica1")] and report.no_slot == ["c"]
    assert runtime.map == {"b": "replica2"}
    assert runtime.servers[(REPLICA_BACKEND, "replica1")]["state"] == "drain"
    now[0] = 2.0
    assert sync().no_slot == ["c"]
    # Its streams end: maintenance, then the slot is free again and `c` gets it.
    runtime.servers[(REPLICA_BACKEND, "replica1")]["scur"] = 0
    now[0] = 3.0
    report = sync()
    assert report.freed == ["replica1"] and report.added == [("c", "replica1")]
    assert runtime.commands[-2:] == ["replica1 maint", "replica1 ready"]
    assert runtime.map == {"b": "replica2", "c": "replica1"}
    assert runtime.servers[(REPLICA_BACKEND, "replica1")]["addr"] == "127.0.0.1:1003"


def test_syncer_drain_grace_and_moved_replica(tmp_path: Path) -> None:
    s = HAProxySettings(workdir=tmp_path, app=AppRoute(name="llm"), replica_slots=3, router_slots=2)
    runtime = FakeRuntime(s)
    live = [endpoint("a", 1001)]
    routers = [endpoint("r", 2001)]
    now = [0.0]
    syncer = HAProxySyncer(
        runtime, s, lambda: _value(list(live)), lambda: _value(list(routers)), drain_grace_s=5, clock=lambda: now[0]
    )
    asyncio.run(syncer.sync_once())
    assert runtime.servers[(ROUTER_BACKEND, "router1")] == {"addr": "127.0.0.1:2001", "state": "ready", "scur": 0}
    # Same id on a new port (a replaced replica): a new slot; the old one drains, stuck sessions or not.
    runtime.servers[(REPLICA_BACKEND, "replica1")]["scur"] = 1
    live[:] = [endpoint("a", 1009)]
    now[0] = 1.0
    report = asyncio.run(syncer.sync_once())
    assert report.drained == [("a", "replica1")] and report.added == [("a", "replica2")]
    assert runtime.map == {"a": "replica2"}
    now[0] = 5.5
    assert asyncio.run(syncer.sync_once()).freed == []
    now[0] = 6.0
    assert asyncio.run(syncer.sync_once()).freed == ["replica1"]
    # A fresh syncer (e.g. after a restart) adopts what it finds instead of starting over.
    again = HAProxySyncer(runtime, s, lambda: _value(list(live)), lambda: _value(list(routers)), clock=lambda: 7.0)
    report = asyncio.run(again.sync_once())
    assert not report.changed
    assert again.replicas.slot_of("a") == "replica2" and again.routers.slot_of("r") == "router1"


async def _value(value: list[ReplicaEndpoint]) -> list[ReplicaEndpoint]:
    return value
