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
from string import Template

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from sluice.contracts import (
    APP_HEADER,
    BODY_TRUNCATED_HEADER,
    CAPACITY_TOKEN_HEADER,
    DEFAULT_BIND_HOST,
    HAPROXY_PORT_DEFAULT,
    HEALTH_PATH,
    INTERNAL_HEADER_PREFIXES,
    REASON_ROUTER_NON_200,
    REASON_ROUTER_UNREACHABLE,
    REASON_UNKNOWN_REPLICA_ID,
    REASON_UNPARSEABLE_REPLICA_ID,
    REQUEST_ID_HEADER,
    ROUTE_PATH,
    ROUTE_TIMEOUT_S_DEFAULT,
    SERVE_FALLBACK_HEADER,
    SERVE_REASON_HEADER,
    SESSION_HEADER_DEFAULT,
)

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
VAR_REPLICA_ID = "txn.sluice_replica_id"
VAR_REQUEST_ID = "txn.sluice_request_id"
# A freed slot points here: nothing listens on port 1 and the slot is in maintenance anyway.
DUMMY_SERVER_ADDR = ("127.0.0.1", 1)
PROMETHEUS_PATH = "/metrics"
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
    body_buffer_bytes: int = Field(262144, ge=1024, le=64 * 1024 * 1024)
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
    prometheus_port: int = Field(8404, ge=1, le=65535)
    replica_slots: int = Field(16, ge=1, le=4096)
    router_slots: int = Field(8, ge=1, le=256)
    route_timeout_s: float = Field(ROUTE_TIMEOUT_S_DEFAULT, gt=0, le=60)
    # Timeout of one TCP connect attempt to a router. HAProxy retries a failed connect 3 times, so a router that
    # refuses or drops connections costs about 3x this before the next router is tried (measured: 0.05 s -> +0.15 s),
    # and only until this HAProxy thread has marked it suspect or the health check has marked it down.
    route_connect_timeout_s: float = Field(0.05, gt=0, le=10)
    # Health checks (DESIGN.md §3: Ray's defaults).
    check_inter_s: float = Field(5.0, gt=0)
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
        f"    bind {DEFAULT_BIND_HOST}:{settings.prometheus_port}",
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


def _lua_str(value: str) -> str:
    """A Lua string literal (only printable ASCII is accepted, so no escape beyond quote and backslash)."""
    if not value.isascii() or not value.isprintable():
        raise ValueError(f"refusing non-printable or non-ASCII value in the Lua template: {value!r}")
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _lua_list(values: list[str]) -> str:
    return "{" + ", ".join(_lua_str(v) for v in values) + "}"


LUA_TEMPLATE = Template(
    r"""-- sluice route action. Rendered by infra/haproxy_config.py from sluice/contracts.py: do not edit by hand.
--
-- For a routed request (any method but GET/HEAD) ask one UP router `POST $route_path` over core.tcp
-- (HTTP/1.0, Connection: close), then either set $var_server to the replica slot the router chose
-- (the backend's use-server rules pin the ORIGINAL request there) or set $var_reason to why not
-- (the frontend then fails closed with a 503, or fails open when the app opted in).

local ROUTE_TIMEOUT_S = $route_timeout_s
local ROUTE_CONNECT_TIMEOUT_S = $route_connect_timeout_s
local SUSPECT_S = $suspect_s
local ROUTE_PATH = $route_path_lua
local APP_NAME = $app_name
local APP_HEADER = $app_header
local SESSION_HEADER = $session_header
local REQUEST_ID_HEADER = $request_id_header
local BODY_TRUNCATED_HEADER = $body_truncated_header
local CAPACITY_TOKEN_HEADER = $capacity_token_header
local FORWARD_BODY = $forward_body
local BODY_BUFFER_BYTES = $body_buffer_bytes
local ROUTER_BACKEND = $router_backend
local ROUTER_SLOTS = $router_slots
local REPLICA_BACKEND = $replica_backend
local MAP_PATH = $map_path
local VAR_SERVER = $var_server_lua
local VAR_REASON = $var_reason_lua
local VAR_REPLICA_ID = $var_replica_id
local REASON_ROUTER_UNREACHABLE = $reason_router_unreachable
local REASON_ROUTER_NON_200 = $reason_router_non_200
local REASON_UNPARSEABLE_REPLICA_ID = $reason_unparseable_replica_id
local REASON_UNKNOWN_REPLICA_ID = $reason_unknown_replica_id
local REPLICA_ID_PATTERN = $replica_id_pattern
local TOKEN_PATTERN = $token_pattern
local REASON_PATTERN = $reason_pattern
local MAX_ID_LENGTH = $max_id_length

-- Replica id -> slot name; the syncer edits it through the runtime API (`add map` / `del map`).
local replica_map = Map.new(MAP_PATH, Map._str)
-- Round-robin cursor over the UP routers, and routers that refused a connection lately (addr -> until):
-- one of each per thread (lua-load-per-thread), no locking needed.
local cursor = 0
local suspect_until = {}

local function now_s()
    local t = core.now()
    return t.sec + t.usec / 1000000
end

-- A slot is usable when its health is UP and it is not draining (a draining slot takes no new request).
local function usable(txn, backend_name, slot)
    local backend = core.backends[backend_name]
    local server = backend and backend.servers[slot]
    if server == nil or server:is_draining() then
        return nil
    end
    -- Sample fetches hand booleans to Lua as integers (0 is true in Lua): compare explicitly.
    local up = txn.f:srv_is_up(backend_name .. "/" .. slot)
    if up ~= 1 and up ~= true then
        return nil
    end
    return server
end

-- The UP routers, those that refused a connection lately (this thread saw it; HAProxy's health check has
-- not marked them down yet) last.
local function up_routers(txn)
    local healthy, suspect = {}, {}
    local now = now_s()
    for _, slot in ipairs(ROUTER_SLOTS) do
        local server = usable(txn, ROUTER_BACKEND, slot)
        if server then
            local addr = server:get_addr()
            local host, port = addr:match("^(.+):(%d+)$$")
            if host then
                local router = {addr = addr, host = host, port = tonumber(port)}
                if (suspect_until[addr] or 0) > now then
                    suspect[#suspect + 1] = router
                else
                    healthy[#healthy + 1] = router
                end
            end
        end
    end
    return healthy, suspect
end

-- The route call without its request line and Host header (those depend on the router tried).
local function build_route_request(txn)
    local body = ""
    local truncated = nil
    if FORWARD_BODY then
        body = txn.sf:req_body() or ""
        if #body > BODY_BUFFER_BYTES then
            body = body:sub(1, BODY_BUFFER_BYTES)
        end
        local length = tonumber(txn.sf:req_fhdr("content-length") or "")
        if length and #body < length then
            truncated = #body .. "/" .. length
        end
    end
    local lines = {
        "Connection: close",
        "Content-Length: " .. #body,
        APP_HEADER .. ": " .. APP_NAME,
    }
    local request_id = txn.sf:req_fhdr(REQUEST_ID_HEADER)
    if request_id and request_id ~= "" then
        lines[#lines + 1] = REQUEST_ID_HEADER .. ": " .. request_id
    end
    local session_id = txn.sf:req_fhdr(SESSION_HEADER)
    if session_id and session_id ~= "" then
        lines[#lines + 1] = SESSION_HEADER .. ": " .. session_id
    end
    if FORWARD_BODY then
        local content_type = txn.sf:req_fhdr("content-type")
        if content_type and content_type ~= "" then
            lines[#lines + 1] = "Content-Type: " .. content_type
        end
    end
    if truncated then
        lines[#lines + 1] = BODY_TRUNCATED_HEADER .. ": " .. truncated
    end
    return table.concat(lines, "\r\n") .. "\r\n\r\n" .. body
end

-- One route call. Returns the raw reply, or nil and whether another router may be tried (only when the
-- request cannot have reached this router: a router that got it may have acted on it, e.g. taken a token).
-- The connect gets its own short timeout: HAProxy retries a failed connect 3 times, each waiting up to the
-- connect timeout, so with the route timeout a dead router would eat the whole budget before the next is tried.
local function call_router(router, request, deadline)
    local sock = core.tcp()
    sock:settimeout(math.max(math.min(ROUTE_CONNECT_TIMEOUT_S, deadline - now_s()), 0.001))
    if not sock:connect(router.host, router.port) then
        sock:close()
        suspect_until[router.addr] = now_s() + SUSPECT_S
        return nil, true
    end
    sock:settimeout(math.max(deadline - now_s(), 0.001))
    if not sock:send("POST " .. ROUTE_PATH .. " HTTP/1.0\r\nHost: " .. router.addr .. "\r\n" .. request) then
        sock:close()
        return nil, true
    end
    local reply = sock:receive("*a")
    sock:close()
    if reply == nil or reply == "" then
        -- Closed without a byte before the deadline: the router died; no decision reached anyone
        -- (a token it may have taken is reaped by the ledger's TTL), so the next router may try.
        -- A timeout spent the whole deadline: nothing is left to try.
        local died = now_s() < deadline
        if died then
            suspect_until[router.addr] = now_s() + SUSPECT_S
        end
        return nil, died
    end
    return reply, false
end

local function ask_routers(txn, request)
    local healthy, suspect = up_routers(txn)
    local n = #healthy
    local order = {}
    cursor = cursor + 1
    for i = 0, n - 1 do
        order[#order + 1] = healthy[(cursor + i) % n + 1]
    end
    for _, router in ipairs(suspect) do
        order[#order + 1] = router
    end
    local deadline = now_s() + ROUTE_TIMEOUT_S
    for _, router in ipairs(order) do
        if deadline - now_s() <= 0 then
            return nil
        end
        local reply, try_next = call_router(router, request, deadline)
        if reply or not try_next then
            return reply
        end
    end
    return nil
end

local function json_string(body, key)
    return body:match('"' .. key .. '"%s*:%s*"([^"]*)"')
end

local function valid(value, pattern)
    return value ~= nil and #value <= MAX_ID_LENGTH and value:match(pattern) ~= nil
end

local function route(txn)
    local reply = ask_routers(txn, build_route_request(txn))
    if reply == nil then
        return REASON_ROUTER_UNREACHABLE
    end
    local status = reply:match("^HTTP/%d[%.%d]* (%d%d%d)")
    local _, header_end = reply:find("\r\n\r\n", 1, true)
    local body = header_end and reply:sub(header_end + 1) or ""
    if status ~= "200" then
        local reason = json_string(body, "reason")
        if valid(reason, REASON_PATTERN) then
            return reason
        end
        return REASON_ROUTER_NON_200
    end
    local replica_id = json_string(body, "replica_id")
    if not valid(replica_id, REPLICA_ID_PATTERN) then
        return REASON_UNPARSEABLE_REPLICA_ID
    end
    local slot = replica_map:lookup(replica_id)
    if slot == nil or not usable(txn, REPLICA_BACKEND, slot) then
        return REASON_UNKNOWN_REPLICA_ID
    end
    local token = json_string(body, "capacity_token")
    if token ~= nil then
        if not valid(token, TOKEN_PATTERN) then
            return REASON_UNPARSEABLE_REPLICA_ID
        end
        txn.http:req_set_header(CAPACITY_TOKEN_HEADER, token)
    end
    txn:set_var(VAR_REPLICA_ID, replica_id)
    txn:set_var(VAR_SERVER, slot)
    return nil
end

core.register_action($action_name, {"http-req"}, function(txn)
    local ok, reason = pcall(route, txn)
    if not ok then
        core.Alert("sluice route action failed: " .. tostring(reason))
        reason = REASON_ROUTER_UNREACHABLE
    end
    if reason ~= nil then
        txn:set_var(VAR_REASON, reason)
    end
end, 0)
"""
)


def render_lua(settings: HAProxySettings) -> str:
    """The Lua route action, with every constant rendered in from the contracts and the settings."""
    app = settings.app
    return LUA_TEMPLATE.substitute(
        route_path=ROUTE_PATH,
        route_path_lua=_lua_str(app.router_route_prefix + ROUTE_PATH),
        var_server=VAR_SERVER,
        var_reason=VAR_REASON,
        route_timeout_s=repr(float(settings.route_timeout_s)),
        route_connect_timeout_s=repr(float(min(settings.route_connect_timeout_s, settings.route_timeout_s))),
        # Until the health check has had time to mark a dead router down.
        suspect_s=repr(float(settings.check_inter_s + settings.check_fall * settings.check_fastinter_s)),
        app_name=_lua_str(app.name),
        app_header=_lua_str(APP_HEADER),
        session_header=_lua_str(app.session_header),
        request_id_header=_lua_str(REQUEST_ID_HEADER),
        body_truncated_header=_lua_str(BODY_TRUNCATED_HEADER),
        capacity_token_header=_lua_str(CAPACITY_TOKEN_HEADER),
        forward_body="true" if app.forward_body else "false",
        body_buffer_bytes=str(app.body_buffer_bytes),
        router_backend=_lua_str(ROUTER_BACKEND),
        router_slots=_lua_list(router_slot_names(settings)),
        replica_backend=_lua_str(REPLICA_BACKEND),
        map_path=_lua_str(str(settings.map_path)),
        var_server_lua=_lua_str(VAR_SERVER),
        var_reason_lua=_lua_str(VAR_REASON),
        var_replica_id=_lua_str(VAR_REPLICA_ID),
        reason_router_unreachable=_lua_str(REASON_ROUTER_UNREACHABLE),
        reason_router_non_200=_lua_str(REASON_ROUTER_NON_200),
        reason_unparseable_replica_id=_lua_str(REASON_UNPARSEABLE_REPLICA_ID),
        reason_unknown_replica_id=_lua_str(REASON_UNKNOWN_REPLICA_ID),
        replica_id_pattern=_lua_str(LUA_REPLICA_ID_PATTERN),
        token_pattern=_lua_str(LUA_TOKEN_PATTERN),
        reason_pattern=_lua_str(LUA_REASON_PATTERN),
        max_id_length=str(MAX_ID_LENGTH),
        action_name=_lua_str(LUA_ACTION),
    )
