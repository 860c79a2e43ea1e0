"""The adoption checklist's items that need only the frontend's URL: each returns (ok, detail), ok None = skipped.

Every item sends real requests through the frontend; where the canary sends a session to the legacy path, an item
that checks the direct path tries other sessions (the path is sticky per session) until one is served direct.
"""

from __future__ import annotations

import re
import ssl
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx

from base import sse
from base.contracts import (
    DIRECT_PATH,
    REASON_REPLICA_TIMEOUT,
    REPLICA_HEADER,
    REQUEST_ID_HEADER,
    SERVE_PATH_HEADER,
    SERVE_REASON_HEADER,
    SESSION_HEADER_DEFAULT,
    STAGING_SERVER_TIMEOUT_S,
    STAGING_TIMEOUT_HEADER,
)

Result = tuple[bool | None, str]
# Sessions tried to find one the canary serves on the direct path.
SESSION_TRIES = 40
TIMEOUT_S = 60.0
DISCONNECT_DEADLINE_S = 1.0
_RUNNING = re.compile(r"^vllm:num_requests_(?:running|waiting)\{[^}]*\} (\S+)$", re.M)
# A forced tool call: the arguments must come back as JSON that fits this schema.
WEATHER_SCHEMA = {
    "type": "object",
    "properties": {
        "unit": {"enum": ["c", "f"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "alerts": {"type": "boolean"},
    },
    "required": ["unit", "days", "alerts"],
    "additionalProperties": False,
}
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_SCHEMA}}
# Long enough to still run when the client leaves, within the tiny model's context.
LONG_STREAM_TOKENS = 900


def chat(model: str, content: str = "ka lo", **extra: Any) -> dict[str, Any]:
    """A greedy chat request (the tiny model is deterministic: the same request gives the same text)."""
    return {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 16,
        "temperature": 0,
        **extra,
    }


def forced_tool_call(model: str) -> dict[str, Any]:
    """A chat request that must call `get_weather` with arguments fitting `WEATHER_SCHEMA`."""
    return {
        "model": model,
        "messages": [{"role": "user", "content": "weather for the week?"}],
        "max_tokens": 300,
        "tools": [WEATHER_TOOL],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
    }


def headers(session: str | None = None, request_id: str | None = None) -> dict[str, str]:
    sent = {REQUEST_ID_HEADER: request_id or f"check-{uuid.uuid4().hex}"}
    if session is not None:
        sent[SESSION_HEADER_DEFAULT] = session
    return sent


def direct_post(client: httpx.Client, url: str, body: dict[str, Any]) -> httpx.Response | None:
    """A POST the frontend served on the direct path (trying sessions), or its refusal; None if every session
    tried went to the legacy path."""
    for _ in range(SESSION_TRIES):
        response = client.post(url, json=body, headers=headers(session=uuid.uuid4().hex))
        if response.headers.get(SERVE_PATH_HEADER) == DIRECT_PATH or response.status_code >= 500:
            return response
    return None


def direct_streaming(client: httpx.Client, base: str, model: str) -> Result:
    response = direct_post(client, f"{base}/v1/chat/completions", chat(model, stream=True))
    if response is None:
        return False, f"no request of {SESSION_TRIES} sessions was served on the direct path"
    if response.status_code != 200:
        return False, f"a direct request got {response.status_code} ({response.headers.get(SERVE_REASON_HEADER)})"
    return True, f"streamed by replica {response.headers.get(REPLICA_HEADER)} on the direct path"


def running_requests(client: httpx.Client, metrics_urls: list[str]) -> float:
    return sum(float(v) for url in metrics_urls for v in _RUNNING.findall(client.get(url).text))


def disconnect_frees_engine(client: httpx.Client, base: str, model: str, metrics_urls: list[str]) -> Result:
    body = chat(model, max_tokens=LONG_STREAM_TOKENS, ignore_eos=True, stream=True)
    with client.stream("POST", f"{base}/v1/chat/completions", json=body, headers=headers()) as response:
        if response.status_code != 200:
            return False, f"a long stream got {response.status_code}"
        lines = sse.iter_lines(response.iter_bytes())
        # The engines report a request once they have stepped it: read on until they do (bounded).
        for _ in range(50):
            next(lines)
            if running_requests(client, metrics_urls) >= 1:
                break
        else:
            return False, "the engines report no running request while a stream runs"
    left = time.monotonic()
    while time.monotonic() - left < DISCONNECT_DEADLINE_S:
        if running_requests(client, metrics_urls) == 0:
            return True, f"engine request aborted {time.monotonic() - left:.2f} s after the client left"
        time.sleep(0.05)
    return False, f"the engine still runs the request {DISCONNECT_DEADLINE_S} s after the client left"


def timeout_cleanup(client: httpx.Client, base: str, model: str, metrics_urls: list[str], staging: bool) -> Result:
    """A long request that asks the staging frontend for its short server timeout: HAProxy answers 504
    `replica_timeout` and closes the replica's connection, and the engine aborts the request."""
    if not staging:
        return None, "not a staging stack (only a staging frontend cuts a request's server timeout short)"
    # Not streamed: vLLM sends no header before the whole answer, seconds after the staging timeout.
    body = chat(model, max_tokens=LONG_STREAM_TOKENS, ignore_eos=True)
    response = client.post(f"{base}/v1/chat/completions", json=body, headers={**headers(), STAGING_TIMEOUT_HEADER: "1"})
    reason = response.headers.get(SERVE_REASON_HEADER)
    if response.status_code != 504 or reason != REASON_REPLICA_TIMEOUT:
        return (
            False,
            f"a request past the {STAGING_SERVER_TIMEOUT_S} s staging timeout got {response.status_code} ({reason})",
        )
    timed_out = time.monotonic()
    while time.monotonic() - timed_out < DISCONNECT_DEADLINE_S:
        if running_requests(client, metrics_urls) == 0:
            return True, (
                f"504 {reason} after the {STAGING_SERVER_TIMEOUT_S} s staging timeout; engine request aborted"
                f" {time.monotonic() - timed_out:.2f} s later"
            )
        time.sleep(0.05)
    return False, f"the engine still runs the request {DISCONNECT_DEADLINE_S} s after its 504"


@contextmanager
def check_client(verify: ssl.SSLContext | bool = True, headers: dict[str, str] | None = None) -> Iterator[httpx.Client]:
    """The checklist's client; `verify`: what an https frontend's certificate is checked against; `headers`: what
    every request carries (`--api-key`, `--header`)."""
    with httpx.Client(timeout=TIMEOUT_S, verify=verify, headers=headers) as client:
        yield client
