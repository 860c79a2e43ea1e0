"""How values are written in the rendered HAProxy config: times, and the body of every error the frontend answers
itself (OpenAI's error shape, so a client's OpenAI SDK parses it; infra/haproxy/README.md).
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
