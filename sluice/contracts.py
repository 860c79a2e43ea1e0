"""The one source of truth for sluice's wire contract: header names, reason strings, defaults.

Everything else (services, routers, the HAProxy template and its Lua) imports or is rendered from
this module; nothing here is repeated by hand elsewhere.
"""

from __future__ import annotations

# Headers (lower-case: HTTP/1.1 header names are case-insensitive and ASGI lower-cases them).
REQUEST_ID_HEADER = "x-request-id"
REPLICA_HEADER = "x-serve-replica"
SESSION_HEADER_DEFAULT = "x-session-id"
CAPACITY_TOKEN_HEADER = "x-sluice-capacity-token"
BODY_TRUNCATED_HEADER = "x-body-truncated"
SERVE_REASON_HEADER = "x-serve-reason"
SERVE_FALLBACK_HEADER = "x-serve-fallback"
INTERNAL_HEADER_PREFIXES = ("x-serve-", "x-sluice-")

# Routing failure reasons (HAProxy -> client, `X-Serve-Reason`).
REASON_ROUTER_UNREACHABLE = "router_unreachable"
REASON_ROUTER_NON_200 = "router_non_200"
REASON_UNPARSEABLE_REPLICA_ID = "unparseable_replica_id"
REASON_UNKNOWN_REPLICA_ID = "unknown_replica_id"

# Replica defaults.
HEALTH_PATH = "/-/healthz"
DEFAULT_BIND_HOST = "127.0.0.1"
DEFAULT_MAX_ONGOING_REQUESTS = 32
DEFAULT_DRAIN_GRACE_S = 30.0

# Direct-streaming data plane (HAProxy -> router -> replica).
ROUTE_PATH = "/internal/route"
APP_HEADER = "x-sluice-app"
HAPROXY_PORT_DEFAULT = 8000
HAPROXY_PROMETHEUS_PORT_DEFAULT = 8404
ROUTE_TIMEOUT_S_DEFAULT = 5.0
# Router reply when no replica can be chosen (policy reasons such as `capacity_timeout` pass through).
REASON_NO_REPLICA = "no_replica"
FAIL_CLOSED_REASONS = (
    REASON_ROUTER_UNREACHABLE,
    REASON_ROUTER_NON_200,
    REASON_UNPARSEABLE_REPLICA_ID,
    REASON_UNKNOWN_REPLICA_ID,
)
