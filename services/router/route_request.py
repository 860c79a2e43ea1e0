"""A route call's request: HAProxy's headers and forwarded body read into the policies' `RouteRequest`.

The `"model"` and `"user"` fields are read with json when the body parses, else with a regex on the prefix, else
they are None: a truncated or invalid body never fails the route call. HAProxy's HTTP route call says how long it
still waits (`ROUTE_BUDGET_HEADER`); the request's wait budget is that less `DEADLINE_MARGIN_S`, so an answer sent at
its end is one HAProxy still reads (a missing or malformed value: no budget).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping

from base.contracts import BODY_TRUNCATED_HEADER, REQUEST_ID_HEADER, ROUTE_BUDGET_HEADER
from routers.core import RouteRequest

# Body fields a policy may use. In a body that does not parse (cut at the buffer limit, or invalid), the
# first `"<field>": "<string>"` of the prefix.
BODY_FIELDS = ("model", "user")
# How much sooner than HAProxy's wait for a route answer the router gives up on it: the answer's way back and the
# event loop's lag, so that an answer still sent is one HAProxy still waits for.
DEADLINE_MARGIN_S = 0.1
_FIELD_PATTERNS = {name: re.compile(rb'"' + name.encode() + rb'"\s*:\s*"((?:[^"\\]|\\.)*)"') for name in BODY_FIELDS}


def body_truncated(value: str | None) -> bool:
    """`have/total` from HAProxy: cut when have < total or the total is unknown (a chunked body); a malformed value
    still says it was cut."""
    if value is None:
        return False
    have, _, total = value.partition("/")
    try:
        return int(have) < int(total)
    except ValueError:
        return True


def fields_from_body(body: bytes, truncated: bool) -> dict[str, str | None]:
    """Each of `BODY_FIELDS` as a non-empty string: from json when the body parses, else from a regex on
    the prefix, else None. Never raises: a body-aware policy must cope with any body."""
    if not body:
        return dict.fromkeys(BODY_FIELDS)
    if not truncated:
        try:
            parsed = json.loads(body)
        except (ValueError, RecursionError):
            pass
        else:
            parsed = parsed if isinstance(parsed, dict) else {}
            return {name: _non_empty_string(parsed.get(name)) for name in BODY_FIELDS}
    return {name: _field_from_prefix(body, name) for name in BODY_FIELDS}


def _field_from_prefix(body: bytes, name: str) -> str | None:
    match = _FIELD_PATTERNS[name].search(body)
    if match is None:
        return None
    try:
        return _non_empty_string(json.loads(b'"' + match.group(1) + b'"'))
    except ValueError:
        return None


def _non_empty_string(value: object) -> str | None:
    return value if isinstance(value, str) and value else None


def wait_budget_s(value: str | None) -> float | None:
    """HAProxy's milliseconds left, as the seconds a decision may take (never below 0); None: no bound given."""
    try:
        left_ms = int(value) if value is not None else None
    except ValueError:
        return None
    return None if left_ms is None or left_ms < 0 else max(left_ms / 1000 - DEADLINE_MARGIN_S, 0.0)


def route_request_from(headers: Mapping[str, str], body: bytes, session_header: str) -> RouteRequest:
    truncated = body_truncated(headers.get(BODY_TRUNCATED_HEADER))
    fields = fields_from_body(body, truncated)
    return RouteRequest(
        request_id=headers.get(REQUEST_ID_HEADER) or uuid.uuid4().hex,
        session_id=headers.get(session_header) or None,
        model=fields["model"],
        user=fields["user"],
        body_prefix=body,
        body_truncated=truncated,
        wait_budget_s=wait_budget_s(headers.get(ROUTE_BUDGET_HEADER)),
    )
