"""HAProxy data plane of the direct-streaming path: the config and the Lua route action, rendered from settings.

Every header name, reason string and default comes from `sluice.contracts` or from the settings; the Lua file
is a template rendered here, so nothing of the wire contract is written twice by hand.

Shape of the rendered config:

- frontend `sluice_http` on bind_host:port: strips client-sent internal headers (`x-serve-*`, `x-sluice-*`),
  sets `x-request-id` when the client sent none (echoed on every response, HAProxy's own 503s included),
  and, for every method but GET/HEAD, runs the Lua action that asks a router for the replica.
- backend `sluice_replicas`: `server-template` slots (in maintenance with a dummy address until the syncer
  fills them through the runtime API), health-checked on `GET /-/healthz`, `balance leastconn` for GETs and
  fail-open requests, and one `use-server` rule per slot that pins a routed request to the slot the Lua action
  chose. `option persist` keeps a pinned request on its slot even if that slot went down after the Lua check:
  a routed request is never load-balanced to a replica the router did not choose.
- backend `sluice_routers`: `server-template` slots health-checked on `GET /-/healthz`; never proxied to, the
  Lua action reads the UP ones and calls them itself with `core.tcp`.
- frontend `sluice_prometheus` on 127.0.0.1:prometheus_port (`/metrics`), the runtime API on a unix socket.
"""

from __future__ import annotations

import re
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from sluice.contracts import (
    DEFAULT_BIND_HOST,
    HAPROXY_PORT_DEFAULT,
    HAPROXY_PROMETHEUS_PORT_DEFAULT,
    HEALTH_PATH,
    INTERNAL_HEADER_PREFIXES,
    REASON_ROUTER_UNREACHABLE,
    REQUEST_ID_HEADER,
    ROUTE_TIMEOUT_S_DEFAULT,
    SERVE_FALLBACK_HEADER,
    SERVE_REASON_HEADER,
    SESSION_HEADER_DEFAULT,
)
from sluice.runtime import LOOPBACK

# Names inside the rendered config (HAProxy-internal, not part of the wire contract).
FRONTEND = "sluice_http"
PROMETHEUS_FRONTEND = "sluice_prometheus"
REPLICA_BACKEND = "sluice_replicas"
ROUTER_BACKEND = "sluice_routers"
REPLICA_SLOT_PREFIX = "replica"
ROUTER_SLOT_PREFIX = "router"
LUA_ACTION = "sluice_route"
VAR_SERVER = "txn.sluice_server"
VAR_REASON = "txn.sluice_reason"
VAR_REQUEST_ID = "txn.sluice_request_id"
# A freed slot points here: nothing listens on port 1 and the slot is in maintenance anyway.
DUMMY_SERVER_ADDR = (LOOPBACK, 1)
PROMETHEUS_PATH = "/metrics"
# Defaults shared with `builders.direct_stream.DirectStreamSpec`.
BODY_BUFFER_BYTES_DEFAULT = 262144
CHECK_INTER_S_DEFAULT = 5.0
# Headroom in the request buffer for the request line and headers when the body is buffered for the router.
HEADER_HEADROOM_BYTES = 32768
# Lua patterns for values taken from the router's reply (anything else is refused, so nothing reaches a header
# or a map lookup unchecked).
LUA_REPLICA_ID_PATTERN = "^[%w%-_.:]+$"
LUA_TOKEN_PATTERN = "^[%w%-_.:~+/=]+$"
LUA_REASON_PATTERN = "^[a-z0-9_]+$"
MAX_ID_LENGTH = 256
# Unix socket paths must fit `sun_path` (108 bytes on Linux, including the NUL).
MAX_SOCKET_PATH_BYTES = 103

_HEADER_NAME = re.compile(r"^[a-z0-9][a-z0-9-]*$")
_APP_NAME = re.compile(r"^[A-Za-z0-9_.:-]+$")


class AppRoute(BaseModel):
    """How the frontend routes one app's requests through the router pool."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    # Fail-open: a request the router could not place is load-balanced normally and the response carries
    # `x-serve-fallback: <reason>`. Off by default: fail closed with a 503.
    fail_open: bool = False
    # Send the client body (up to body_buffer_bytes) to the router; needed by body-aware policies only.
    forward_body: bool = False
    body_buffer_bytes: int = Field(BODY_BUFFER_BYTES_DEFAULT, ge=1024, le=64 * 1024 * 1024)
    session_header: str = SESSION_HEADER_DEFAULT
    # Route prefix of the router deployment: the route call goes to `<prefix>/internal/route` ("" = at the root).
    router_route_prefix: str = ""

    @field_validator("router_route_prefix")
    @classmethod
    def _route_prefix(cls, value: str) -> str:
        value = value.rstrip("/")
        if value and not re.match(r"^(/[A-Za-z0-9._~-]+)+$", value):
            raise ValueError(f"router route prefix {value!r} must look like /name[/name...]")
        return value

    @field_validator("name")
    @classmethod
    def _app_name(cls, value: str) -> str:
        if not _APP_NAME.match(value):
            raise ValueError(f"app name {value!r} must match {_APP_NAME.pattern}")
        return value

    @field_validator("session_header")
    @classmethod
    def _session_header(cls, value: str) -> str:
        value = value.lower()
        if not _HEADER_NAME.match(value):
            raise ValueError(f"session header {value!r} is not a valid header name")
        if value.startswith(INTERNAL_HEADER_PREFIXES):
            raise ValueError(f"session header {value!r} uses an internal prefix: the frontend strips it")
        return value


class HAProxySettings(BaseModel):
    """Everything the rendered HAProxy config and Lua action depend on."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    workdir: Path
    app: AppRoute
    bind_host: str = DEFAULT_BIND_HOST
    port: int = Field(HAPROXY_PORT_DEFAULT, ge=1, le=65535)
    prometheus_port: int = Field(HAPROXY_PROMETHEUS_PORT_DEFAULT, ge=1, le=65535)
    replica_slots: int = Field(16, ge=1, le=4096)
    router_slots: int = Field(8, ge=1, le=256)
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
    # Time a client has to send its headers (and, with body forwarding, its buffered body).
    timeout_http_request_s: float = Field(30.0, gt=0)
    hard_stop_after_s: float = Field(120.0, gt=0)
    maxconn: int = Field(4096, ge=1)
    # None: HAProxy's default (one thread per CPU it may run on).
    nbthread: int | None = Field(None, ge=1)
    tune_maxrewrite: int = Field(8192, ge=1024)

    @field_validator("workdir")
    @classmethod
    def _absolute_workdir(cls, value: Path) -> Path:
        return value.resolve()

    @model_validator(mode="after")
    def _socket_path_fits(self) -> HAProxySettings:
        if len(str(self.socket_path).encode()) > MAX_SOCKET_PATH_BYTES:
            raise ValueError(f"runtime socket path {self.socket_path} is longer than {MAX_SOCKET_PATH_BYTES} bytes")
        if self.prometheus_port == self.port:
            raise ValueError("prometheus_port must differ from port")
        return self

    @property
    def config_path(self) -> Path:
        return self.workdir / "haproxy.cfg"

    @property
    def lua_path(self) -> Path:
        return self.workdir / "sluice_route.lua"

    @property
    def map_path(self) -> Path:
        """Runtime-updatable map: replica id -> replica slot server name."""
        return self.workdir / "replicas.map"

    @property
    def socket_path(self) -> Path:
        return self.workdir / "haproxy.sock"

    @property
    def log_path(self) -> Path:
        return self.workdir / "haproxy.log"

    @property
    def tune_bufsize(self) -> int | None:
        """Request buffer size; None keeps HAProxy's default (16 KiB) when no body is buffered."""
        if not self.app.forward_body:
            return None
        return self.app.body_buffer_bytes + self.tune_maxrewrite + HEADER_HEADROOM_BYTES


def replica_slot_names(settings: HAProxySettings) -> list[str]:
    return [f"{REPLICA_SLOT_PREFIX}{i}" for i in range(1, settings.replica_slots + 1)]


def router_slot_names(settings: HAProxySettings) -> list[str]:
    return [f"{ROUTER_SLOT_PREFIX}{i}" for i in range(1, settings.router_slots + 1)]


def _ms(seconds: float) -> str:
    """An HAProxy time: whole seconds as `Ns`, anything finer in milliseconds."""
    ms = max(1, round(seconds * 1000))
    return f"{ms // 1000}s" if ms % 1000 == 0 else f"{ms}ms"


def _error_body(message: str, code: int = 503) -> str:
    """OpenAI-style error body; `message` may hold log-format expressions but no double quote."""
    return '{"error": {"message": "' + message + '", "type": "service_unavailable", "code": ' + str(code) + "}}"


def _health_check_lines(settings: HAProxySettings) -> list[str]:
    return [
        f"    option httpchk GET {HEALTH_PATH}",
        "    http-check expect status 200",
        f"    default-server inter {_ms(settings.check_inter_s)} fastinter {_ms(settings.check_fastinter_s)}"
        f" downinter {_ms(settings.check_downinter_s)} fall {settings.check_fall} rise {settings.check_rise}",
    ]


def render_config(settings: HAProxySettings) -> str:
    """The whole haproxy.cfg for one app."""
    app = settings.app
    dummy = "{}:{}".format(*DUMMY_SERVER_ADDR)
    reason = f"%[var({VAR_REASON})]"
    lines = [
        "# Rendered by infra/haproxy_config.py from sluice/contracts.py: do not edit by hand.",
        "global",
        "    master-worker",
        f"    stats socket {settings.socket_path} mode 600 level admin",
        "    stats timeout 30s",
        f"    hard-stop-after {_ms(settings.hard_stop_after_s)}",
        f"    maxconn {settings.maxconn}",
        f"    lua-load-per-thread {settings.lua_path}",
        f"    tune.maxrewrite {settings.tune_maxrewrite}",
    ]
    if settings.nbthread is not None:
        lines.append(f"    nbthread {settings.nbthread}")
    if settings.tune_bufsize is not None:
        lines.append(f"    tune.bufsize {settings.tune_bufsize}")
    lines += [
        "",
        "defaults",
        "    mode http",
        # SSE: send each event as soon as it arrives (without it the first event came ~205 ms late).
        "    option http-no-delay",
        f"    timeout connect {_ms(settings.timeout_connect_s)}",
        f"    timeout client {_ms(settings.timeout_client_s)}",
        f"    timeout server {_ms(settings.timeout_server_s)}",
        f"    timeout http-keep-alive {_ms(settings.timeout_http_keep_alive_s)}",
        f"    timeout http-request {_ms(settings.timeout_http_request_s)}",
        # HAProxy's own errors (no server up, connect failure) in the same OpenAI-style JSON as the 503 below.
    ]
    for status, kind in ((502, "bad gateway"), (503, "no replica available"), (504, "gateway timeout")):
        body = _error_body(kind, status)
        lines.append(f"    http-error status {status} content-type application/json string '{body}'")
    lines += [
        "",
        f"frontend {PROMETHEUS_FRONTEND}",
        f"    bind {LOOPBACK}:{settings.prometheus_port}",
        "    no log",
        f"    http-request use-service prometheus-exporter if {{ path {PROMETHEUS_PATH} }}",
        "    http-request return status 404",
        "",
        f"frontend {FRONTEND}",
        f"    bind {settings.bind_host}:{settings.port}",
    ]
    if app.forward_body:
        # Wait for the body (up to the buffer) before the Lua action runs; a larger body is routed with what
        # fits and forwarded in full to the replica afterwards.
        lines.append("    option http-buffer-request")
    lines += [
        "    unique-id-format %[uuid()]",
        "    # A client can neither pin a replica nor forge a capacity token.",
    ]
    lines += [f"    http-request del-header {prefix} -m beg" for prefix in INTERNAL_HEADER_PREFIXES]
    lines += [
        f"    http-request set-header {REQUEST_ID_HEADER} %[unique-id]"
        f" unless {{ req.hdr({REQUEST_ID_HEADER}) -m found }}",
        f"    http-request set-var({VAR_REQUEST_ID}) req.fhdr({REQUEST_ID_HEADER})",
        f"    http-after-response set-header {REQUEST_ID_HEADER} %[var({VAR_REQUEST_ID})]"
        f" if {{ var({VAR_REQUEST_ID}) -m found }}",
        f"    # Every method but GET/HEAD asks the router pool ({app.name}); GETs are load-balanced (leastconn).",
        f"    http-request lua.{LUA_ACTION} unless METH_GET",
        "    # Backstop: a routed request that got neither a slot nor a reason (Lua error) fails like an unreachable"
        " router.",
        f"    http-request set-var({VAR_REASON}) str({REASON_ROUTER_UNREACHABLE}) unless METH_GET"
        f" || {{ var({VAR_SERVER}) -m found }} || {{ var({VAR_REASON}) -m found }}",
    ]
    if app.fail_open:
        lines += [
            "    # Fail open (per-app opt-in): load-balance the request and say so on the response.",
            f"    http-after-response set-header {SERVE_FALLBACK_HEADER} {reason} if {{ var({VAR_REASON}) -m found }}",
        ]
    else:
        message = f"sluice could not route the request: {reason}"
        lines += [
            "    # Fail closed: never send a routed request to a replica the router did not choose.",
            f"    http-request return status 503 content-type application/json lf-string '{_error_body(message)}'"
            f' hdr {SERVE_REASON_HEADER} "{reason}" if {{ var({VAR_REASON}) -m found }}',
        ]
    lines += [
        f"    default_backend {REPLICA_BACKEND}",
        "",
        f"backend {REPLICA_BACKEND}",
        "    balance leastconn",
        # A pinned request goes to its slot even if the slot went down after the Lua check (it then fails there
        # with HAProxy's 503) instead of being load-balanced; no redispatch to another replica either.
        "    option persist",
        "    no option redispatch",
        *_health_check_lines(settings),
    ]
    slots = replica_slot_names(settings)
    lines += [f"    use-server {slot} if {{ var({VAR_SERVER}) -m str {slot} }}" for slot in slots]
    lines += [
        f"    server-template {REPLICA_SLOT_PREFIX} 1-{settings.replica_slots} {dummy} check disabled",
        "",
        f"backend {ROUTER_BACKEND}",
        "    # Health-checked router pool; the Lua action calls the UP ones itself (never proxied to).",
        *_health_check_lines(settings),
        f"    server-template {ROUTER_SLOT_PREFIX} 1-{settings.router_slots} {dummy} check disabled",
        "",
    ]
    return "\n".join(lines)
