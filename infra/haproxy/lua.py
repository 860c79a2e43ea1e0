"""The Lua route action of the HAProxy data plane, rendered from `base.contracts` and the settings.

The action finds the request's app, asks one of that app's routers for its ranked replicas (`core.tcp` to the UP
router servers), then pins the request to the first one the frontend can route to, or fails closed with a reason;
a second action pins the next ranked replica when the pinned one refused the connection. The same chunk carries the
metrics frontend's services (`infra/observability/frontend_metrics.lua.tmpl`). Details: infra/haproxy/README.md.
"""

from __future__ import annotations

from pathlib import Path
from string import Template

from pydantic import BaseModel

from base import agent_wire
from base.contracts import (
    APP_HEADER,
    BODY_TOTAL_UNKNOWN,
    BODY_TRUNCATED_HEADER,
    CANARY_CRITERIA,
    CAPACITY_TOKEN_HEADER,
    DATA_PARALLEL_RANK_HEADER,
    DIRECT_PATH,
    DIRECT_WEIGHT_MAX,
    FAIL_CLOSED_REASONS,
    FALLBACK_ABSENT,
    FALLBACK_DOWN,
    FALLBACK_REASONS,
    FALLBACK_REFUSED,
    FRONTEND_HEADER,
    LEGACY_PATH,
    MODEL_HEADER,
    PREFILL_REPLICA_HEADER,
    PREFILL_URL_HEADER,
    RANK_SEPARATOR,
    RANKED_HEADER,
    REASON_MODEL_BEYOND_BUFFER,
    REASON_MODEL_MISSING,
    REASON_MODEL_NOT_FOUND,
    REASON_NO_REPLICA,
    REASON_REPLICA_UNAVAILABLE,
    REASON_ROUTER_NON_200,
    REASON_ROUTER_UNREACHABLE,
    REASON_UNKNOWN_REPLICA_ID,
    REASON_UNPARSEABLE_REPLICA_ID,
    REQUEST_ID_HEADER,
    ROUTE_BUDGET_HEADER,
    ROUTE_PATH,
    ROUTE_TABLE_PATH,
    TABLE_LEASE_S,
    TABLE_REFRESH_S,
    TABLE_RING,
    TABLE_ROTATION,
    TRACEPARENT_HEADER,
)
from base.route_wire import RouteRefusal, RouteReply, RouteTable
from infra.haproxy.canary import (
    ROLLBACK_COUNTER,
    ROLLBACK_TABLE,
    VAR_APP,
    VAR_PATH,
    VAR_ROUTE_US,
    legacy_backend,
)
from infra.haproxy.config import (
    FALLBACK_TABLE,
    INTERNAL_SERVER_PREFIX,
    LUA_ACTION,
    LUA_METRICS_SERVICE,
    LUA_REASON_PATTERN,
    LUA_REPLICA_ID_PATTERN,
    LUA_RETRY_ACTION,
    LUA_TOKEN_PATTERN,
    LUA_TRACEPARENT_PATTERN,
    LUA_URL_PATTERN,
    MAX_ID_LENGTH,
    UNROUTED_TABLE,
    VAR_BACKEND,
    VAR_FALLBACK,
    VAR_PREFIX,
    VAR_RANK,
    VAR_REASON,
    VAR_SERVER,
    HAProxySettings,
    replica_backend,
    router_backend,
)
from infra.haproxy.models import MODEL_JSON_PATH, VAR_ERROR, VAR_MODEL
from infra.haproxy.protection import COUNTED_REASONS, REFUSAL_TABLE
from infra.haproxy.spoe import (
    AGENT_FAILURE_TABLE,
    AGENT_FAILURES,
    LUA_REPLY_ACTION,
    VAR_AGENT_BODY,
    VAR_AGENT_TRUNCATED,
    VAR_ASK_AGENT,
    VAR_ROUTE_STARTED_US,
    agent_backend,
    agent_var,
)
from infra.haproxy.tables import TABLE_DECISION_TABLE, VAR_TABLE_KIND
from infra.observability import METRICS_LUA_TEMPLATE_PATH
from infra.observability.targets import (
    APP_LABEL,
    LUA_TARGETS_SERVICE,
    METRICS_PATH_LABEL,
    REPLICA_LABEL,
    ROLE_LABEL,
    ROLE_REPLICA,
    ROLE_ROUTER,
    TARGETS_ROLE_PARAM,
    metrics_path,
    router_targets_backend,
)
from routers.consistent_hash import HASH_SEED, VIRTUAL_NODES
from routers.core import DEFAULT_NUM_FALLBACK_REPLICAS


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


def _agent_field(name: str) -> str:
    """A variable of the agent's answer the Lua action reads; fails if the wire lost it."""
    if name not in agent_wire.ANSWER_VARS:
        raise ValueError(f"the route agent sets no variable {name!r}: the Lua action could not read it")
    return name


def _lua_apps(settings: HAProxySettings) -> str:
    """The frontend's apps as a Lua array of tables (what the action needs to route each app's requests)."""
    entries = []
    for index, app in enumerate(settings.apps):
        fields = {
            "name": _lua_str(app.name),
            "replica_backend": _lua_str(replica_backend(index)),
            "router_backend": _lua_str(router_backend(index)),
            "route_path": _lua_str(app.router_route_prefix + ROUTE_PATH),
            "tables": _lua_bool(app.table_decisions),
            "table_path": _lua_str(app.router_route_prefix + ROUTE_TABLE_PATH),
            "prefix": _lua_str(app.replica_route_prefix),
            "session_header": _lua_str(app.session_header),
            "forward_body": _lua_bool(app.forward_body),
            "fail_open": _lua_bool(app.fail_open),
            "body_buffer_bytes": str(app.body_buffer_bytes),
            "legacy_backend": _lua_str(legacy_backend(index)),
            "router_targets_backend": _lua_str(router_targets_backend(index)),
            "agent_backend": _lua_str(agent_backend(index)),
            "router_metrics_path": _lua_str(metrics_path(app.router_route_prefix)),
            "replica_metrics_path": _lua_str(metrics_path(app.replica_route_prefix)),
        }
        if app.legacy_route_prefix is not None:
            fields["legacy_prefix"] = _lua_str(app.legacy_route_prefix)
        if app.model is not None:
            fields["model"] = _lua_str(app.model)
        entries.append("    {" + ", ".join(f"{key} = {value}" for key, value in fields.items()) + "},")
    return "{\n" + "\n".join(entries) + "\n}"


# A rotation (GET/HEAD) that finds no routable replica waits this long for one, polling: a new HAProxy's servers
# come with its syncer's first pass, a fraction of a second after it starts (it stays paused meanwhile, but a
# connection may reach it in the moment between its start and the pause).
EMPTY_POOL_WAIT_MS = 1000
EMPTY_POOL_POLL_MS = 50
# The Lua source with `$placeholders` for every constant (string.Template; `$$` is a literal `$`): the table
# decisions (and the helpers the rest shares), the route action, then, in the same chunk, the metrics frontend's
# services (counters and target discovery).
LUA_TEMPLATE = Template(
    "\n".join(
        path.read_text()
        for path in (
            Path(__file__).with_name("route_tables.lua.tmpl"),
            Path(__file__).with_name("sluice_route.lua.tmpl"),
            METRICS_LUA_TEMPLATE_PATH,
        )
    )
)


def render_lua(settings: HAProxySettings) -> str:
    """The Lua route actions and metrics services, with every constant rendered in from the contracts and the
    settings."""
    return LUA_TEMPLATE.substitute(
        route_path=ROUTE_PATH,
        weights_map_path=_lua_str(str(settings.weights_map_path)),
        direct_weight_max=str(DIRECT_WEIGHT_MAX),
        direct_path=_lua_str(DIRECT_PATH),
        legacy_path=_lua_str(LEGACY_PATH),
        var_path=_lua_str(VAR_PATH),
        var_app=_lua_str(VAR_APP),
        var_route_us=_lua_str(VAR_ROUTE_US),
        apps=_lua_apps(settings),
        model_lookup_bytes=str(settings.model_lookup_bytes),
        model_json_path=_lua_str(MODEL_JSON_PATH),
        served_models=_lua_str(", ".join(app.model or app.name for app in settings.apps)),
        model_header=_lua_str(MODEL_HEADER),
        var_model=_lua_str(VAR_MODEL),
        var_error=_lua_str(VAR_ERROR),
        var_backend=_lua_str(VAR_BACKEND),
        var_prefix=_lua_str(VAR_PREFIX),
        reason_model_not_found=_lua_str(REASON_MODEL_NOT_FOUND),
        reason_model_missing=_lua_str(REASON_MODEL_MISSING),
        reason_model_beyond_buffer=_lua_str(REASON_MODEL_BEYOND_BUFFER),
        var_server=VAR_SERVER,
        var_reason=VAR_REASON,
        ranked_header=RANKED_HEADER,
        route_timeout_s=repr(float(settings.route_timeout_s)),
        route_connect_timeout_s=repr(float(min(settings.route_connect_timeout_s, settings.route_timeout_s))),
        # Until the health check has had time to mark a dead router down.
        suspect_s=repr(float(settings.check_inter_s + settings.check_fall * settings.check_fastinter_s)),
        frontend_id=_lua_str(settings.frontend_id),
        app_header=_lua_str(APP_HEADER),
        frontend_header=_lua_str(FRONTEND_HEADER),
        internal_header=_lua_str(": ".join(settings.internal_header() or ())),
        request_id_header=_lua_str(REQUEST_ID_HEADER),
        body_truncated_header=_lua_str(BODY_TRUNCATED_HEADER),
        route_budget_header=_lua_str(ROUTE_BUDGET_HEADER),
        body_total_unknown=_lua_str(BODY_TOTAL_UNKNOWN),
        capacity_token_header=_lua_str(CAPACITY_TOKEN_HEADER),
        prefill_replica_header=_lua_str(PREFILL_REPLICA_HEADER),
        prefill_url_header=_lua_str(PREFILL_URL_HEADER),
        tracing="true" if settings.tracing else "false",
        traceparent_header=_lua_str(TRACEPARENT_HEADER),
        traceparent_pattern=_lua_str(LUA_TRACEPARENT_PATTERN),
        ranked_header_lua=_lua_str(RANKED_HEADER),
        data_parallel_rank_header=_lua_str(DATA_PARALLEL_RANK_HEADER),
        rank_separator_pattern=_lua_str("%" + RANK_SEPARATOR),
        fallback_table=_lua_str(FALLBACK_TABLE),
        unrouted_table=_lua_str(UNROUTED_TABLE),
        # Fail-closed reasons of the frontend's own and the router's usual one (listed at 0 before the first).
        unrouted_reasons=_lua_list([*FAIL_CLOSED_REASONS, REASON_REPLICA_UNAVAILABLE, REASON_NO_REPLICA]),
        rollback_table=_lua_str(ROLLBACK_TABLE),
        rollback_reasons=_lua_list(list(CANARY_CRITERIA)),
        rollback_counter=_lua_str(ROLLBACK_COUNTER),
        targets_role_param=_lua_str(TARGETS_ROLE_PARAM),
        role_router=_lua_str(ROLE_ROUTER),
        role_replica=_lua_str(ROLE_REPLICA),
        metrics_path_label=_lua_str(METRICS_PATH_LABEL),
        role_label=_lua_str(ROLE_LABEL),
        app_label=_lua_str(APP_LABEL),
        replica_label=_lua_str(REPLICA_LABEL),
        targets_service_name=_lua_str(LUA_TARGETS_SERVICE),
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
        refusal_table=_lua_str(REFUSAL_TABLE),
        agent_failure_table=_lua_str(AGENT_FAILURE_TABLE),
        agent_failure_reasons=_lua_list(list(AGENT_FAILURES)),
        refusal_reasons=_lua_list(list(COUNTED_REASONS)),
        replica_id_pattern=_lua_str(LUA_REPLICA_ID_PATTERN),
        token_pattern=_lua_str(LUA_TOKEN_PATTERN),
        reason_pattern=_lua_str(LUA_REASON_PATTERN),
        url_pattern=_lua_str(LUA_URL_PATTERN),
        max_id_length=str(MAX_ID_LENGTH),
        rotation_candidates=str(1 + DEFAULT_NUM_FALLBACK_REPLICAS),
        empty_pool_wait_ms=str(EMPTY_POOL_WAIT_MS),
        empty_pool_poll_ms=str(EMPTY_POOL_POLL_MS),
        table_refresh_ms=str(round(TABLE_REFRESH_S * 1000)),
        table_lease_s=repr(float(TABLE_LEASE_S)),
        var_table_kind=_lua_str(VAR_TABLE_KIND),
        table_decision_table=_lua_str(TABLE_DECISION_TABLE),
        table_rotation=_lua_str(TABLE_ROTATION),
        table_ring=_lua_str(TABLE_RING),
        table_field_kind=_wire_field(RouteTable, "kind"),
        table_field_fallbacks=_wire_field(RouteTable, "fallbacks"),
        table_field_ids=_wire_field(RouteTable, "replica_ids"),
        ring_seed=str(HASH_SEED),
        ring_virtual_nodes=str(VIRTUAL_NODES),
        field_reason=_wire_field(RouteRefusal, "reason"),
        field_replica_id=_wire_field(RouteReply, "replica_id"),
        field_fallbacks=_wire_field(RouteReply, "fallbacks"),
        field_capacity_token=_wire_field(RouteReply, "capacity_token"),
        field_prefill_replica_id=_wire_field(RouteReply, "prefill_replica_id"),
        field_prefill_url=_wire_field(RouteReply, "prefill_url"),
        field_traceparent=_wire_field(RouteReply, agent_wire.TRACE_VAR),
        action_name=_lua_str(LUA_ACTION),
        reply_action_name=_lua_str(LUA_REPLY_ACTION),
        var_ask_agent=_lua_str(VAR_ASK_AGENT),
        var_agent_body=_lua_str(VAR_AGENT_BODY),
        var_agent_truncated=_lua_str(VAR_AGENT_TRUNCATED),
        var_route_started_us=_lua_str(VAR_ROUTE_STARTED_US),
        agent_error_var=_lua_str(agent_var(agent_wire.ERROR_VAR)),
        agent_status_var=_lua_str(agent_var(agent_wire.STATUS_VAR)),
        agent_reason_var=_lua_str(agent_var(agent_wire.REASON_VAR)),
        agent_replica_id_var=_lua_str(agent_var(_agent_field("replica_id"))),
        agent_fallbacks_var=_lua_str(agent_var(_agent_field("fallbacks"))),
        agent_capacity_token_var=_lua_str(agent_var(_agent_field("capacity_token"))),
        agent_prefill_replica_id_var=_lua_str(agent_var(_agent_field("prefill_replica_id"))),
        agent_prefill_url_var=_lua_str(agent_var(_agent_field("prefill_url"))),
        agent_traceparent_var=_lua_str(agent_var(_agent_field(agent_wire.TRACE_VAR))),
        agent_fallback_pattern=_lua_str(f"[^{agent_wire.FALLBACK_SEPARATOR}]+"),
        retry_action_name=_lua_str(LUA_RETRY_ACTION),
        metrics_service_name=_lua_str(LUA_METRICS_SERVICE),
    )
