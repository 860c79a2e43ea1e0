"""The Lua route action of the HAProxy data plane, rendered from `sluice.contracts` and the settings.

The action asks a router for the replica (`core.tcp` to the UP router slots), then pins the request to that
replica's slot or fails closed with a reason; see `infra.haproxy_config` for the config around it.
"""

from __future__ import annotations

from string import Template

from pydantic import BaseModel

from infra.haproxy_config import (
    LUA_ACTION,
    LUA_REASON_PATTERN,
    LUA_REPLICA_ID_PATTERN,
    LUA_TOKEN_PATTERN,
    MAX_ID_LENGTH,
    REPLICA_BACKEND,
    ROUTER_BACKEND,
    VAR_REASON,
    VAR_SERVER,
    HAProxySettings,
    router_slot_names,
)
from sluice.contracts import (
    APP_HEADER,
    BODY_TRUNCATED_HEADER,
    CAPACITY_TOKEN_HEADER,
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


def _wire_field(model: type[BaseModel], name: str) -> str:
    """A JSON field of the route reply the Lua action reads, as a Lua literal; fails if the model lost it."""
    if name not in model.model_fields:
        raise ValueError(f"{model.__name__} has no field {name!r}: the Lua action could not read it")
    return _lua_str(name)


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
local REASON_ROUTER_UNREACHABLE = $reason_router_unreachable
local REASON_ROUTER_NON_200 = $reason_router_non_200
local REASON_UNPARSEABLE_REPLICA_ID = $reason_unparseable_replica_id
local REASON_UNKNOWN_REPLICA_ID = $reason_unknown_replica_id
local REPLICA_ID_PATTERN = $replica_id_pattern
local TOKEN_PATTERN = $token_pattern
local REASON_PATTERN = $reason_pattern
local MAX_ID_LENGTH = $max_id_length
-- JSON fields of the router's reply.
local FIELD_REASON = $field_reason
local FIELD_REPLICA_ID = $field_replica_id
local FIELD_CAPACITY_TOKEN = $field_capacity_token

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
    -- The "backend/slot" argument is built on every call on purpose: HAProxy 2.8 writes a NUL over the '/' of
    -- the Lua string it is given, so a prebuilt string reused by the next request names no server.
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
        local reason = json_string(body, FIELD_REASON)
        if valid(reason, REASON_PATTERN) then
            return reason
        end
        return REASON_ROUTER_NON_200
    end
    local replica_id = json_string(body, FIELD_REPLICA_ID)
    if not valid(replica_id, REPLICA_ID_PATTERN) then
        return REASON_UNPARSEABLE_REPLICA_ID
    end
    local slot = replica_map:lookup(replica_id)
    if slot == nil or not usable(txn, REPLICA_BACKEND, slot) then
        return REASON_UNKNOWN_REPLICA_ID
    end
    local token = json_string(body, FIELD_CAPACITY_TOKEN)
    if token ~= nil then
        if not valid(token, TOKEN_PATTERN) then
            return REASON_UNPARSEABLE_REPLICA_ID
        end
        txn.http:req_set_header(CAPACITY_TOKEN_HEADER, token)
    end
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
        reason_router_unreachable=_lua_str(REASON_ROUTER_UNREACHABLE),
        reason_router_non_200=_lua_str(REASON_ROUTER_NON_200),
        reason_unparseable_replica_id=_lua_str(REASON_UNPARSEABLE_REPLICA_ID),
        reason_unknown_replica_id=_lua_str(REASON_UNKNOWN_REPLICA_ID),
        replica_id_pattern=_lua_str(LUA_REPLICA_ID_PATTERN),
        token_pattern=_lua_str(LUA_TOKEN_PATTERN),
        reason_pattern=_lua_str(LUA_REASON_PATTERN),
        max_id_length=str(MAX_ID_LENGTH),
        field_reason=_wire_field(RouteRefusal, "reason"),
        field_replica_id=_wire_field(RouteReply, "replica_id"),
        field_capacity_token=_wire_field(RouteReply, "capacity_token"),
        action_name=_lua_str(LUA_ACTION),
    )
