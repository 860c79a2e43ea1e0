"""The error body of every answer sluice makes itself: the OpenAI shape vLLM's own errors have (vLLM's
`ErrorResponse`: `{"error": {"message", "type", "param", "code"}}`), so a client parses a frontend's refusal, a
replica middleware's and the engine's error alike (an OpenAI SDK reads those four).

The type is OpenAI's for the status (`ERROR_TYPES`, `server_error` for anything else); `param` names no request
field (sluice refuses whole requests), so it is null; `code` is the HTTP status, as vLLM sets it.
"""

from __future__ import annotations

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    414: "invalid_request_error",
    429: "rate_limit_error",
    431: "invalid_request_error",
    503: "service_unavailable",
}
SERVER_ERROR = "server_error"


def openai_error(message: str, status: int) -> dict[str, dict[str, str | int | None]]:
    """The body of an error answer with HTTP status `status`."""
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, SERVER_ERROR), "code": status, "param": None}}
