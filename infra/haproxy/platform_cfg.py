"""The haproxy.cfg of a platform (`render_platform_config`) and every file it loads (`write_platform_files`).

One public frontend for many teams' stacks. A request, in the order of the rules:
1. The internal headers a client sent are read where the platform uses them (the model and priority headers), then
   stripped (`docs/design.md` §3).
2. Its tenant: the `Authorization: Bearer` key's SHA-256 digest looked up in the keys map (401 `invalid_api_key`
   when absent); the key is not forwarded.
3. The tenant's quotas (its stick-table entry, sc0): requests in flight (429 `tenant_limit`) and requests per minute
   (429 `quota_exceeded`). Other tenants' entries are their own.
4. The stack's protection (paths, sizes, the body's timeout: `infra.haproxy.protection`, without keys).
5. `GET /v1/models`: the tenant's attached models (a Lua service). Else the model (the model header, else the body's
   top-level `model`: 400 `model_missing`); a model the tenant may not call and one not attached get the same 404
   `model_not_found`, so a key learns nothing of other tenants' models.
6. The model's slot backend: 503 `model_unavailable` when its team's frontend is not up (`nbsrv`), else the Lua
   admission gives the class and the fair-share offset (`infra.haproxy.platform_lua`) and the request queues for the
   slot server's maxconn (the model's capacity) up to `queue_timeout_s`: HAProxy's 503 for a queue timeout becomes
   429 `queue_timeout` with Retry-After.
Every refusal carries `x-serve-reason` and an OpenAI-style JSON body, and is counted by tenant and reason.
"""

from __future__ import annotations

from base.contracts import (
    AUTHORIZATION_HEADER,
    DATA_PARALLEL_RANK_HEADER,
    INTERNAL_CREDENTIAL_HEADER,
    INTERNAL_HEADER_PREFIXES,
    MODEL_HEADER,
    MODELS_PATH,
    PRIORITY_HEADER,
    REASON_INVALID_API_KEY,
    REASON_MODEL_MISSING,
    REASON_MODEL_NOT_FOUND,
    REASON_MODEL_UNAVAILABLE,
    REASON_QUEUE_TIMEOUT,
    REASON_QUOTA_EXCEEDED,
    REASON_TENANT_LIMIT,
    RETRY_AFTER_HEADER,
    SERVE_REASON_HEADER,
    TENANT_HEADER,
    TOKENS_HEADER,
    USAGE_PATH,
    USAGE_URL_HEADER,
)
from infra.haproxy.base_settings import defaults_lines
from infra.haproxy.config import PROMETHEUS_PATH, SLUICE_METRICS_PATH
from infra.haproxy.formatting import counter_table_lines, haproxy_time, openai_error_body
from infra.haproxy.models import MODEL_JSON_PATH, MODEL_NAME_PATTERN
from infra.haproxy.platform_lua import render_platform_lua
from infra.haproxy.platform_settings import (
    ACCESS_MAP,
    ACCESS_SEPARATOR,
    KEYS_MAP,
    LUA_ADMIT_ACTION,
    LUA_ADMITTED_ACTION,
    LUA_METRICS_SERVICE,
    LUA_MODELS_SERVICE,
    LUA_UNSERVED_BODY_FETCH,
    LUA_UNSERVED_REASON_FETCH,
    MODELS_MAP,
    PLATFORM_FRONTEND,
    PROMETHEUS_FRONTEND,
    SLOT_BACKEND_PREFIX,
    SLOT_SERVER,
    SLOTS_MAP,
    TENANT_REFUSAL_TABLE,
    TENANT_TABLE,
    TOKENS_TABLE,
    TOKENS_WINDOW_S,
    USAGE_FRONTEND,
    VAR_ACCESS,
    VAR_ASKED_CLASS,
    VAR_CLASS,
    VAR_MODEL,
    VAR_OFFSET,
    VAR_SLOT,
    VAR_TENANT,
    PlatformHAProxySettings,
    TenantRoute,
    slot_backend,
)
from infra.haproxy.process import write_private
from infra.haproxy.protection import REFUSAL_TABLE, protection_lines, protection_tables

# The stick counter that tracks a tenant's tokens (sc0-sc2 are taken: see the global section).
TOKENS_COUNTER = 3
# A tenant over its requests in flight may retry as soon as one of them ends: say one second.
TENANT_LIMIT_RETRY_AFTER_S = 1
# A request that waited out the queue timeout: the queue moves whenever a stream ends, so soon.
QUEUE_TIMEOUT_RETRY_AFTER_S = 1
# The requests-per-minute window (`http_req_rate`), and its Retry-After: the window has passed by then.
RATE_WINDOW_S = 60
# A slot server stands for a team's frontend, checked by a TCP connect: one that stopped listening is out after
# `fall` failed checks (~2 s), so new requests get 503 `model_unavailable` at once instead of queueing for it.
# Whether its own replicas are up is the team frontend's to answer. Until attached, a slot's server is disabled,
# at an address nothing listens on.
TEAM_CHECK = "check inter 1s fall 2 rise 2"
UNATTACHED_ADDRESS = "127.0.0.1:1"
# Refusal reasons a tenant can meet (room in the table; queue timeouts are counted on the tenant's entry).
TENANT_REFUSAL_REASONS = (
    REASON_MODEL_MISSING,
    REASON_MODEL_NOT_FOUND,
    REASON_MODEL_UNAVAILABLE,
    REASON_QUOTA_EXCEEDED,
    REASON_TENANT_LIMIT,
)
NOT_FOUND_MESSAGE = "no such model for this API key"


def _counted(track: list[str], status: int, reason: str, message: str, condition: str, *headers: str) -> list[str]:
    """Count a refusal (`track`: the rules that do), then answer it; headers are log-format."""
    extra = "".join(f" hdr {header}" for header in headers)
    body = openai_error_body(f"sluice refused the request: {message}", status)
    return [
        *track,
        f"    http-request return status {status} content-type application/json"
        f" hdr {SERVE_REASON_HEADER} {reason}{extra} string '{body}' if {condition}",
    ]


def _tenant_refusal(status: int, reason: str, message: str, condition: str, *headers: str) -> list[str]:
    """A refusal counted by `<tenant>/<reason>` (a stream tracks sc2 once: one refusal per request)."""
    track = (
        f"    http-request track-sc2 var({VAR_TENANT}),concat(/{reason}) table {TENANT_REFUSAL_TABLE} if {condition}"
    )
    return _counted([track], status, reason, message, condition, *headers)


def _key_lines(settings: PlatformHAProxySettings) -> list[str]:
    condition = f"!{{ var({VAR_TENANT}) -m found }}"
    track = f"    http-request track-sc2 str({REASON_INVALID_API_KEY}) table {REFUSAL_TABLE} if {condition}"
    return [
        "    # The tenant: the key's digest in the keys map (keys are never stored, logged or forwarded).",
        f"    http-request set-var({VAR_TENANT}) http_auth_bearer,sha2(256),hex,lower,"
        f"map({settings.map_path(KEYS_MAP)})",
        *_counted(
            [track],
            401,
            REASON_INVALID_API_KEY,
            "a valid API key is required (Authorization: Bearer <key>)",
            condition,
            'www-authenticate "Bearer"',
        ),
        f"    http-request del-header {AUTHORIZATION_HEADER}",
    ]


def _quota_lines(settings: PlatformHAProxySettings) -> list[str]:
    lines = [
        "    # The tenant's quotas, on its own entry: one tenant over its quota leaves the others untouched.",
        f"    http-request track-sc0 var({VAR_TENANT}) table {TENANT_TABLE}",
    ]
    for tenant in settings.tenants:
        this = f"{{ var({VAR_TENANT}) -m str {tenant.name} }}"
        if tenant.max_concurrent_requests is not None:
            lines += _tenant_refusal(
                429,
                REASON_TENANT_LIMIT,
                f"over {tenant.max_concurrent_requests} requests in flight for this tenant",
                f"{this} {{ sc0_conn_cur gt {tenant.max_concurrent_requests} }}",
                f"{RETRY_AFTER_HEADER} {TENANT_LIMIT_RETRY_AFTER_S}",
            )
        if tenant.requests_per_minute is not None:
            lines += _tenant_refusal(
                429,
                REASON_QUOTA_EXCEEDED,
                f"over {tenant.requests_per_minute} requests per minute for this tenant",
                f"{this} {{ sc0_http_req_rate gt {tenant.requests_per_minute} }}",
                f"{RETRY_AFTER_HEADER} {RATE_WINDOW_S}",
            )
    if _token_quotas(settings):
        lines.append(f"    http-request track-sc{TOKENS_COUNTER} var({VAR_TENANT}) table {TOKENS_TABLE}")
    for tenant in _token_quotas(settings):
        lines += _tenant_refusal(
            429,
            REASON_QUOTA_EXCEEDED,
            f"over {tenant.tokens_per_minute} tokens per minute for this tenant",
            f"{{ var({VAR_TENANT}) -m str {tenant.name} }}"
            f" {{ sc_gpc_rate(0,{TOKENS_COUNTER}) ge {tenant.tokens_per_minute} }}",
            f"{RETRY_AFTER_HEADER} {TOKENS_WINDOW_S}",
        )
    return lines


def _token_quotas(settings: PlatformHAProxySettings) -> list[TenantRoute]:
    """The tenants with a token quota, when the platform has a usage listener to count their tokens."""
    if settings.usage_port is None:
        return []
    return [tenant for tenant in settings.tenants if tenant.tokens_per_minute is not None]


def _usage_headers(settings: PlatformHAProxySettings) -> list[str]:
    """For a tenant with a token quota: the tenant and where its replica reports its tokens, with the cluster's
    credential (an attached stack's HAProxy passes the first two on only with it)."""
    tenants = _token_quotas(settings)
    if not tenants or settings.internal_credential is None:
        return []
    quota = " ".join(f"{{ var({VAR_TENANT}) -m str {tenant.name} }}" for tenant in tenants)
    url = f"http://{settings.bind_host}:{settings.usage_port}{USAGE_PATH}"
    return [
        "    # A tenant with a token quota: its replica reports the request's tokens to the usage listener.",
        f"    http-request set-header {TENANT_HEADER} %[var({VAR_TENANT})] if {quota}",
        f"    http-request set-header {USAGE_URL_HEADER} {url} if {quota}",
        f"    http-request set-header {INTERNAL_CREDENTIAL_HEADER} {settings.internal_credential.get_secret_value()}"
        f" if {quota}",
    ]


def _usage_frontend(settings: PlatformHAProxySettings) -> list[str]:
    """Where the replicas report a tenant's tokens: with the cluster's credential only, counted on the tenant's
    entry of the tokens table (a rate over `TOKENS_WINDOW_S`), answered 204."""
    if not _token_quotas(settings) or settings.internal_credential is None:
        return []
    credential = settings.internal_credential.get_secret_value()
    report = f"{{ method POST }} {{ path {USAGE_PATH} }} {{ req.hdr({TENANT_HEADER}) -m found }}"
    return [
        f"frontend {USAGE_FRONTEND}",
        f"    bind {settings.bind_host}:{settings.usage_port}",
        "    no log",
        f"    http-request deny status 403 unless {{ req.hdr({INTERNAL_CREDENTIAL_HEADER}) -m str {credential} }}",
        f"    http-request deny status 404 unless {report}",
        f"    http-request track-sc0 req.hdr({TENANT_HEADER}) table {TOKENS_TABLE}",
        f"    http-request sc-add-gpc(0,0) req.hdr({TOKENS_HEADER}),add(0)",
        "    http-request return status 204",
        "",
    ]


def _model_lines(settings: PlatformHAProxySettings) -> list[str]:
    slot = f"{{ var({VAR_SLOT}) -m found }}"
    return [
        "    # The tenant's own models list.",
        f"    http-request use-service lua.{LUA_MODELS_SERVICE} if {{ method GET }} {{ path {MODELS_PATH} }}",
        "    # The model: its header (read above), else the body's top-level `model` (the body is whole by now).",
        f"    http-request set-var({VAR_MODEL}) req.body,json_query('{MODEL_JSON_PATH}')"
        f" unless {{ var({VAR_MODEL}) -m found }}",
        *_tenant_refusal(
            400,
            REASON_MODEL_MISSING,
            f"name the model in the body or the {MODEL_HEADER} header",
            f"!{{ var({VAR_MODEL}) -m found }}",
        ),
        "    # Not callable by this tenant, or not attached: the same answer.",
        f'    http-request set-var-fmt({VAR_ACCESS}) "%[var({VAR_TENANT})]{ACCESS_SEPARATOR}%[var({VAR_MODEL})]"',
        f"    http-request set-var({VAR_SLOT}) var({VAR_MODEL}),map({settings.map_path(MODELS_MAP)})"
        f" if {{ var({VAR_ACCESS}),map({settings.map_path(ACCESS_MAP)}) -m found }}",
        *_tenant_refusal(404, REASON_MODEL_NOT_FOUND, NOT_FOUND_MESSAGE, f"!{slot}"),
        *_usage_headers(settings),
        f"    use_backend {SLOT_BACKEND_PREFIX}%[var({VAR_SLOT})] if {slot}",
    ]


def _queue_timeout_lines() -> list[str]:
    """HAProxy answers a request that waited out `timeout queue` with its own 503 (no server was assigned): it is
    the platform's 429 (the slot backends' error page already holds its body and reason). The status goes last:
    the rules before it match the 503."""
    timed_out = (
        f"{{ status 503 }} !{{ srv_id -m found }} {{ res.hdr({SERVE_REASON_HEADER}) -m str {REASON_QUEUE_TIMEOUT} }}"
    )
    return [
        f"    http-after-response set-header {RETRY_AFTER_HEADER} {QUEUE_TIMEOUT_RETRY_AFTER_S} if {timed_out}",
        f"    http-after-response sc-inc-gpc0(0) if {timed_out}",
        f"    http-after-response set-status 429 if {timed_out}",
    ]


def _slot_backend_lines(settings: PlatformHAProxySettings, slot: int) -> list[str]:
    return [
        f"backend {slot_backend(slot)}",
        f"    timeout queue {haproxy_time(settings.queue_timeout_s)}",
        "    # HAProxy's own 503 here: a queue timeout, or a team frontend that did not answer (the Lua tells which).",
        f"    http-error status 503 content-type application/json hdr {SERVE_REASON_HEADER}"
        f" %[lua.{LUA_UNSERVED_REASON_FETCH}] lf-string '%[lua.{LUA_UNSERVED_BODY_FETCH}]'",
        *_tenant_refusal(503, REASON_MODEL_UNAVAILABLE, "the team frontend of the model is not up", "{ nbsrv eq 0 }"),
        "    # Class, then fair share within it (infra/haproxy/platform_lua.py).",
        f"    http-request lua.{LUA_ADMIT_ACTION}",
        f"    http-request set-priority-class var({VAR_CLASS})",
        f"    http-request set-priority-offset var({VAR_OFFSET})",
        f"    http-response lua.{LUA_ADMITTED_ACTION}",
        f"    server {SLOT_SERVER} {UNATTACHED_ADDRESS} disabled maxconn 1 {TEAM_CHECK}",
        "",
    ]


def render_platform_config(settings: PlatformHAProxySettings) -> str:
    """The whole haproxy.cfg of a platform."""
    tenants = len(settings.tenants)
    lines = [
        "# Rendered by infra/haproxy/platform_cfg.py from base/contracts.py: do not edit by hand.",
        "global",
        "    master-worker",
        f"    stats socket {settings.socket_path} mode 600 level admin",
        "    stats timeout 30s",
        f"    hard-stop-after {haproxy_time(settings.hard_stop_after_s)}",
        f"    maxconn {settings.maxconn}",
        "    # One Lua state for all threads: the fair-share clocks are the platform's, not a thread's.",
        f"    lua-load {settings.lua_path}",
        f"    tune.maxrewrite {settings.tune_maxrewrite}",
        "    # A whole request fits: the model may be read from the body.",
        f"    tune.bufsize {settings.tune_bufsize}",
        f"    # sc0 the tenant, sc1 a client's limits, sc2 refusals, sc{TOKENS_COUNTER} the tenant's tokens.",
        f"    tune.stick-counters {TOKENS_COUNTER + 1}",
        "",
    ]
    lines += defaults_lines(settings)
    lines += [
        "",
        f"frontend {PROMETHEUS_FRONTEND}",
        f"    bind {settings.bind_host}:{settings.prometheus_port}",
        "    no log",
        f"    http-request use-service prometheus-exporter if {{ path {PROMETHEUS_PATH} }}",
        f"    http-request use-service lua.{LUA_METRICS_SERVICE} if {{ path {SLUICE_METRICS_PATH} }}",
        "    http-request return status 404",
        "",
        f"frontend {PLATFORM_FRONTEND}",
        f"    bind {settings.bind_host}:{settings.port}",
        "    # A client can neither pin a replica nor forge a capacity token: the platform's own headers are read",
        "    # first, then every internal header goes.",
        f"    http-request set-var({VAR_MODEL}) req.hdr({MODEL_HEADER}) if {{ req.hdr({MODEL_HEADER}) -m found }}",
        f"    http-request set-var({VAR_ASKED_CLASS}) req.hdr({PRIORITY_HEADER})"
        f" if {{ req.hdr({PRIORITY_HEADER}) -m found }}",
        *(f"    http-request del-header {prefix} -m beg" for prefix in INTERNAL_HEADER_PREFIXES),
        f"    http-request del-header {DATA_PARALLEL_RANK_HEADER}",
        *_key_lines(settings),
        *_quota_lines(settings),
        # No key list here: the tenants' keys are the keys map, checked above.
        *protection_lines(settings.protection, keys_acl=""),
        *_model_lines(settings),
        *_queue_timeout_lines(),
        "",
        *_usage_frontend(settings),
    ]
    for slot in range(settings.model_slots):
        lines += _slot_backend_lines(settings, slot)
    lines += [
        f"backend {TENANT_TABLE}",
        "    # Per tenant: requests in flight (conn_cur of an http-request tracker), per minute, in all, and its queue",
        "    # timeouts (gpc0). A few fixed tenants: no expiry, no eviction.",
        f"    stick-table type string len 64 size {tenants * 4}"
        f" store conn_cur,http_req_rate({RATE_WINDOW_S}s),http_req_cnt,gpc0",
        "",
        *counter_table_lines(
            TENANT_REFUSAL_TABLE,
            "Refusals by `<tenant>/<reason>`.",
            tenants * len(TENANT_REFUSAL_REASONS),
            key_bytes=96,
        ),
        f"backend {TOKENS_TABLE}",
        f"    # Per tenant: the tokens its replicas reported, in all and per {TOKENS_WINDOW_S} s.",
        f"    stick-table type string len 64 size {tenants * 4} store gpc(1),gpc_rate(1,{TOKENS_WINDOW_S}s)",
        "",
        *protection_tables(settings.protection),
    ]
    return "\n".join(lines)


def _map_text(entries: dict[str, str]) -> str:
    return "".join(f"{key} {value}\n" for key, value in sorted(entries.items()))


def write_platform_files(
    settings: PlatformHAProxySettings,
    keys: dict[str, str],
    access: set[tuple[str, str]],
    models: dict[str, int],
) -> None:
    """Write the config, the Lua and the maps into the workdir: `keys` key digest -> tenant, `access` the (tenant,
    model) pairs allowed, `models` attached model -> slot (its slot server is set by `platform_runtime.attach_model`;
    until then the model answers 503 `model_unavailable`)."""
    tenants = {tenant.name for tenant in settings.tenants}
    unknown = sorted({tenant for tenant in keys.values()} - tenants | {tenant for tenant, _ in access} - tenants)
    if unknown:
        raise ValueError(f"keys or access name tenants the platform does not have: {', '.join(unknown)}")
    bad_models = sorted(
        model for model in {*models, *(model for _, model in access)} if not MODEL_NAME_PATTERN.match(model)
    )
    if bad_models:
        raise ValueError(f"model names that cannot be served: {bad_models}")
    if any(not 0 <= slot < settings.model_slots for slot in models.values()) or len(set(models.values())) < len(models):
        raise ValueError(f"each model needs a slot of its own in 0..{settings.model_slots - 1}: {models}")
    settings.workdir.mkdir(parents=True, exist_ok=True)
    maps = {
        KEYS_MAP: keys,
        ACCESS_MAP: {f"{tenant}{ACCESS_SEPARATOR}{model}": "1" for tenant, model in access},
        MODELS_MAP: {model: str(slot) for model, slot in models.items()},
        SLOTS_MAP: {str(slot): model for model, slot in models.items()},
    }
    for name, entries in maps.items():
        settings.map_path(name).write_text(_map_text(entries))
    # Private, like a stack's: they name the platform's tenants and where its teams listen.
    write_private(settings.lua_path, render_platform_lua(settings))
    write_private(settings.config_path, render_platform_config(settings))
