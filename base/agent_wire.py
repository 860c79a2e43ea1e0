"""The route call as HAProxy's SPOE sends it to a router's route agent (docs/design.md §3): one message per request
over persistent, pipelined connections, its arguments and the transaction variables the agent's answer sets.

Both ends come from here: `infra.haproxy.spoe` renders the message's arguments and the variables HAProxy may set,
the Lua action reads the variables by these names, and `services.router.route_listener` reads the arguments and
writes the variables. The values are those of the HTTP route call (`RouteReply` / `RouteRefusal`), flat: the
fallbacks joined by `FALLBACK_SEPARATOR` (no replica id contains it), absent fields left unset. A tracing frontend
adds the request's `traceparent` argument and registers the `traceparent` variable (`TRACE_VAR`).
"""

from __future__ import annotations

from collections.abc import Mapping

from base.contracts import BODY_TRUNCATED_HEADER, FRONTEND_HEADER, REQUEST_ID_HEADER, TRACEPARENT_HEADER
from base.route_wire import RouteRefusal, RouteReply

# The SPOE message (and its group) the frontend sends for every routed request.
MESSAGE = "sluice_route"
# HAProxy prefixes the variables an agent sets: `txn.<VAR_PREFIX>.<name>`.
VAR_PREFIX = "sluice_agent"
# Set by HAProxy (not the agent) when the exchange failed: SPOE's error code (1 timeout, 2 I/O error, ...).
ERROR_VAR = "error"
STATUS_VAR = "status"
REASON_VAR = "reason"
REPLY_VARS = tuple(RouteReply.model_fields)
# Set only by a tracing router, so registered (and its argument sent) only by a tracing frontend.
TRACE_VAR = "traceparent"
ANSWER_VARS = (STATUS_VAR, REASON_VAR, *REPLY_VARS)
assert TRACE_VAR in REPLY_VARS
FALLBACK_SEPARATOR = ","
# Message arguments: the route call's headers by their names, then the forwarded body.
BODY_ARG = "body"
HEADER_ARGS = (FRONTEND_HEADER, REQUEST_ID_HEADER, BODY_TRUNCATED_HEADER, TRACEPARENT_HEADER)

Answer = RouteReply | RouteRefusal


def answer_variables(status: int, answer: Answer) -> dict[str, str | int | None]:
    """The variables the agent sets for a route call's status and answer (None: left unset)."""
    if isinstance(answer, RouteRefusal):
        return {STATUS_VAR: status, REASON_VAR: answer.reason}
    return {
        STATUS_VAR: status,
        "replica_id": answer.replica_id,
        "fallbacks": FALLBACK_SEPARATOR.join(answer.fallbacks) or None,
        "capacity_token": answer.capacity_token,
        "prefill_replica_id": answer.prefill_replica_id,
        "prefill_url": answer.prefill_url,
        TRACE_VAR: answer.traceparent,
    }


def request_from_arguments(arguments: Mapping[str, object], session_header: str) -> tuple[dict[str, str], bytes]:
    """The route call's headers (lower-case names, empty values left out) and body from a message's arguments."""
    headers: dict[str, str] = {}
    for name in (*HEADER_ARGS, session_header):
        value = arguments.get(name)
        if isinstance(value, bytes) and value:
            headers[name] = value.decode("latin-1")
    body = arguments.get(BODY_ARG)
    return headers, body if isinstance(body, bytes) else b""
