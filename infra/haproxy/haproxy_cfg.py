"""The whole haproxy.cfg of a frontend, rendered from `HAProxySettings` and `base.contracts` (`render_config`).

Public frontend (protection, the Lua route action, fail closed), retry frontend, per app a replica, legacy and
router backend, the counting tables, and the metrics frontend. Section by section, with the reasons:
infra/haproxy/README.md.
"""

from __future__ import annotations

from base.contracts import (
    DATA_PARALLEL_RANK_HEADER,
    DIRECT_PATH,
    FALLBACK_RANK_HEADER,
    FALLBACK_REASONS,
    INTERNAL_HEADER_PREFIXES,
    LEGACY_PATH,
    REASON_ROUTER_UNREACHABLE,
    REQUEST_ID_HEADER,
    SERVE_FALLBACK_HEADER,
    SERVE_REASON_HEADER,
    STAGING_TIMEOUT_HEADER,
    TENANT_HEADER,
    USAGE_URL_HEADER,
)
from infra.haproxy.base_settings import defaults_lines
from infra.haproxy.canary import (
    STICK_COUNTERS,
    VAR_PATH,
    duplicate_lines,
    health_check_lines,
    legacy_backend,
    legacy_backend_lines,
    log_format,
    rollback_table_lines,
    running_table_lines,
    served_path_lines,
    served_replica_line,
)
from infra.haproxy.config import (
    FALLBACK_TABLE,
    FRONTEND,
    LUA_ACTION,
    LUA_METRICS_SERVICE,
    LUA_RETRY_ACTION,
    PROMETHEUS_FRONTEND,
    PROMETHEUS_PATH,
    RETRY_FRONTEND,
    RETRY_SERVERS,
    SLUICE_METRICS_PATH,
    UNROUTED_TABLE,
    VAR_BACKEND,
    VAR_FALLBACK,
    VAR_PREFIX,
    VAR_RANK,
    VAR_REASON,
    VAR_REQUEST_ID,
    VAR_SERVER,
    VAR_STAGING_TIMEOUT,
    HAProxySettings,
    replica_backend,
    router_backend,
)
from infra.haproxy.formatting import counter_table_lines, haproxy_time, openai_error_body
from infra.haproxy.models import (
    capture_model_header_line,
    model_refusal_lines,
    models_list_line,
)
from infra.haproxy.protection import REFUSAL_TABLE, protection_lines, protection_tables
from infra.haproxy.spoe import agent_backend_lines, ask_agent_lines, failure_table_lines, filter_lines
from infra.haproxy.tables import count_lines, decision_table_lines
from infra.observability.targets import LUA_TARGETS_SERVICE, TARGETS_PATH, router_targets_backend

FALLBACK_COMMENT = "Requests served past the router's primary, by why the primary was passed over."
UNROUTED_COMMENT = "Requests failed closed with a 503, by reason: the router's own pass through, so room for any few."
UNROUTED_REASONS_ROOM = 16


def _fail_closed_lines(reason: str) -> list[str]:
    """Count the 503 by its reason, then answer it. sc0 also counts fallbacks: a request is either pinned (and may
    count a fallback) or fails closed, never both."""
    body = openai_error_body(f"sluice could not route the request: {reason}", 503)
    condition = f"{{ var({VAR_REASON}) -m found }} !{{ var({VAR_SERVER}) -m found }}"
    return [
        f"    http-request track-sc0 var({VAR_REASON}) table {UNROUTED_TABLE} if {condition}",
        f"    http-request return status 503 content-type application/json lf-string '{body}'"
        f' hdr {SERVE_REASON_HEADER} "{reason}" if {condition}',
    ]


def _count_fallback_line() -> str:
    condition = f"{{ var({VAR_FALLBACK}) -m found }}"
    return f"    http-request track-sc0 var({VAR_FALLBACK}) table {FALLBACK_TABLE} if {condition}"


def _rank_header_line() -> str:
    # Set by the frontend that pinned the fallback; the public frontend keeps the retry frontend's value.
    return (
        f"    http-after-response set-header {FALLBACK_RANK_HEADER} %[var({VAR_RANK})]"
        f" if {{ var({VAR_RANK}) -m int gt 0 }} !{{ res.hdr({FALLBACK_RANK_HEADER}) -m found }}"
    )


def _staging_timeout_lines(settings: HAProxySettings) -> list[str]:
    """A backend's server timeout for the requests that asked a staging frontend for a short one."""
    if settings.staging_server_timeout_s is None:
        return []
    return [
        f"    http-request set-timeout server {haproxy_time(settings.staging_server_timeout_s)}"
        f" if {{ var({VAR_STAGING_TIMEOUT}) -m bool }}"
    ]


def _replica_backend_lines(name: str, retry_addr: str, timeout_lines: list[str]) -> list[str]:
    return [
        f"backend {name}",
        *timeout_lines,
        "    # Replica servers have weight 0: only a pin reaches them. Load balancing (a redispatch after a refused",
        "    # connection) can only pick a retry server, which hands the request to the next ranked replica.",
        "    balance roundrobin",
        "    retries 1",
        "    option redispatch 1",
        *health_check_lines(),
        f"    use-server %[var({VAR_SERVER})] if {{ var({VAR_SERVER}) -m found }}",
        *served_path_lines(DIRECT_PATH),
        *(f"    server {server} {retry_addr}" for server in RETRY_SERVERS),
        "",
    ]


def _pinned_backend_lines() -> list[str]:
    """The pinned replica's app backend (the action names it), else the first app's."""
    return [
        f"    use_backend %[var({VAR_BACKEND})] if {{ var({VAR_BACKEND}) -m found }}",
        f"    default_backend {replica_backend(0)}",
    ]


def _platform_headers_kept(internal: tuple[str, str]) -> tuple[list[str], list[str]]:
    """A stack attached to a platform keeps the tenant and usage headers the platform sent, and only with the cluster's
    credential (the replica reports the tenant's tokens there: services/replica/middleware/usage_report.py): the
    rules that read them before the internal headers go, and the rules that set them again after."""
    credential = f"{{ req.hdr({internal[0]}) -m str {internal[1]} }}"
    read = [
        "    # The platform's tenant and usage headers (with the cluster's credential), for the replica's usage report."
    ]
    put = []
    for header in (TENANT_HEADER, USAGE_URL_HEADER):
        var = f"txn.sluice_platform_{header.removeprefix('x-sluice-')}"
        read.append(
            f"    http-request set-var({var}) req.hdr({header}) if {credential} {{ req.hdr({header}) -m found }}"
        )
        put.append(f"    http-request set-header {header} %[var({var})] if {{ var({var}) -m found }}")
    return read, put


def _public_binds(settings: HAProxySettings) -> list[str]:
    """The public frontend's listeners: its port (with TLS when the spec has it) and a kept plain-HTTP port."""
    address = f"{settings.bind_host}:{settings.port}"
    if settings.tls is None:
        return [f"    bind {address}"]
    lines = [f"    bind {address} {settings.tls.bind_options(settings.tls_pem_path)}"]
    if settings.tls.plain_port is not None:
        lines.append(f"    bind {settings.bind_host}:{settings.tls.plain_port}")
    return lines


def render_config(settings: HAProxySettings) -> str:
    """The whole haproxy.cfg for the frontend's apps."""
    reason = f"%[var({VAR_REASON})]"
    served = f"{{ var({VAR_SERVER}) -m found }}"
    retry_addr = f"unix@{settings.retry_socket_path}"
    lines = [
        "# Rendered by infra/haproxy/haproxy_cfg.py from base/contracts.py: do not edit by hand.",
        "global",
        "    master-worker",
        f"    stats socket {settings.socket_path} mode 600 level admin",
        "    stats timeout 30s",
        f"    hard-stop-after {haproxy_time(settings.hard_stop_after_s)}",
        f"    maxconn {settings.maxconn}",
        f"    lua-load-per-thread {settings.lua_path}",
        f"    tune.maxrewrite {settings.tune_maxrewrite}",
        f"    tune.stick-counters {STICK_COUNTERS}",
        f"    log unix@{settings.log_socket_path} format raw local0",
    ]
    if settings.nbthread is not None:
        lines.append(f"    nbthread {settings.nbthread}")
    lines.append(f"    tune.bufsize {settings.tune_bufsize}")
    lines += ["", *defaults_lines(settings)]
    lines += [
        "",
        f"frontend {PROMETHEUS_FRONTEND}",
        f"    bind {settings.bind_host}:{settings.prometheus_port}",
        "    no log",
        f"    http-request use-service prometheus-exporter if {{ path {PROMETHEUS_PATH} }}",
        f"    http-request use-service lua.{LUA_METRICS_SERVICE} if {{ path {SLUICE_METRICS_PATH} }}",
        f"    http-request use-service lua.{LUA_TARGETS_SERVICE} if {{ path {TARGETS_PATH} }}",
        "    http-request return status 404",
        "",
        f"frontend {FRONTEND}",
        *_public_binds(settings),
        "    unique-id-format %[uuid()]",
        "    # One line per finished request to the frontend replica (the canary guard measures both paths).",
        "    log global",
        f'    log-format "{log_format(VAR_REQUEST_ID, VAR_REASON)}"',
        "    # Route calls to each app's route agents (SPOE), sent only when the route action asks.",
        *filter_lines(settings),
    ]
    if settings.multi_model:
        lines += [
            "    # Several models: the client's model header is kept before internal headers go.",
            capture_model_header_line(),
        ]
    if settings.staging_server_timeout_s is not None:
        lines += [
            "    # Staging: a request may ask to time out soon (checks the cleanup after a replica timeout).",
            f"    http-request set-var({VAR_STAGING_TIMEOUT}) bool(true)"
            f" if {{ req.hdr({STAGING_TIMEOUT_HEADER}) -m found }}",
        ]
    internal = settings.internal_header()
    read, put = _platform_headers_kept(internal) if settings.attached and internal is not None else ([], [])
    lines += read
    lines.append("    # A client can neither pin a replica (nor an engine rank) nor forge a capacity token.")
    lines += [f"    http-request del-header {prefix} -m beg" for prefix in INTERNAL_HEADER_PREFIXES]
    lines.append(f"    http-request del-header {DATA_PARALLEL_RANK_HEADER}")
    lines += put
    if internal is not None:
        lines.append("    # Past the frontend every port asks for the cluster's credential; only HAProxy sends it.")
        lines.append(f"    http-request set-header {internal[0]} {internal[1]}")
    lines += [
        f"    http-request set-header {REQUEST_ID_HEADER} %[unique-id]"
        f" unless {{ req.hdr({REQUEST_ID_HEADER}) -m found }}",
        f"    http-request set-var({VAR_REQUEST_ID}) req.fhdr({REQUEST_ID_HEADER})",
        f"    http-after-response set-header {REQUEST_ID_HEADER} %[var({VAR_REQUEST_ID})]"
        f" if {{ var({VAR_REQUEST_ID}) -m found }}",
        *protection_lines(
            settings.protection, str(settings.keys_acl_path), settings.tls.plain_port if settings.tls else None
        ),
        *duplicate_lines(VAR_REQUEST_ID),
        served_replica_line(),
    ]
    if settings.multi_model:
        lines += ["    # Every model of this frontend.", models_list_line([app.model or "" for app in settings.apps])]
    lines += [
        "    # Any method but GET/HEAD asks its app's router pool; GET/HEAD rotate over the app's routable replicas.",
        f"    http-request lua.{LUA_ACTION}",
        *count_lines(),
        *ask_agent_lines(settings),
        *(model_refusal_lines(VAR_REASON, REFUSAL_TABLE) if settings.multi_model else []),
        "    # Backstop: a direct request with neither a replica nor a reason (Lua error) fails like an",
        "    # unreachable router.",
        f"    http-request set-var({VAR_REASON}) str({REASON_ROUTER_UNREACHABLE})"
        f" unless {served} || {{ var({VAR_REASON}) -m found }} || {{ var({VAR_PATH}) -m str {LEGACY_PATH} }}",
        _count_fallback_line(),
        "    # Fail closed: never send a routed request to a replica the router did not rank. An app that fails open",
        "    # had the action rotate over its routable replicas instead, and the response says why.",
        *_fail_closed_lines(reason),
        f"    http-after-response set-header {SERVE_FALLBACK_HEADER} {reason}"
        f" if {{ var({VAR_REASON}) -m found }} {served}",
        "    # Replicas serve vLLM's paths under their app's route prefix.",
        f"    http-request set-path %[var({VAR_PREFIX})]%[path] if {{ var({VAR_PREFIX}) -m found }}",
        _rank_header_line(),
        *_pinned_backend_lines(),
        "",
        f"frontend {RETRY_FRONTEND}",
        "    # A request whose pinned replica refused the connection: the next usable replica of its ranked list.",
        f"    bind {retry_addr} mode 600",
        f"    http-request lua.{LUA_RETRY_ACTION}",
        _count_fallback_line(),
        *_fail_closed_lines(reason),
        _rank_header_line(),
        *_pinned_backend_lines(),
        "",
    ]
    for index in range(len(settings.apps)):
        lines += _replica_backend_lines(replica_backend(index), retry_addr, _staging_timeout_lines(settings))
        lines += legacy_backend_lines(legacy_backend(index), [*_staging_timeout_lines(settings), *health_check_lines()])
        lines += [
            f"backend {router_backend(index)}",
            "    # Health-checked routers at Serve's port: the Lua action's HTTP route call when no agent is UP.",
            *health_check_lines(),
            "",
            *agent_backend_lines(index, settings),
            f"backend {router_targets_backend(index)}",
            "    # The routers' Serve addresses, where their metrics are: read by the target discovery only.",
            "",
        ]
    lines += [
        *counter_table_lines(FALLBACK_TABLE, FALLBACK_COMMENT, len(FALLBACK_REASONS)),
        *counter_table_lines(UNROUTED_TABLE, UNROUTED_COMMENT, UNROUTED_REASONS_ROOM),
        *failure_table_lines(),
        *decision_table_lines(),
        *protection_tables(settings.protection),
        *running_table_lines(),
        *rollback_table_lines(),
    ]
    return "\n".join(lines)
