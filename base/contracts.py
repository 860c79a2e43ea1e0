"""The one source of truth for sluice's wire contract: header names, reason strings, defaults.

Everything else (services, routers, the HAProxy template and its Lua) imports or is rendered from
this module; nothing here is repeated by hand elsewhere.
"""

from __future__ import annotations

from typing import Literal

# Headers (lower-case: HTTP/1.1 header names are case-insensitive and ASGI lower-cases them).
REQUEST_ID_HEADER = "x-request-id"
REPLICA_HEADER = "x-serve-replica"
# On the legacy path's responses: the replica the deployment's request router chose (`choose_replica`); the replica
# that served still stamps `x-serve-replica`, so the two can be compared.
CHOSEN_REPLICA_HEADER = "x-serve-chosen-replica"
SESSION_HEADER_DEFAULT = "x-session-id"
CAPACITY_TOKEN_HEADER = "x-sluice-capacity-token"
BODY_TRUNCATED_HEADER = "x-body-truncated"
# W3C trace context (docs/stacks.md, Tracing): a client's is handed to the router's decision; the router's
# span's replaces it on the forwarded request, so the replica's and vLLM's spans join the same trace.
TRACEPARENT_HEADER = "traceparent"
# On HAProxy's HTTP route call: the milliseconds left of its route timeout, which the router answers within (a
# capacity wait ends there with its own reason rather than HAProxy's `router_unreachable`).
ROUTE_BUDGET_HEADER = "x-sluice-route-budget-ms"
# `x-body-truncated: <have>/<total>`; the total of a chunked body HAProxy did not hold to its end is unknown: `*`
# (as in HTTP's Content-Range).
BODY_TOTAL_UNKNOWN = "*"
SERVE_REASON_HEADER = "x-serve-reason"
SERVE_FALLBACK_HEADER = "x-serve-fallback"
# Set on a response served by the replica at rank k >= 1 of the router's ranked list (0 = the primary).
FALLBACK_RANK_HEADER = "x-serve-fallback-rank"
# Sent by the frontend on every route call: which frontend (HAProxy) asks, so the router ranks only the
# replicas that frontend can route to.
FRONTEND_HEADER = "x-sluice-frontend"
# On every response a path served: which one, `direct` (HAProxy -> replica) or `legacy` (the Python ingress).
SERVE_PATH_HEADER = "x-serve-path"
DIRECT_PATH = "direct"
LEGACY_PATH = "legacy"
# Between HAProxy's own frontends: the ranked replicas still to try when the pinned one refuses the connection.
RANKED_HEADER = "x-sluice-ranked"
INTERNAL_HEADER_PREFIXES = ("x-serve-", "x-sluice-")
# Data parallel in one engine: vLLM's header naming the engine rank that serves a request (set by the frontend from
# the router's choice, stripped from clients), and its echo on the replica's response.
DATA_PARALLEL_RANK_HEADER = "x-data-parallel-rank"
SERVED_RANK_HEADER = "x-serve-data-parallel-rank"
# A router ranks (replica, engine rank) pairs of a data-parallel app as endpoint ids `<replica id>:<rank>`.
RANK_SEPARATOR = ":"
# Names the model of a request on a frontend with several models (read before the internal headers are stripped);
# without it the frontend reads the body's `model`.
MODEL_HEADER = "x-sluice-model"
MODELS_PATH = "/v1/models"
# Prefill/decode. The router's prefill choice, passed by the frontend to the decode replica it pins the request to.
PREFILL_REPLICA_HEADER = "x-sluice-prefill-replica"
PREFILL_URL_HEADER = "x-sluice-prefill-url"
# Set by an internal caller that ran the prefill itself: the decode replica takes the body's `kv_transfer_params`.
PREFILL_BY_CALLER_HEADER = "x-sluice-prefill-by-caller"
# On a decode replica's response: the replica that ran the prefill, and why it ran locally when it did.
SERVED_PREFILL_HEADER = "x-serve-prefill-replica"
PREFILL_FALLBACK_HEADER = "x-serve-prefill-fallback"
# On every response of a replica whose engine is a stand-in (benchmarks only, `LLMAppConfig.engine_stand_in`): which
# one. `zero_compute` answers `max_tokens` copies of one token without running the model.
ENGINE_STAND_IN_HEADER = "x-serve-engine-stand-in"
ZERO_COMPUTE_STAND_IN = "zero_compute"
# The simulator engine (`engine: sim`, services/replica/sim/): timed from a stated model, no model runs.
SIM_STAND_IN = "sim"
# Checked by the frontend when a stack turns API keys on, then removed: a replica never sees it.
AUTHORIZATION_HEADER = "authorization"
# Set by HAProxy on every request it forwards (and by every internal caller): the cluster's secret, without which the
# ports past the frontend refuse a request (services/internal_credential.py). A client's is stripped like any
# `x-sluice-` header.
INTERNAL_CREDENTIAL_HEADER = "x-sluice-internal"
RETRY_AFTER_HEADER = "retry-after"

# Routing failure reasons (HAProxy -> client, `X-Serve-Reason`).
REASON_ROUTER_UNREACHABLE = "router_unreachable"
REASON_ROUTER_NON_200 = "router_non_200"
REASON_UNPARSEABLE_REPLICA_ID = "unparseable_replica_id"
REASON_UNKNOWN_REPLICA_ID = "unknown_replica_id"
# Errors HAProxy itself produces after routing (each carries `X-Serve-Reason` and an OpenAI-style body).
REASON_REPLICA_UNAVAILABLE = "replica_unavailable"  # 503: no ranked replica could take the connection
REASON_REPLICA_FAILED = "replica_failed"  # 502: the replica closed or answered garbage before its headers
REASON_REPLICA_TIMEOUT = "replica_timeout"  # 504: no response headers within the server timeout
REASON_FRONTEND_ERROR = "frontend_error"  # 500: an internal error of the frontend itself
# A 5xx the replica sent itself without a reason gets this one.
REASON_REPLICA_ERROR = "replica_error"
# The frontend's protection of the replicas: refused before any route call (`infra/haproxy/protection.py`).
REASON_INVALID_API_KEY = "invalid_api_key"  # 401: no, or no valid, `Authorization: Bearer` key
REASON_REQUEST_TIMEOUT = "request_timeout"  # 408: the body did not arrive whole within the request timeout
REASON_BODY_TOO_LARGE = "body_too_large"  # 413: a body over the stack's maximum
REASON_URL_TOO_LONG = "url_too_long"  # 414: a request line over the maximum
REASON_CLIENT_LIMIT = "client_limit"  # 429: the client is over its concurrency or rate limit
REASON_HEADERS_TOO_LARGE = "headers_too_large"  # 431: headers over the maximum
REASON_TLS_REQUIRED = "tls_required"  # 403: an API key on the plain-HTTP port of a frontend with TLS
# 403 from a replica, router or legacy port reached without the internal credential (not through the frontend).
REASON_INTERNAL_CREDENTIAL = "internal_credential"
PROTECTION_REASONS = {
    401: REASON_INVALID_API_KEY,
    403: REASON_TLS_REQUIRED,
    408: REASON_REQUEST_TIMEOUT,
    413: REASON_BODY_TOO_LARGE,
    414: REASON_URL_TOO_LONG,
    429: REASON_CLIENT_LIMIT,
    431: REASON_HEADERS_TOO_LARGE,
}
# The frontend serves the public API alone: vLLM's OpenAI paths (`/v1/...`, the models list among them) and its
# health; any other path (a replica's `/tokenize`, `/metrics`, a router's `/internal/...`) is 404 before routing.
PUBLIC_PATH_PREFIX = "/v1/"
PUBLIC_PATHS = ("/health",)
REASON_UNKNOWN_PATH = "unknown_path"  # 404: a path outside the public API
# A frontend with several models refuses a request whose model it cannot tell (before any route call).
REASON_MODEL_NOT_FOUND = "model_not_found"  # 404: a model this frontend does not serve
REASON_MODEL_MISSING = "model_missing"  # 400: neither the header nor the body names a model
REASON_MODEL_BEYOND_BUFFER = "model_beyond_buffer"  # 400: no `model` within the body bytes the frontend reads
MODEL_REASONS = {REASON_MODEL_NOT_FOUND: 404, REASON_MODEL_MISSING: 400, REASON_MODEL_BEYOND_BUFFER: 400}
# One platform for many teams (topologies/platform.py): a request's class (`PRIORITY_CLASSES`, first = served first),
# asked for in this header and clamped to its tenant's ceiling; the platform's own refusals.
PRIORITY_HEADER = "x-sluice-priority"
PRIORITY_CLASSES = ("interactive", "batch")
REASON_QUOTA_EXCEEDED = "quota_exceeded"  # 429: the tenant is over a requests or tokens per minute quota
REASON_TENANT_LIMIT = "tenant_limit"  # 429: the tenant is over its requests in flight
REASON_QUEUE_TIMEOUT = "queue_timeout"  # 429: the model stayed at capacity for the whole admission wait
REASON_MODEL_UNAVAILABLE = "model_unavailable"  # 503: the model's team is attached but its frontend is not up
# Platform -> an attached stack's HAProxy -> the LLM replica, for a tenant with a token quota (kept past the stack's
# HAProxy only with the cluster's internal credential): the tenant, and where the replica reports its tokens; the
# replica's report carries the tokens to the platform's usage listener at `USAGE_PATH`.
TENANT_HEADER = "x-sluice-tenant"
USAGE_URL_HEADER = "x-sluice-usage"
TOKENS_HEADER = "x-sluice-tokens"
USAGE_PATH = "/internal/usage"
PLATFORM_REASONS = {
    REASON_QUOTA_EXCEEDED: 429,
    REASON_TENANT_LIMIT: 429,
    REASON_QUEUE_TIMEOUT: 429,
    REASON_MODEL_UNAVAILABLE: 503,
}
# A decode replica's prefill phase: the chosen prefill replica failed (or was unreachable, or gave no KV transfer
# parameters), or no prefill replica was chosen for the request (it reached the decode replica without a router).
REASON_PREFILL_FAILED = "prefill_failed"  # 502
REASON_PREFILL_UNROUTED = "prefill_unrouted"  # 503
# The router found no prefill replica to pair with the decode replica.
REASON_NO_PREFILL_REPLICA = "no_prefill_replica"

# Why the frontend passed over the router's primary (the fallback counter's `reason` label).
FALLBACK_ABSENT = "absent"  # not (or no longer) in the frontend's server set
FALLBACK_DOWN = "down"  # DOWN by health check or observed connection errors, or leaving (maintenance)
FALLBACK_REFUSED = "refused"  # the connection failed before any byte was sent
FALLBACK_REASONS = (FALLBACK_ABSENT, FALLBACK_DOWN, FALLBACK_REFUSED)

# The canary between the paths. A client that retries with the `x-request-id` of a request still running gets 409
# with this reason (on either path) instead of a second generation.
REASON_DUPLICATE_REQUEST = "duplicate_request"
# Staging only: a router made to fail answers every route call with this reason (503 at the frontend).
REASON_INJECTED_FAULT = "injected_fault"
FAULT_PATH = "/internal/fault"
# Staging only: a request carrying this header waits at most `STAGING_SERVER_TIMEOUT_S` for its replica (HAProxy's
# server timeout, cut short), then gets HAProxy's 504 `replica_timeout` (`sluice check`'s timeout cleanup item).
STAGING_TIMEOUT_HEADER = "x-sluice-staging-timeout"
STAGING_SERVER_TIMEOUT_S = 0.5
# Share of sessions on the direct path, in percent (the canary weight).
DIRECT_WEIGHT_MAX = 100
# The canary's abort criteria, in the order the guard checks them: the `reason` of an automatic rollback
# (`sluice_canary_rollbacks_total`).
CANARY_CRITERIA = ("ratio_503", "ttft_p99_s", "stream_error_ratio", "replica_imbalance")

# Replica defaults.
HEALTH_PATH = "/-/healthz"
# Where a replica (under its app's route prefix) says where its engine publishes KV events (`KVEventSources`).
KV_EVENTS_PATH = "/internal/kv-events"
# Where a replica (under its app's route prefix) says how loaded its engine is now (`EngineLoads`): the token load a
# cache-aware router weighs against a cached prefix.
ENGINE_LOAD_PATH = "/internal/engine-load"
# A replica's Ray and vLLM versions (`ComponentVersions`), for `sluice check`.
VERSIONS_PATH = "/internal/versions"
DEFAULT_BIND_HOST = "127.0.0.1"
DEFAULT_MAX_ONGOING_REQUESTS = 32
DEFAULT_DRAIN_GRACE_S = 30.0

# Stacks across nodes (containers, KubeRay): each node advertises its role as a custom Ray resource, and every
# deployment asks for a sliver of its role's, so the frontend and routers run on the head (the frontend's address is
# the stack's) and the LLM replicas on the workers. A node advertises NODE_ROLE_CAPACITY; an actor takes
# NODE_ROLE_PER_ACTOR (a million actors per node: never the constraint, only the placement).
HEAD_NODE_RESOURCE = "sluice_head"
WORKER_NODE_RESOURCE = "sluice_worker"
NODE_ROLE_CAPACITY = 1000
NODE_ROLE_PER_ACTOR = 0.001
# Serve's per-replica ports bind this on a node of a multi-node stack: inside a container or pod that is its own
# network namespace (loopback and the private cluster network), never the host's.
NODE_BIND_ALL = "0.0.0.0"
NodeRole = Literal["head", "worker"]


def node_role_resources(role: NodeRole | None) -> dict[str, float]:
    """The custom resources an actor of a stack across nodes asks for, to run on its role's nodes; none on one
    machine (`role` None)."""
    if role is None:
        return {}
    return {HEAD_NODE_RESOURCE if role == "head" else WORKER_NODE_RESOURCE: NODE_ROLE_PER_ACTOR}


# Direct-streaming data plane (HAProxy -> router -> replica).
ROUTE_PATH = "/internal/route"
# The frontend's syncer publishes the replica ids it can route to here, on every router replica.
MEMBERSHIP_PATH = "/internal/membership"
# A frontend publishes at least this often, unchanged or not: a router that missed a publication (or restarted and
# lost it) has the set again within this.
PUBLISH_HEARTBEAT_S = 2.0
# A router forgets a frontend that published nothing for this long (three heartbeats missed: it went away), so its
# last set no longer narrows the common set and its last open requests no longer count as load.
PUBLICATION_TTL_S = 3 * PUBLISH_HEARTBEAT_S
# Table decisions (opt-in per stack): a router whose policy is a pure function of the replica set (a rotation, a
# hash ring) publishes that set here (`RouteTable`), and the frontend's Lua decides each request from it, with no
# route call. Each HAProxy thread fetches it every TABLE_REFRESH_S and holds it TABLE_LEASE_S at most: a router that
# stops answering, refuses (a fault, no replica), leaves or goes DOWN takes its table with it, and requests go back to
# route calls (which fail closed as before).
ROUTE_TABLE_PATH = "/internal/route-table"
TABLE_REFRESH_S = 0.25
TABLE_LEASE_S = 1.0
TABLE_ROTATION = "rotation"
TABLE_RING = "ring"
TABLE_KINDS = (TABLE_ROTATION, TABLE_RING)
# 404 from a router whose policy decides each request itself (load, tokens, the prompt): it has no table.
REASON_NO_TABLE = "no_table"
APP_HEADER = "x-sluice-app"
HAPROXY_PORT_DEFAULT = 8000
HAPROXY_PROMETHEUS_PORT_DEFAULT = 8404
ROUTE_TIMEOUT_S_DEFAULT = 5.0
# Frontend protection defaults: a chat request's body and headers fit with room to spare.
REQUEST_TIMEOUT_S_DEFAULT = 10.0
MAX_BODY_BYTES_DEFAULT = 8 * 1024 * 1024
MAX_HEADER_BYTES_DEFAULT = 16 * 1024
MAX_URL_BYTES_DEFAULT = 8 * 1024
# Router reply when no replica can be chosen (policy reasons such as `capacity_timeout` pass through).
REASON_NO_REPLICA = "no_replica"
# A router whose decision raised answers the route call with this reason (500) instead of dropping the call.
REASON_ROUTER_ERROR = "router_error"
FAIL_CLOSED_REASONS = (
    REASON_ROUTER_UNREACHABLE,
    REASON_ROUTER_NON_200,
    REASON_UNPARSEABLE_REPLICA_ID,
    REASON_UNKNOWN_REPLICA_ID,
)
# Reason of each error status HAProxy can generate itself once a request exists (a request it cannot parse
# at all gets its built-in 400 page from the connection layer, where no reason can be attached).
HAPROXY_ERROR_REASONS = {
    408: REASON_REQUEST_TIMEOUT,
    500: REASON_FRONTEND_ERROR,
    502: REASON_REPLICA_FAILED,
    503: REASON_REPLICA_UNAVAILABLE,
    504: REASON_REPLICA_TIMEOUT,
}
