"""The frontend's half of the canary between the direct path and the retained legacy ingress.

Path choice by the run-time direct weight (a map, sticky per session), a legacy backend per app, the request log
line (`log_format`), the automatic-rollback table and the running-request table that refuses a duplicate
`x-request-id` with 409. Details: infra/haproxy/README.md (the canary's pieces).
"""

from __future__ import annotations

from base.contracts import (
    CANARY_CRITERIA,
    DIRECT_WEIGHT_MAX,
    HEALTH_PATH,
    LEGACY_PATH,
    REASON_DUPLICATE_REQUEST,
    REASON_REPLICA_ERROR,
    REPLICA_HEADER,
    SERVE_PATH_HEADER,
    SERVE_REASON_HEADER,
)
from infra.haproxy.formatting import counter_table_lines, openai_error_body

LEGACY_BACKEND = "sluice_legacy"
RUNNING_TABLE = "sluice_running"
VAR_PATH = "txn.sluice_path"
VAR_APP = "txn.sluice_app"
VAR_SERVED = "txn.sluice_served"
# Microseconds the route call took as the Lua action saw it (connect, send, the router's reply).
VAR_ROUTE_US = "txn.sluice_route_us"
LOG_TAG = "sluice"
ROLLBACK_TABLE = "sluice_canary_rollbacks"
# The counter a rollback table entry holds (set, never tracked: no request touches the table).
ROLLBACK_COUNTER = "gpc0"
# sc0..sc2 count fallbacks, clients and refusals; the running-request table takes the fourth.
RUNNING_COUNTER = 3
STICK_COUNTERS = 4
# Request ids the table holds: every running one, and finished ones until they expire.
RUNNING_TABLE_SIZE = 200_000
RUNNING_EXPIRE_S = 30
WEIGHTS_MAP = "direct_weights.map"
LOG_SOCKET = "requests.sock"


def legacy_backend(index: int) -> str:
    return LEGACY_BACKEND if index == 0 else f"{LEGACY_BACKEND}_{index}"


def log_format(var_request_id: str, var_reason: str) -> str:
    """One line per finished request: tag, app, path, status, ms to the response headers, total ms, termination
    state, the server HAProxy sent it to (the pinned replica on the direct path), the replica that served it, µs the
    route call took (`-` without one), why it was not routed as ranked (the fail-closed 503's or the fallback's
    reason, `-` without one), the request id (`services.frontend.path_log.parse_record` reads it)."""
    return (
        f"{LOG_TAG} %[var({VAR_APP})] %[var({VAR_PATH})] %ST %Tr %Ta %ts %s %[var({VAR_SERVED})]"
        f" %[var({VAR_ROUTE_US})] %[var({var_reason})] %[var({var_request_id})]"
    )


def weights_map(app_names: list[str], direct_weight: int) -> str:
    """The map file's content: each app's direct weight."""
    if not 0 <= direct_weight <= DIRECT_WEIGHT_MAX:
        raise ValueError(f"direct weight {direct_weight} is not within 0..{DIRECT_WEIGHT_MAX}")
    return "".join(f"{name} {direct_weight}\n" for name in app_names)


def duplicate_lines(var_request_id: str) -> list[str]:
    """Track every request by its id; refuse one whose id another running request holds."""
    key = f"var({var_request_id}),sha1"
    body = openai_error_body(
        "a request with this x-request-id (%[var(" + var_request_id + ")]) is still running: wait for its answer, "
        "or send a new id",
        409,
    )
    return [
        "    # A retry of a request that still runs gets 409, never a second generation (either path).",
        f"    http-request track-sc{RUNNING_COUNTER} {key} table {RUNNING_TABLE}",
        f"    http-request return status 409 content-type application/json lf-string '{body}'"
        f" hdr {SERVE_REASON_HEADER} {REASON_DUPLICATE_REQUEST}"
        f" if {{ sc_conn_cur({RUNNING_COUNTER},{RUNNING_TABLE}) gt 1 }}",
    ]


def served_replica_line() -> str:
    return f"    http-response set-var({VAR_SERVED}) res.hdr({REPLICA_HEADER})"


def legacy_backend_lines(name: str, health_lines: list[str]) -> list[str]:
    return [
        f"backend {name}",
        "    # The retained legacy ingress replicas (the syncer adds and removes them), load-balanced.",
        "    balance leastconn",
        *health_lines,
        *served_path_lines(LEGACY_PATH),
        "",
    ]


def served_path_lines(path: str) -> list[str]:
    """A path's backend marks its responses with the path, and its 5xx without a reason with `replica_error`."""
    return [
        f"    http-response set-header {SERVE_REASON_HEADER} {REASON_REPLICA_ERROR}"
        f" if {{ status ge 500 }} !{{ res.hdr({SERVE_REASON_HEADER}) -m found }}",
        f"    http-response set-header {SERVE_PATH_HEADER} {path}",
    ]


def running_table_lines() -> list[str]:
    return [
        f"backend {RUNNING_TABLE}",
        "    # Request ids (SHA-1) with the number of requests running under each.",
        f"    stick-table type binary len 20 size {RUNNING_TABLE_SIZE} expire {RUNNING_EXPIRE_S}s store conn_cur",
        "",
    ]


def rollback_table_lines() -> list[str]:
    comment = "The canary's automatic rollbacks by the criterion breached (the frontend replica sets the counts)."
    return counter_table_lines(ROLLBACK_TABLE, comment, len(CANARY_CRITERIA), store=ROLLBACK_COUNTER)


def health_check_lines() -> list[str]:
    return [f"    option httpchk GET {HEALTH_PATH}", "    http-check expect status 200"]
