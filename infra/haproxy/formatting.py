"""How values are written in the rendered HAProxy config: times, the body of every error the frontend answers
itself (OpenAI's error shape, so a client's OpenAI SDK parses it; infra/haproxy/README.md), and the stick tables
that count requests by a reason for sluice's frontend counters.
"""

from __future__ import annotations

# OpenAI's error types by status; anything else is a server error.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    408: "invalid_request_error",
    404: "invalid_request_error",
    413: "invalid_request_error",
    414: "invalid_request_error",
    429: "rate_limit_error",
    431: "invalid_request_error",
    503: "service_unavailable",
}


def openai_error_body(message: str, status: int) -> str:
    """`{"error": {...}}` for `status`; `message` may hold HAProxy log-format expressions but no quote of either
    kind (the body is rendered inside single quotes and is JSON)."""
    if "'" in message or '"' in message:
        raise ValueError(f"an error message may not hold quotes: {message!r}")
    kind = ERROR_TYPES.get(status, "server_error")
    return '{"error": {"message": "' + message + '", "type": "' + kind + '", "code": ' + str(status) + "}}"


def haproxy_time(seconds: float) -> str:
    """An HAProxy time: whole seconds as `Ns`, anything finer in milliseconds."""
    ms = max(1, round(seconds * 1000))
    return f"{ms // 1000}s" if ms % 1000 == 0 else f"{ms}ms"


def counter_table_lines(
    name: str, comment: str, keys: int, key_bytes: int = 32, store: str = "http_req_cnt"
) -> list[str]:
    """A backend holding only a stick table that counts requests by a string key, with room for `keys` of them
    (four times over: a key is never evicted while the few real ones fit)."""
    return [
        f"backend {name}",
        f"    # {comment}",
        f"    stick-table type string len {key_bytes} size {keys * 4} store {store}",
        "",
    ]
