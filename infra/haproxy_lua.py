"""The Lua route action of the HAProxy data plane, rendered from `sluice.contracts` and the settings.

The action asks a router for its ranked replicas (`core.tcp` to the UP router servers), then pins the request to
the first one the frontend can route to, or fails closed with a reason; a second action pins the next ranked
replica when the pinned one refused the connection. See `infra.haproxy_config` for the config around them.
"""

from __future__ import annotations

from string import Template

from pydantic import BaseModel

from infra.haproxy_config import (
    FALLBACK_TABLE,
    INTERNAL_SERVER_PREFIX,
    LUA_ACTION,
    LUA_METRICS_SERVICE,
    LUA_REASON_PATTERN,
    LUA_REPLICA_ID_PATTERN,
    LUA_RETRY_ACTION,
    LUA_TOKEN_PATTERN,
    MAX_ID_LENGTH,
    REPLICA_BACKEND,
    ROUTER_BACKEND,
    VAR_FALLBACK,
    VAR_RANK,
    VAR_REASON,
    VAR_SERVER,
    HAProxySettings,
)
from routers.core import DEFAULT_NUM_FALLBACK_REPLICAS
from sluice.contracts import (
    APP_HEADER,
    BODY_TRUNCATED_HEADER,
    CAPACITY_TOKEN_HEADER,
    FALLBACK_ABSENT,
    FALLBACK_DOWN,
    FALLBACK_REASONS,
    FALLBACK_REFUSED,
    FRONTEND_HEADER,
    RANKED_HEADER,
    REASON_REPLICA_UNAVAILABLE,
    REASON_ROUTER_NON_200,
    REASON_ROUTER_UNREACHABLE,
    REASON_UNKNOWN_REPLICA_ID,
    REASON_UNPARSEABLE_REPLICA_ID,
    REQUEST_ID_HEADER,
    ROUTE_PATH,
)
from sluice.route_wire import RouteRefusal, RouteReply


def _lua_str(value: str) -> str:
    """A Lua string literal (only printable ASCII is accepted, so no escape beyond quote and backslash)."""
    if not value.isascii() or not value.isprintable():
        raise ValueError(f"refusing non-printable or non-ASCII value in the Lua template: {value!r}")
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _lua_list(values: list[str]) -> str:
    return "{" + ", ".join(_lua_str(v) for v in values) + "}"


def _lua_bool(value: bool) -> str:
    return "true" if value else "false"


def _wire_field(model: type[BaseModel], name: str) -> str:
    """A JSON field of the route reply the Lua action reads, as a Lua literal; fails if the model lost it."""
    if name not in model.model_fields:
        raise ValueError(f"{model.__name__} has no field {name!r}: the Lua action could not read it")
    return _lua_str(name)


LUA_TEMPLATE = Template(
    r"""-- sluice route action. Rendered by infra/haproxy_config.py from sluice/contracts.py: do not edit by hand.
--
-- A routed request (any method but GET/HEAD) asks one UP router `POST $route_path` over core.tcp
-- (HTTP/1.0, Connection: close) for its ranked replicas (primary, then fallbacks). The request is pinned
-- ($var_server) to the first of them this frontend can route to: a server of that id exists and is UP (not
-- DOWN, not leaving). The replicas still to try go along in $ranked_header: if the pinned replica refuses the
-- connection, HAProxy hands the request to frontend sluice_retry, whose action pins the next one. Otherwise
-- $var_reason says why not (the frontend then fails closed with a 503, or fails open when the app opted in:
-- then, like GET/HEAD, the request rotates over the routable replicas without a router).

local ROUTE_TIMEOUT_S = $route_timeout_s
local ROUTE_CONNECT_TIMEOUT_S = $route_connect_timeout_s
local SUSPECT_S = $suspect_s
local ROUTE_PATH = $route_path_lua
local APP_NAME = $app_name
local FRONTEND_ID = $frontend_id
local APP_HEADER = $app_header
local FRONTEND_HEADER = $frontend_header
local SESSION_HEADER = $session_header
local REQUEST_ID_HEADER = $request_id_header
local BODY_TRUNCATED_HEADER = $body_truncated_header
local CAPACITY_TOKEN_HEADER = $capacity_token_header
local RANKED_HEADER = $ranked_header_lua
local FORWARD_BODY = $forward_body
local FAIL_OPEN = $fail_open
local BODY_BUFFER_BYTES = $body_buffer_bytes
local ROUTER_BACKEND = $router_backend
local REPLICA_BACKEND = $replica_backend
local FALLBACK_TABLE = $fallback_table
local INTERNAL_SERVER_PREFIX = $internal_server_prefix
local VAR_SERVER = $var_server_lua
local VAR_REASON = $var_reason_lua
local VAR_RANK = $var_rank
local VAR_FALLBACK = $var_fallback
local REASON_ROUTER_UNREACHABLE = $reason_router_unreachable
local REASON_ROUTER_NON_200 = $reason_router_non_200
local REASON_UNPARSEABLE_REPLICA_ID = $reason_unparseable_replica_id
local REASON_UNKNOWN_REPLICA_ID = $reason_unknown_replica_id
local REASON_REPLICA_UNAVAILABLE = $reason_replica_unavailable
local FALLBACK_ABSENT = $fallback_absent
local FALLBACK_DOWN = $fallback_down
local FALLBACK_REFUSED = $fallback_refused
local FALLBACK_REASONS = $fallback_reasons
local REPLICA_ID_PATTERN = $replica_id_pattern
local TOKEN_PATTERN = $token_pattern
local REASON_PATTERN = $reason_pattern
local MAX_ID_LENGTH = $max_id_length
-- Replicas a rotation (GET/HEAD, fail-open) pins to, at most: the first and the ones tried if it refuses.
local ROTATION_CANDIDATES = $rotation_candidates
-- JSON fields of the router's reply.
local FIELD_REASON = $field_reason
local FIELD_REPLICA_ID = $field_replica_id
local FIELD_FALLBACKS = $field_fallbacks
local FIELD_CAPACITY_TOKEN = $field_capacity_token
-- Rank of a rotation candidate in $ranked_header: it is no router's ranking, so no rank is reported.
local UNRANKED = "-"

-- Round-robin cursors over the UP routers and over the replicas (rotation), and routers that refused a
-- connection lately (addr -> until): one of each per thread (lua-load-per-thread), no locking needed.
local router_cursor = 0
local rotation_cursor = 0
local suspect_until = {}

local function now_s()
    local t = core.now()
    return t.sec + t.usec / 1000000
end

-- Whether the server is UP. The "backend/server" argument is built on every call on purpose: HAProxy 2.8
-- writes a NUL over the '/' of the Lua string it is given, so a prebuilt string reused later names no server.
-- Sample fetches hand booleans to Lua as integers (0 is true in Lua): compare explicitly.
local function is_up(txn, backend_name, name)
    local up = txn.f:srv_is_up(backend_name .. "/" .. name)
    return up == 1 or up == true
end

-- Why the frontend cannot route to replica `name` now, or nil when it can. Replica servers have weight 0, which
-- HAProxy reports as draining: a replica that leaves is put in maintenance instead, so UP is the whole test.
local function replica_unusable(txn, name)
    if core.backends[REPLICA_BACKEND].servers[name] == nil then
        return FALLBACK_ABSENT
    end
    if not is_up(txn, REPLICA_BACKEND, name) then
        return FALLBACK_DOWN
    end
    return nil
end

-- The UP routers, those that refused a connection lately (this thread saw it; HAProxy's health check has
-- not marked them down yet) last.
local function up_routers(txn)
    local healthy, suspect = {}, {}
    local now = now_s()
    for name, server in pairs(core.backends[ROUTER_BACKEND].servers) do
        if not server:is_draining() and is_up(txn, ROUTER_BACKEND, name) then
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
        FRONTEND_HEADER .. ": " .. FRONTEND_ID,
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
    router_cursor = router_cursor + 1
    for i = 0, n - 1 do
        order[#order + 1] = healthy[(router_cursor + i) % n + 1]
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

-- The router's ranked replica ids (primary first), or nil and a reason.
local function ranked_ids(body)
    local primary = json_string(body, FIELD_REPLICA_ID)
    if not valid(primary, REPLICA_ID_PATTERN) then
        return nil, REASON_UNPARSEABLE_REPLICA_ID
    end
    local ids = {primary}
    local list = body:match('"' .. FIELD_FALLBACKS .. '"%s*:%s*%[([^%]]*)%]')
    if list then
        for id in list:gmatch('"([^"]*)"') do
            if not valid(id, REPLICA_ID_PATTERN) then
                return nil, REASON_UNPARSEABLE_REPLICA_ID
            end
            ids[#ids + 1] = id
        end
    end
    return ids, nil
end

-- Pin the request to the first usable candidate; the rest go along in RANKED_HEADER. A candidate is
-- {rank, id}, rank being UNRANKED for a rotation. Returns nil when pinned, else why the first candidate
-- could not take it (unusable, or absent).
local function pin(txn, candidates)
    local first_unusable = nil
    for i, candidate in ipairs(candidates) do
        local unusable = replica_unusable(txn, candidate[2])
        if unusable == nil then
            local rest = {}
            for j = i + 1, #candidates do
                rest[#rest + 1] = candidates[j][1] .. "=" .. candidates[j][2]
            end
            txn.http:req_set_header(RANKED_HEADER, candidate[1] .. "|" .. table.concat(rest, ","))
            txn:set_var(VAR_SERVER, candidate[2])
            if candidate[1] ~= UNRANKED then
                txn:set_var(VAR_RANK, tonumber(candidate[1]))
                if i > 1 and candidates[1][1] == "0" then
                    txn:set_var(VAR_FALLBACK, first_unusable)
                end
            end
            return nil
        end
        first_unusable = first_unusable or unusable
    end
    return first_unusable or FALLBACK_ABSENT
end

-- Up to ROTATION_CANDIDATES routable replicas, starting at this thread's cursor (O(replicas) per request:
-- for GET/HEAD and fail-open requests only).
local function rotation(txn)
    local names = {}
    for name in pairs(core.backends[REPLICA_BACKEND].servers) do
        if name:sub(1, #INTERNAL_SERVER_PREFIX) ~= INTERNAL_SERVER_PREFIX and replica_unusable(txn, name) == nil then
            names[#names + 1] = name
        end
    end
    local candidates = {}
    if #names == 0 then
        return candidates
    end
    table.sort(names)
    rotation_cursor = rotation_cursor + 1
    for i = 0, math.min(ROTATION_CANDIDATES, #names) - 1 do
        candidates[#candidates + 1] = {UNRANKED, names[(rotation_cursor + i) % #names + 1]}
    end
    return candidates
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
        local reason = json_string(body, FIELD_REASON)
        if valid(reason, REASON_PATTERN) then
            return reason
        end
        return REASON_ROUTER_NON_200
    end
    local ids, reason = ranked_ids(body)
    if ids == nil then
        return reason
    end
    local token = json_string(body, FIELD_CAPACITY_TOKEN)
    if token ~= nil and not valid(token, TOKEN_PATTERN) then
        return REASON_UNPARSEABLE_REPLICA_ID
    end
    local candidates = {}
    for rank, id in ipairs(ids) do
        candidates[rank] = {tostring(rank - 1), id}
    end
    local unusable = pin(txn, candidates)
    if unusable ~= nil then
        -- No ranked replica is usable: say why the primary was not.
        return unusable == FALLBACK_ABSENT and REASON_UNKNOWN_REPLICA_ID or REASON_REPLICA_UNAVAILABLE
    end
    if token ~= nil then
        txn.http:req_set_header(CAPACITY_TOKEN_HEADER, token)
    end
    return nil
end

local function rotate(txn)
    if pin(txn, rotation(txn)) ~= nil then
        return REASON_REPLICA_UNAVAILABLE
    end
    return nil
end

local function safely(txn, action)
    local ok, reason = pcall(action, txn)
    if not ok then
        core.Alert("sluice route action failed: " .. tostring(reason))
        return REASON_ROUTER_UNREACHABLE
    end
    return reason
end

core.register_action($action_name, {"http-req"}, function(txn)
    local method = txn.f:method()
    if method == "GET" or method == "HEAD" then
        local reason = safely(txn, rotate)
        if reason ~= nil then
            txn:set_var(VAR_REASON, reason)
        end
        return
    end
    local reason = safely(txn, route)
    if reason ~= nil then
        txn:set_var(VAR_REASON, reason)
        if FAIL_OPEN then
            -- Served anyway (the reason goes out as the fallback header); only a rotation that finds no
            -- replica leaves the request to the backstop's 503.
            safely(txn, rotate)
        end
    end
end, 0)

-- Frontend sluice_retry: the pinned replica refused the connection before any byte was sent. Pin the next
-- usable candidate of RANKED_HEADER ("<pinned rank>|<rank>=<id>,...").
local function retry(txn)
    local pinned, rest = (txn.sf:req_fhdr(RANKED_HEADER) or ""):match("^([^|]*)|(.*)$$")
    local candidates = {}
    for rank, id in (rest or ""):gmatch("([^=,]+)=([^,]+)") do
        if not valid(id, REPLICA_ID_PATTERN) then
            return REASON_REPLICA_UNAVAILABLE
        end
        candidates[#candidates + 1] = {rank, id}
    end
    if pin(txn, candidates) ~= nil then
        return REASON_REPLICA_UNAVAILABLE
    end
    if pinned == "0" then
        txn:set_var(VAR_FALLBACK, FALLBACK_REFUSED)
    end
    return nil
end

core.register_action($retry_action_name, {"http-req"}, function(txn)
    local reason = safely(txn, retry)
    if reason ~= nil then
        txn:set_var(VAR_REASON, reason)
    end
end, 0)

-- sluice's frontend counters in Prometheus text format, read from the fallback stick table (shared by all
-- threads, unlike this Lua state).
core.register_service($metrics_service_name, "http", function(applet)
    local entries = core.backends[FALLBACK_TABLE].stktable:dump()
    local lines = {
        "# HELP sluice_frontend_fallbacks_total Requests pinned past the router's primary, by why it was passed over.",
        "# TYPE sluice_frontend_fallbacks_total counter",
    }
    for _, reason in ipairs(FALLBACK_REASONS) do
        local entry = entries[reason]
        local count = entry and entry.http_req_cnt or 0
        lines[#lines + 1] = 'sluice_frontend_fallbacks_total{reason="' .. reason .. '"} ' .. count
    end
    local body = table.concat(lines, "\n") .. "\n"
    applet:set_status(200)
    applet:add_header("content-type", "text/plain; version=0.0.4")
    applet:add_header("content-length", tostring(#body))
    applet:start_response()
    applet:send(body)
end)
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
        ranked_header=RANKED_HEADER,
        route_timeout_s=repr(float(settings.route_timeout_s)),
        route_connect_timeout_s=repr(float(min(settings.route_connect_timeout_s, settings.route_timeout_s))),
        # Until the health check has had time to mark a dead router down.
        suspect_s=repr(float(settings.check_inter_s + settings.check_fall * settings.check_fastinter_s)),
        app_name=_lua_str(app.name),
        frontend_id=_lua_str(settings.frontend_id),
        app_header=_lua_str(APP_HEADER),
        frontend_header=_lua_str(FRONTEND_HEADER),
        session_header=_lua_str(app.session_header),
        request_id_header=_lua_str(REQUEST_ID_HEADER),
        body_truncated_header=_lua_str(BODY_TRUNCATED_HEADER),
        capacity_token_header=_lua_str(CAPACITY_TOKEN_HEADER),
        ranked_header_lua=_lua_str(RANKED_HEADER),
        forward_body=_lua_bool(app.forward_body),
        fail_open=_lua_bool(app.fail_open),
        body_buffer_bytes=str(app.body_buffer_bytes),
        router_backend=_lua_str(ROUTER_BACKEND),
        replica_backend=_lua_str(REPLICA_BACKEND),
        fallback_table=_lua_str(FALLBACK_TABLE),
        internal_server_prefix=_lua_str(INTERNAL_SERVER_PREFIX),
        var_server_lua=_lua_str(VAR_SERVER),
        var_reason_lua=_lua_str(VAR_REASON),
        var_rank=_lua_str(VAR_RANK),
        var_fallback=_lua_str(VAR_FALLBACK),
        reason_router_unreachable=_lua_str(REASON_ROUTER_UNREACHABLE),
        reason_router_non_200=_lua_str(REASON_ROUTER_NON_200),
        reason_unparseable_replica_id=_lua_str(REASON_UNPARSEABLE_REPLICA_ID),
        reason_unknown_replica_id=_lua_str(REASON_UNKNOWN_REPLICA_ID),
        reason_replica_unavailable=_lua_str(REASON_REPLICA_UNAVAILABLE),
        fallback_absent=_lua_str(FALLBACK_ABSENT),
        fallback_down=_lua_str(FALLBACK_DOWN),
        fallback_refused=_lua_str(FALLBACK_REFUSED),
        fallback_reasons=_lua_list(list(FALLBACK_REASONS)),
        replica_id_pattern=_lua_str(LUA_REPLICA_ID_PATTERN),
        token_pattern=_lua_str(LUA_TOKEN_PATTERN),
        reason_pattern=_lua_str(LUA_REASON_PATTERN),
        max_id_length=str(MAX_ID_LENGTH),
        rotation_candidates=str(1 + DEFAULT_NUM_FALLBACK_REPLICAS),
        field_reason=_wire_field(RouteRefusal, "reason"),
        field_replica_id=_wire_field(RouteReply, "replica_id"),
        field_fallbacks=_wire_field(RouteReply, "fallbacks"),
        field_capacity_token=_wire_field(RouteReply, "capacity_token"),
        action_name=_lua_str(LUA_ACTION),
        retry_action_name=_lua_str(LUA_RETRY_ACTION),
        metrics_service_name=_lua_str(LUA_METRICS_SERVICE),
    )
