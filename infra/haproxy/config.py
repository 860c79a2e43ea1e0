"""HAProxy data plane of the direct-streaming path: the config and the Lua route action, rendered from settings.

Every header name, reason string and default comes from `base.contracts` or from the settings; the Lua file
is a template rendered here, so nothing of the wire contract is written twice by hand.

Shape of the rendered config:

- frontend `sluice_http` on bind_host:port: strips client-sent internal headers (`x-serve-*`, `x-sluice-*`),
  sets `x-request-id` when the client sent none (echoed on every response, HAProxy's own errors included),
  refuses what would hold or starve a replica (`infra.haproxy.protection`: timeouts, sizes, per-client limits,
  API keys) and waits for the whole body, then runs the Lua action. The action finds the request's app (the only
  one, or on a frontend with several models the app of the model it names: `infra.haproxy.models`); any method
  but GET/HEAD asks one of that app's routers for its ranked replicas and pins the request to the first of them
  the frontend can route to (`x-serve-fallback-rank: k` when that is not the primary) or fails closed with a
  reason. GET/HEAD rotate over the app's routable replicas without a router. The request then goes to its
  app's replica backend, under the app's route prefix.
- per app, a replica backend and a router backend (`replica_backend(i)`, `router_backend(i)`; the first app's
  have the plain names below):
- backend `sluice_replicas`: one server per replica, named by its replica id, added and deleted at run time
  through the runtime API (no slot limit, no reload), health-checked on `GET /-/healthz` and marked DOWN at the
  first failed connection (`observe layer4`). Replica servers have weight 0: HAProxy never load-balances to
  them, a request reaches one only when the Lua action pinned it there (`use-server`). The only servers with a
  weight are two `_retry` servers that loop back into this HAProxy: when the pinned replica refuses the
  connection, HAProxy redispatches the untouched request there (`option redispatch 1`, no turn-around pause
  since two servers are usable), and frontend `sluice_retry` pins it to the next replica of the ranked list
  (`x-sluice-ranked`) — never to a replica the router did not rank.
- backend `sluice_routers`: one server per router replica, health-checked; never proxied to, the Lua action
  reads the UP ones and calls them itself with `core.tcp`.
- per app, a legacy backend and the canary around it (`infra.haproxy.canary`): the action sends a request to the
  direct path or to the app's retained legacy ingress by the run-time direct weight, sticky per session; a request
  whose `x-request-id` is still running is refused with 409; every finished request is logged to the frontend
  replica, which measures both paths.
- every error HAProxy produces itself once a request exists (408 and every 5xx) carries `x-serve-reason` and an
  OpenAI-style JSON body (`http-error`), and a replica's own 5xx without one gets `replica_error`.
- frontend `sluice_prometheus` on bind_host:prometheus_port (the public frontend's host, so a Prometheus off the
  node can scrape it): HAProxy's exporter on `/metrics`, sluice's frontend counters (fallbacks, refusals and
  fail-closed 503s by reason, from stick tables) on `/sluice/metrics`, and the routers and replicas to scrape on
  `/sluice/targets` (Prometheus HTTP service discovery, `infra.observability.targets`); the runtime API on a unix
  socket.
"""

from __future__ import annotations

import re
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from base.contracts import (
    DATA_PARALLEL_RANK_HEADER,
    DEFAULT_BIND_HOST,
    DIRECT_PATH,
    DIRECT_WEIGHT_MAX,
    FALLBACK_RANK_HEADER,
    FALLBACK_REASONS,
    HAPROXY_ERROR_REASONS,
    HAPROXY_PORT_DEFAULT,
    HAPROXY_PROMETHEUS_PORT_DEFAULT,
    INTERNAL_HEADER_PREFIXES,
    LEGACY_PATH,
    REASON_ROUTER_UNREACHABLE,
    REQUEST_ID_HEADER,
    ROUTE_TIMEOUT_S_DEFAULT,
    SERVE_FALLBACK_HEADER,
    SERVE_REASON_HEADER,
)
from infra.haproxy.apps import BODY_BUFFER_BYTES_DEFAULT, AppRoute
from infra.haproxy.canary import (
    LOG_SOCKET,
    STICK_COUNTERS,
    VAR_PATH,
    WEIGHTS_MAP,
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
from infra.haproxy.formatting import haproxy_time, openai_error_body
from infra.haproxy.models import (
    capture_model_header_line,
    model_refusal_lines,
    models_list_line,
)
from infra.haproxy.protection import REFUSAL_TABLE, FrontendProtection, protection_lines, protection_tables
from infra.observability.targets import LUA_TARGETS_SERVICE, TARGETS_PATH, router_targets_backend

# Names inside the rendered config (HAProxy-internal, not part of the wire contract).
FRONTEND = "sluice_http"
RETRY_FRONTEND = "sluice_retry"
PROMETHEUS_FRONTEND = "sluice_prometheus"
REPLICA_BACKEND = "sluice_replicas"
ROUTER_BACKEND = "sluice_routers"
FALLBACK_TABLE = "sluice_fallbacks"
UNROUTED_TABLE = "sluice_unrouted"
LUA_ACTION = "sluice_route"
LUA_RETRY_ACTION = "sluice_retry"
LUA_METRICS_SERVICE = "sluice_metrics"
VAR_SERVER = "txn.sluice_server"
VAR_REASON = "txn.sluice_reason"
VAR_REQUEST_ID = "txn.sluice_request_id"
VAR_RANK = "txn.sluice_rank"
VAR_FALLBACK = "txn.sluice_fallback"
# The pinned replica's app: its replica backend, and the route prefix its replicas serve under.
VAR_BACKEND = "txn.sluice_backend"
VAR_PREFIX = "txn.sluice_prefix"
# Servers of sluice's own (the retry loop) start with "_"; replica and router ids may not.
RETRY_SERVERS = ("_retry1", "_retry2")
INTERNAL_SERVER_PREFIX = "_"
PROMETHEUS_PATH = "/metrics"
SLUICE_METRICS_PATH = "/sluice/metrics"
# A server name is the replica (or router) id: what HAProxy accepts in a name, starting with a letter or digit.
SERVER_NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,255}$")
# Defaults shared with `sluice.bench.stack_harness.DirectStreamSpec`.
CHECK_INTER_S_DEFAULT = 5.0
# Room in the request buffer beyond a maximal request: HAProxy's own headers and HTX's bookkeeping.
HEADER_HEADROOM_BYTES = 32768
# Lua patterns for values taken from the router's reply (anything else is refused, so nothing reaches a header
# or a map lookup unchecked).
LUA_REPLICA_ID_PATTERN = "^[%w][%w%-_.:]*$"
LUA_TOKEN_PATTERN = "^[%w%-_.:~+/=]+$"
LUA_REASON_PATTERN = "^[a-z0-9_]+$"
# An http URL: host, port, then an optional route prefix.
LUA_URL_PATTERN = "^http://[%w%-.]+:%d+[/%w%-_.]*$"
MAX_ID_LENGTH = 256
# Unix socket paths must fit `sun_path` (108 bytes on Linux, including the NUL).
MAX_SOCKET_PATH_BYTES = 103


class HAProxySettings(BaseModel):
    """Everything the rendered HAProxy config and Lua action depend on."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    workdir: Path
    # One app per model; the first also takes GET/HEAD requests that name no model. With several apps, each names
    # its model and a request's model picks its app.
    apps: list[AppRoute] = Field(min_length=1)
    # How much of a body a multi-model frontend searches for the request's `model`.
    model_lookup_bytes: int = Field(BODY_BUFFER_BYTES_DEFAULT, ge=1024, le=64 * 1024 * 1024)
    bind_host: str = DEFAULT_BIND_HOST
    port: int = Field(HAPROXY_PORT_DEFAULT, ge=1, le=65535)
    prometheus_port: int = Field(HAPROXY_PROMETHEUS_PORT_DEFAULT, ge=1, le=65535)
    route_timeout_s: float = Field(ROUTE_TIMEOUT_S_DEFAULT, gt=0, le=60)
    # Timeout of one TCP connect attempt to a router. HAProxy retries a failed connect 3 times, so a router that
    # refuses or drops connections costs about 3x this before the next router is tried (measured: 0.05 s -> +0.15 s),
    # and only until this HAProxy thread has marked it suspect or the health check has marked it down.
    route_connect_timeout_s: float = Field(0.05, gt=0, le=10)
    # Health checks (DESIGN.md §3: Ray's defaults).
    check_inter_s: float = Field(CHECK_INTER_S_DEFAULT, gt=0)
    check_fastinter_s: float = Field(0.25, gt=0)
    check_downinter_s: float = Field(0.25, gt=0)
    check_fall: int = Field(2, ge=1)
    check_rise: int = Field(2, ge=1)
    # Timeouts.
    timeout_client_s: float = Field(3600.0, gt=0)
    timeout_server_s: float = Field(3600.0, gt=0)
    timeout_connect_s: float = Field(5.0, gt=0)
    timeout_http_keep_alive_s: float = Field(90.0, gt=0)
    hard_stop_after_s: float = Field(120.0, gt=0)
    maxconn: int = Field(4096, ge=1)
    # None: HAProxy's default (one thread per CPU it may run on).
    nbthread: int | None = Field(None, ge=1)
    tune_maxrewrite: int = Field(8192, ge=1024)
    protection: FrontendProtection = FrontendProtection()
    # Share of sessions on the direct path at start (the rest go to each app's legacy backend); changed at run time.
    direct_weight: int = Field(DIRECT_WEIGHT_MAX, ge=0, le=DIRECT_WEIGHT_MAX)

    @field_validator("workdir")
    @classmethod
    def _absolute_workdir(cls, value: Path) -> Path:
        return value.resolve()

    @model_validator(mode="after")
    def _socket_path_fits(self) -> HAProxySettings:
        for path in (self.socket_path, self.retry_socket_path, self.log_socket_path):
            if len(str(path).encode()) > MAX_SOCKET_PATH_BYTES:
                raise ValueError(f"unix socket path {path} is longer than {MAX_SOCKET_PATH_BYTES} bytes")
        if self.prometheus_port == self.port:
            raise ValueError("prometheus_port must differ from port")
        for app in self.apps:
            if app.forward_body and app.body_buffer_bytes > self.protection.max_body_bytes:
                raise ValueError(
                    f"{app.name}: body_buffer_bytes (forwarded to the router) may not exceed protection.max_body_bytes"
                )
        names = [app.name for app in self.apps]
        if len(set(names)) != len(names):
            raise ValueError(f"app names must be distinct: {names}")
        if self.multi_model:
            models = [app.model for app in self.apps]
            if None in models or len(set(models)) != len(models):
                raise ValueError(f"with several apps each names a distinct model: {models}")
        return self

    @property
    def multi_model(self) -> bool:
        """Whether a request's model picks its app (more than one app)."""
        return len(self.apps) > 1

    @property
    def app(self) -> AppRoute:
        """The first app: the only one of a single-model frontend."""
        return self.apps[0]

    @property
    def config_path(self) -> Path:
        return self.workdir / "haproxy.cfg"

    @property
    def lua_path(self) -> Path:
        return self.workdir / "sluice_route.lua"

    @property
    def retry_socket_path(self) -> Path:
        """Where frontend `sluice_retry` listens for the requests whose pinned replica refused the connection."""
        return self.workdir / "retry.sock"

    @property
    def weights_map_path(self) -> Path:
        """Each app's direct weight (`infra.haproxy.canary`), read at start and changed at run time."""
        return self.workdir / WEIGHTS_MAP

    @property
    def log_socket_path(self) -> Path:
        """Where the frontend replica reads HAProxy's request log."""
        return self.workdir / LOG_SOCKET

    @property
    def frontend_id(self) -> str:
        """This frontend's name in route calls and membership publications."""
        return f"{self.bind_host}:{self.port}"

    @property
    def socket_path(self) -> Path:
        return self.workdir / "haproxy.sock"

    @property
    def log_path(self) -> Path:
        return self.workdir / "haproxy.log"

    @property
    def keys_acl_path(self) -> Path:
        """The accepted API key digests, as HAProxy's pattern file (written at start, replaced at run time)."""
        return self.workdir / "api_keys.acl"

    @property
    def tune_bufsize(self) -> int:
        """Request buffer size: a whole request up to the protection's maxima, plus HAProxy's rewrite reserve."""
        return self.protection.request_bytes() + self.tune_maxrewrite + HEADER_HEADROOM_BYTES


def replica_backend(index: int) -> str:
    """The replica backend of app `index` (the first app's keeps the plain name)."""
    return REPLICA_BACKEND if index == 0 else f"{REPLICA_BACKEND}_{index}"


def router_backend(index: int) -> str:
    return ROUTER_BACKEND if index == 0 else f"{ROUTER_BACKEND}_{index}"


def is_internal_server(name: str) -> bool:
    return name.startswith(INTERNAL_SERVER_PREFIX)


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


def _replica_backend_lines(name: str, retry_addr: str) -> list[str]:
    return [
        f"backend {name}",
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


def render_config(settings: HAProxySettings) -> str:
    """The whole haproxy.cfg for the frontend's apps."""
    reason = f"%[var({VAR_REASON})]"
    served = f"{{ var({VAR_SERVER}) -m found }}"
    retry_addr = f"unix@{settings.retry_socket_path}"
    lines = [
        "# Rendered by infra/haproxy/config.py from base/contracts.py: do not edit by hand.",
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
    lines += [
        "",
        "defaults",
        "    mode http",
        # SSE: send each event as soon as it arrives (without it the first event came ~205 ms late).
        "    option http-no-delay",
        f"    timeout connect {haproxy_time(settings.timeout_connect_s)}",
        f"    timeout client {haproxy_time(settings.timeout_client_s)}",
        f"    timeout server {haproxy_time(settings.timeout_server_s)}",
        f"    timeout http-keep-alive {haproxy_time(settings.timeout_http_keep_alive_s)}",
        f"    timeout http-request {haproxy_time(settings.protection.request_timeout_s)}",
        "    # HAProxy's own errors in the contract's shape: a reason header and an OpenAI-style JSON body.",
    ]
    for status, status_reason in HAPROXY_ERROR_REASONS.items():
        body = openai_error_body(f"sluice: {status_reason}", status)
        lines.append(
            f"    http-error status {status} content-type application/json"
            f" hdr {SERVE_REASON_HEADER} {status_reason} string '{body}'"
        )
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
        f"    bind {settings.bind_host}:{settings.port}",
        "    unique-id-format %[uuid()]",
        "    # One line per finished request to the frontend replica (the canary guard measures both paths).",
        "    log global",
        f'    log-format "{log_format(VAR_REQUEST_ID, VAR_REASON)}"',
    ]
    if settings.multi_model:
        lines += [
            "    # Several models: the client's model header is kept before internal headers go.",
            capture_model_header_line(),
        ]
    lines.append("    # A client can neither pin a replica (nor an engine rank) nor forge a capacity token.")
    lines += [f"    http-request del-header {prefix} -m beg" for prefix in INTERNAL_HEADER_PREFIXES]
    lines.append(f"    http-request del-header {DATA_PARALLEL_RANK_HEADER}")
    lines += [
        f"    http-request set-header {REQUEST_ID_HEADER} %[unique-id]"
        f" unless {{ req.hdr({REQUEST_ID_HEADER}) -m found }}",
        f"    http-request set-var({VAR_REQUEST_ID}) req.fhdr({REQUEST_ID_HEADER})",
        f"    http-after-response set-header {REQUEST_ID_HEADER} %[var({VAR_REQUEST_ID})]"
        f" if {{ var({VAR_REQUEST_ID}) -m found }}",
        *protection_lines(settings.protection, str(settings.keys_acl_path)),
        *duplicate_lines(VAR_REQUEST_ID),
        served_replica_line(),
    ]
    if settings.multi_model:
        lines += ["    # Every model of this frontend.", models_list_line([app.model or "" for app in settings.apps])]
    lines += [
        "    # Any method but GET/HEAD asks its app's router pool; GET/HEAD rotate over the app's routable replicas.",
        f"    http-request lua.{LUA_ACTION}",
        *(model_refusal_lines(VAR_REASON, REFUSAL_TABLE) if settings.multi_model else []),
        "    # Backstop: a direct request with neither a replica nor a reason (Lua error) fails like an unreachable",
        "    # router.",
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
        lines += _replica_backend_lines(replica_backend(index), retry_addr)
        lines += legacy_backend_lines(legacy_backend(index), health_check_lines())
        lines += [
            f"backend {router_backend(index)}",
            "    # Health-checked router pool; the Lua action calls the UP ones itself (never proxied to).",
            *health_check_lines(),
            "",
            f"backend {router_targets_backend(index)}",
            "    # The routers' Serve addresses, where their metrics are: read by the target discovery only.",
            "",
        ]
    lines += [
        f"backend {FALLBACK_TABLE}",
        "    # Requests served past the router's primary, by why the primary was passed over.",
        f"    stick-table type string len 32 size {len(FALLBACK_REASONS) * 4} store http_req_cnt",
        "",
        f"backend {UNROUTED_TABLE}",
        "    # Requests failed closed with a 503, by reason: the router's own pass through, so room for any few.",
        "    stick-table type string len 32 size 64 store http_req_cnt",
        "",
        *protection_tables(settings.protection),
        *running_table_lines(),
        *rollback_table_lines(),
    ]
    return "\n".join(lines)
