"""The rendered HAProxy config and Lua action; `haproxy -c` on them; the syncer's server bookkeeping (fake runtime)."""

from __future__ import annotations

import inspect
import re
import stat
from pathlib import Path

import pytest
from pydantic import ValidationError

from base import agent_wire, contracts
from infra.api_keys import ApiKeySource, key_digest, key_hash_line
from infra.haproxy import haproxy_cfg as haproxy_config
from infra.haproxy import protection as frontend_protection
from infra.haproxy.apps import AppRoute
from infra.haproxy.config import (
    RETRY_SERVERS,
    HAProxySettings,
)
from infra.haproxy.formatting import haproxy_time
from infra.haproxy.haproxy_cfg import render_config
from infra.haproxy.lua import LUA_TEMPLATE, render_lua
from infra.haproxy.process import (
    MALLOC_TUNABLES,
    HAProxyNotFoundError,
    check_config,
    find_haproxy_binary,
    haproxy_environment,
    write_files,
)
from infra.haproxy.protection import ClientLimits, FrontendProtection
from infra.haproxy.servers import replica_server_options
from infra.haproxy.spoe import VAR_ASK_AGENT, agent_backend, render_spoe
from infra.haproxy.tls import FrontendTLS
from infra.tls_certs import throwaway_certificate


def settings(tmp_path: Path, **app: object) -> HAProxySettings:
    return HAProxySettings(workdir=tmp_path, apps=[AppRoute(name="llm", **app)], port=18000, prometheus_port=18404)


# Constants the data plane must carry, and where each must appear. Router-side reasons (`no_replica`
# and the like) are passed through from the router's reply, so they appear nowhere here.
CONFIG_CONSTANTS = {
    "REQUEST_ID_HEADER": contracts.REQUEST_ID_HEADER,
    "SERVE_REASON_HEADER": contracts.SERVE_REASON_HEADER,
    "SERVE_FALLBACK_HEADER": contracts.SERVE_FALLBACK_HEADER,
    "FALLBACK_RANK_HEADER": contracts.FALLBACK_RANK_HEADER,
    "SERVE_PATH_HEADER": contracts.SERVE_PATH_HEADER,
    "DIRECT_PATH": contracts.DIRECT_PATH,
    "HEALTH_PATH": contracts.HEALTH_PATH,
    "REASON_REPLICA_ERROR": contracts.REASON_REPLICA_ERROR,
    **{f"HAPROXY_ERROR_REASONS[{code}]": reason for code, reason in contracts.HAPROXY_ERROR_REASONS.items()},
}
LUA_CONSTANTS = {
    "REQUEST_ID_HEADER": contracts.REQUEST_ID_HEADER,
    "SESSION_HEADER_DEFAULT": contracts.SESSION_HEADER_DEFAULT,
    "CAPACITY_TOKEN_HEADER": contracts.CAPACITY_TOKEN_HEADER,
    "BODY_TRUNCATED_HEADER": contracts.BODY_TRUNCATED_HEADER,
    "BODY_TOTAL_UNKNOWN": contracts.BODY_TOTAL_UNKNOWN,
    "APP_HEADER": contracts.APP_HEADER,
    "FRONTEND_HEADER": contracts.FRONTEND_HEADER,
    "RANKED_HEADER": contracts.RANKED_HEADER,
    "PREFILL_REPLICA_HEADER": contracts.PREFILL_REPLICA_HEADER,
    "PREFILL_URL_HEADER": contracts.PREFILL_URL_HEADER,
    "DATA_PARALLEL_RANK_HEADER": contracts.DATA_PARALLEL_RANK_HEADER,
    "TRACEPARENT_HEADER": contracts.TRACEPARENT_HEADER,
    "ROUTE_PATH": contracts.ROUTE_PATH,
    "REASON_REPLICA_UNAVAILABLE": contracts.REASON_REPLICA_UNAVAILABLE,
    **{f"FAIL_CLOSED_REASONS[{i}]": reason for i, reason in enumerate(contracts.FAIL_CLOSED_REASONS)},
    **{f"FALLBACK_REASONS[{i}]": reason for i, reason in enumerate(contracts.FALLBACK_REASONS)},
}


# Rendered only when the stack turns API keys and client limits on.
PROTECTION_CONSTANTS = {
    "AUTHORIZATION_HEADER": contracts.AUTHORIZATION_HEADER,
    "RETRY_AFTER_HEADER": contracts.RETRY_AFTER_HEADER,
    **{f"PROTECTION_REASONS[{code}]": reason for code, reason in contracts.PROTECTION_REASONS.items()},
}


def protected_settings(tmp_path: Path) -> HAProxySettings:
    keys = tmp_path / "keys.txt"
    keys.write_text(key_hash_line("sk-test", "team-a") + "\n")
    protection = FrontendProtection(
        api_keys=ApiKeySource(file=keys),
        client_limits=ClientLimits(max_concurrent_requests=4, max_requests_per_window=50),
    )
    # TLS with a plain port kept: the refusal of keys in clear is rendered too.
    certs = throwaway_certificate(tmp_path / "tls")
    tls = FrontendTLS(cert_file=certs.cert, key_file=certs.key, plain_port=18080)
    return HAProxySettings(
        workdir=tmp_path / "w",
        apps=[AppRoute(name="llm")],
        port=18000,
        prometheus_port=18404,
        protection=protection,
        tls=tls,
    )


def test_protection_constants_come_from_contracts(tmp_path: Path) -> None:
    config = render_config(protected_settings(tmp_path))
    for name, value in PROTECTION_CONSTANTS.items():
        assert value in config, name


def test_every_header_constant_is_rendered_or_stripped() -> None:
    header_names = {name: value for name, value in vars(contracts).items() if re.search(r"_HEADER(_DEFAULT)?$", name)}
    assert header_names, "contracts lost its header constants?"
    covered = set(CONFIG_CONSTANTS) | set(LUA_CONSTANTS) | set(PROTECTION_CONSTANTS)
    for name, value in header_names.items():
        if name not in covered:
            # Response-only headers of the replica (x-serve-replica): covered by the stripped prefixes.
            assert value.startswith(contracts.INTERNAL_HEADER_PREFIXES), name


@pytest.mark.parametrize("fail_open", [False, True])
def test_constants_come_from_contracts(tmp_path: Path, fail_open: bool) -> None:
    s = settings(tmp_path, fail_open=fail_open)
    config, lua = render_config(s), render_lua(s)
    for value in CONFIG_CONSTANTS.values():
        assert value in config, value
    # The fallback header is rendered for every frontend; the action serves a failed route only for a fail-open app.
    assert f"fail_open = {'true' if fail_open else 'false'}" in lua
    for name, value in LUA_CONSTANTS.items():
        assert f'"{value}"' in lua, name
    for prefix in contracts.INTERNAL_HEADER_PREFIXES:
        assert f"http-request del-header {prefix} -m beg" in config
    # vLLM's engine-rank header is the router's to set, never a client's.
    assert f"http-request del-header {contracts.DATA_PARALLEL_RANK_HEADER}\n" in config
    assert f"local ROUTE_TIMEOUT_S = {float(contracts.ROUTE_TIMEOUT_S_DEFAULT)!r}" in lua
    assert f"bind 127.0.0.1:{contracts.HAPROXY_PORT_DEFAULT}" in render_config(
        HAProxySettings(workdir=tmp_path, apps=[AppRoute(name="x")])
    )


def test_nothing_of_the_contract_is_written_by_hand() -> None:
    """The Lua template and the config renderer carry no literal header/reason/path: only placeholders."""
    template = re.sub(r"\$\w+", "", LUA_TEMPLATE.template)  # placeholder names may spell a constant's name
    renderers = [
        haproxy_config.render_config,
        frontend_protection.protection_lines,
        frontend_protection.protection_tables,
        frontend_protection._refusal,
    ]
    sources = template + "".join(inspect.getsource(renderer) for renderer in renderers)
    literals = [
        contracts.REQUEST_ID_HEADER,
        contracts.SESSION_HEADER_DEFAULT,
        contracts.CAPACITY_TOKEN_HEADER,
        contracts.BODY_TRUNCATED_HEADER,
        contracts.SERVE_REASON_HEADER,
        contracts.SERVE_FALLBACK_HEADER,
        contracts.FALLBACK_RANK_HEADER,
        contracts.FRONTEND_HEADER,
        contracts.RANKED_HEADER,
        contracts.APP_HEADER,
        contracts.HEALTH_PATH,
        contracts.AUTHORIZATION_HEADER,
        contracts.RETRY_AFTER_HEADER,
        # Plain words, so only as string literals.
        *(f'"{reason}"' for reason in contracts.FALLBACK_REASONS),
        *contracts.INTERNAL_HEADER_PREFIXES,
    ]
    for literal in literals:
        assert literal not in sources, literal
    # Reasons as whole words (a reason may be part of a setting's name, e.g. `request_timeout_s`).
    reasons = [
        *contracts.FAIL_CLOSED_REASONS,
        *contracts.HAPROXY_ERROR_REASONS.values(),
        contracts.REASON_REPLICA_ERROR,
        *contracts.PROTECTION_REASONS.values(),
    ]
    for reason in reasons:
        assert not re.search(rf"\b{reason}\b", sources), reason
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
        "http-request lua.sluice_route",
        "balance roundrobin",
        "option redispatch 1",
        "retries 1",
        "use-server %[var(txn.sluice_server)] if { var(txn.sluice_server) -m found }",
        f"bind unix@{tmp_path.resolve()}/retry.sock mode 600",
        "http-request lua.sluice_retry",
        "option httpchk GET /-/healthz",
        "http-check expect status 200",
        "http-request use-service lua.sluice_metrics if { path /sluice/metrics }",
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
    # The whole body is waited for before the route action, and the buffer holds the largest one allowed.
    assert config.index("http-request wait-for-body time 10s") < config.index("lua.sluice_route")
    assert "timeout http-request 10s" in config
    bufsize = int(re.search(r"tune\.bufsize (\d+)", config)[1])
    maxrewrite = int(re.search(r"tune\.maxrewrite (\d+)", config)[1])
    assert bufsize - maxrewrite > contracts.MAX_BODY_BYTES_DEFAULT + contracts.MAX_HEADER_BYTES_DEFAULT


def test_a_failed_route_gets_503_unless_a_fail_open_app_pinned_a_replica_anyway(tmp_path: Path) -> None:
    config = render_config(settings(tmp_path, fail_open=True))
    public = config[config.index("frontend sluice_http") : config.index("frontend sluice_retry")].splitlines()
    (fail_closed,) = [line for line in public if "return status 503" in line]
    assert fail_closed.endswith("{ var(txn.sluice_reason) -m found } !{ var(txn.sluice_server) -m found }")
    (fallback,) = [line for line in public if "set-header x-serve-fallback %[var(txn.sluice_reason)]" in line]
    assert fallback.endswith("{ var(txn.sluice_reason) -m found } { var(txn.sluice_server) -m found }")


def test_body_forwarding_sends_the_buffered_prefix(tmp_path: Path) -> None:
    lua = render_lua(settings(tmp_path, forward_body=True, body_buffer_bytes=100_000))
    assert "forward_body = true" in lua and "body_buffer_bytes = 100000" in lua
    assert "forward_body = false" in render_lua(settings(tmp_path))
    with pytest.raises(ValidationError, match="may not exceed protection.max_body_bytes"):
        HAProxySettings(
            workdir=tmp_path,
            apps=[AppRoute(name="llm", forward_body=True, body_buffer_bytes=100_000)],
            protection=FrontendProtection(max_body_bytes=50_000),
        )


def test_custom_session_header_and_timeout(tmp_path: Path) -> None:
    app = AppRoute(name="chat", session_header="X-Conversation", router_route_prefix="/router/")
    s = HAProxySettings(workdir=tmp_path, apps=[app], route_timeout_s=1.5)
    lua = render_lua(s)
    assert f'route_path = "/router{contracts.ROUTE_PATH}"' in lua
    assert f'route_path = "{contracts.ROUTE_PATH}"' in render_lua(settings(tmp_path))
    assert 'session_header = "x-conversation"' in lua
    assert '{name = "chat", ' in lua
    assert "local ROUTE_TIMEOUT_S = 1.5" in lua


def test_only_the_retry_servers_take_load_balanced_traffic(tmp_path: Path) -> None:
    s = settings(tmp_path)
    config = render_config(s)
    servers = re.findall(r"^    server (\S+) (\S+)", config, re.M)
    assert servers == [(name, f"unix@{s.retry_socket_path}") for name in RETRY_SERVERS]
    options = replica_server_options(s)
    assert options[:2] == ["weight", "0"]
    for piece in ("observe layer4", "on-error mark-down", "error-limit 1", "inter 5s", "fall 2", "rise 2"):
        assert piece in " ".join(options), piece
    # Every HAProxy-made 5xx carries its reason and an OpenAI-style body.
    for code, reason in contracts.HAPROXY_ERROR_REASONS.items():
        line = next(li for li in config.splitlines() if li.startswith(f"    http-error status {code} "))
        assert f"hdr x-serve-reason {reason}" in line and f'"code": {code}' in line
    lua = render_lua(s)
    assert f'local FRONTEND_ID = "{s.frontend_id}"' in lua and s.frontend_id == "127.0.0.1:18000"


def test_settings_refuse_bad_values(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="internal prefix"):
        AppRoute(name="a", session_header="x-sluice-session")
    with pytest.raises(ValidationError):
        AppRoute(name="a b")
    with pytest.raises(ValidationError, match="route prefix"):
        AppRoute(name="a", router_route_prefix="router path")
    with pytest.raises(ValidationError, match="longer than"):
        HAProxySettings(workdir=tmp_path / ("d" * 120), apps=[AppRoute(name="a")])
    with pytest.raises(ValidationError):
        HAProxySettings(workdir=tmp_path, apps=[AppRoute(name="a")], port=9000, prometheus_port=9000)


@pytest.mark.parametrize(
    "app",
    [
        AppRoute(name="llm"),
        AppRoute(name="llm", fail_open=True),
        AppRoute(name="llm", forward_body=True, body_buffer_bytes=8 * 1024 * 1024, session_header="x-conv"),
    ],
)
def test_haproxy_accepts_the_rendered_config(tmp_path: Path, app: AppRoute) -> None:
    s = HAProxySettings(workdir=tmp_path, apps=[app], port=18000, prometheus_port=18404)
    write_files(s)
    assert "Configuration file is valid" in check_config(s)


def test_haproxy_accepts_the_protected_config(tmp_path: Path) -> None:
    s = protected_settings(tmp_path)
    write_files(s)
    assert "Configuration file is valid" in check_config(s)
    assert s.keys_acl_path.read_text() == key_digest("sk-test") + "\n"


def test_binary_search_names_what_it_tried(tmp_path: Path) -> None:
    with pytest.raises(HAProxyNotFoundError, match="not an executable file"):
        find_haproxy_binary(tmp_path / "nope")
    old = tmp_path / "haproxy"
    old.write_text("#!/bin/sh\necho 'HAProxy version 2.4.22-1 2023/02/14'\n")
    old.chmod(old.stat().st_mode | stat.S_IXUSR)
    with pytest.raises(HAProxyNotFoundError, match=r"2\.4\.22 < 2\.6"):
        find_haproxy_binary(old)
    assert find_haproxy_binary().is_file()


def test_a_staging_frontend_lets_a_request_ask_for_a_short_server_timeout(tmp_path: Path) -> None:
    plain = render_config(settings(tmp_path))
    assert "set-timeout" not in plain and contracts.STAGING_TIMEOUT_HEADER not in plain
    staging = HAProxySettings(
        workdir=tmp_path,
        apps=[AppRoute(name="llm")],
        port=18000,
        prometheus_port=18404,
        staging_server_timeout_s=contracts.STAGING_SERVER_TIMEOUT_S,
    )
    config = render_config(staging)
    asked = f"if {{ req.hdr({contracts.STAGING_TIMEOUT_HEADER}) -m found }}"
    # Read before the internal headers are stripped from every client request, applied in both paths' backends.
    assert config.index(asked) < config.index("http-request del-header x-sluice-")
    cut_short = f"http-request set-timeout server {haproxy_time(contracts.STAGING_SERVER_TIMEOUT_S)} if"
    assert config.count(cut_short) == 2
    write_files(staging)
    assert "Configuration file is valid" in check_config(staging)


@pytest.mark.parametrize("tracing", [False, True])
def test_each_app_asks_its_own_route_agents_with_the_wire_from_agent_wire(tmp_path: Path, tracing: bool) -> None:
    apps = [AppRoute(name="a", model="m-a"), AppRoute(name="b", model="m-b", session_header="x-conv")]
    s = HAProxySettings(
        workdir=tmp_path, apps=apps, port=18000, prometheus_port=18404, route_timeout_s=3.0, tracing=tracing
    )
    spoe, config = render_spoe(s), render_config(s)
    # Only a tracing frontend hands the request's traceparent to the agent and reads the one it answers.
    untraced = set() if tracing else {agent_wire.TRACE_VAR}
    scopes = spoe.split("\n[")[1:]
    assert len(scopes) == 2
    for index, (scope, app) in enumerate(zip(scopes, apps, strict=True)):
        assert f"use-backend {agent_backend(index)}" in scope and "timeout processing 1500ms" in scope
        registered = re.search(r"register-var-names (.*)", scope).group(1).split()  # type: ignore[union-attr]
        assert set(registered) == {agent_wire.ERROR_VAR, *agent_wire.ANSWER_VARS} - untraced
        arguments = dict(a.split("=", 1) for a in re.search(r"args (.*)", scope).group(1).split())  # type: ignore[union-attr]
        assert set(arguments) == {*agent_wire.HEADER_ARGS, app.session_header, agent_wire.BODY_ARG} - untraced
        assert arguments[app.session_header] == f"req.fhdr({app.session_header})"
        assert f"filter spoe engine sluice_route_{index} config {s.spoe_path}" in config
        assert (
            f"send-spoe-group sluice_route_{index} {agent_wire.MESSAGE} if {{ var({VAR_ASK_AGENT}) -m int eq {index} }}"
            in config
        )
        assert f"backend {agent_backend(index)}\n" in config
    # The message is sent after the route action names the app, and the reply action reads the answer after it.
    assert config.index("lua.sluice_route\n") < config.index("send-spoe-group") < config.index("lua.sluice_route_reply")


def test_haproxys_environment_sets_the_allocator_and_lets_the_callers_tunables_win() -> None:
    assert haproxy_environment({"PATH": "/bin"}) == {"PATH": "/bin", "GLIBC_TUNABLES": MALLOC_TUNABLES}
    own = "glibc.malloc.arena_max=4"
    # glibc applies tunables in order: the caller's, after sluice's, override them.
    assert haproxy_environment({"GLIBC_TUNABLES": own})["GLIBC_TUNABLES"] == f"{MALLOC_TUNABLES}:{own}"


def test_the_internal_credential_replaces_any_clients_and_stays_private(tmp_path: Path) -> None:
    secret = "cluster-secret-token"
    s = HAProxySettings(
        workdir=tmp_path, apps=[AppRoute(name="llm")], port=18000, prometheus_port=18404, internal_credential=secret
    )
    config = render_config(s)
    set_line = f"http-request set-header {contracts.INTERNAL_CREDENTIAL_HEADER} {secret}"
    # Set once, after every client's internal header is gone (a client's `x-sluice-internal` among them).
    assert config.count(set_line) == 1
    assert config.index("http-request del-header x-sluice- -m beg") < config.index(set_line)
    assert f'"{contracts.INTERNAL_CREDENTIAL_HEADER}: {secret}"' in render_lua(s)  # the route and table calls
    assert secret not in repr(s) and secret not in s.model_dump_json()
    write_files(s)
    assert "Configuration file is valid" in check_config(s)
    for written in (s.config_path, s.lua_path):
        assert stat.S_IMODE(written.stat().st_mode) == 0o600, written
    without = render_config(settings(tmp_path))
    assert contracts.INTERNAL_CREDENTIAL_HEADER not in without


def test_an_attached_stack_passes_the_platforms_tenant_and_usage_headers_on_only_with_the_credential(
    tmp_path: Path,
) -> None:
    secret = "cluster-secret-token"
    base = {"workdir": tmp_path, "apps": [AppRoute(name="llm")], "port": 18000, "prometheus_port": 18404}
    config = render_config(HAProxySettings(**base, internal_credential=secret, attached=True))
    stripped = config.index("http-request del-header x-sluice- -m beg")
    for header in (contracts.TENANT_HEADER, contracts.USAGE_URL_HEADER):
        read = next(line for line in config.splitlines() if f"req.hdr({header}) if" in line)
        assert f"{{ req.hdr({contracts.INTERNAL_CREDENTIAL_HEADER}) -m str {secret} }}" in read
        assert config.index(read) < stripped < config.index(f"http-request set-header {header} ")
    write_files(HAProxySettings(**base, internal_credential=secret, attached=True))
    assert "Configuration file is valid" in check_config(HAProxySettings(**base, internal_credential=secret))
    # A stack with a public side of its own drops them like any client's internal header.
    assert contracts.TENANT_HEADER not in render_config(HAProxySettings(**base, internal_credential=secret))
