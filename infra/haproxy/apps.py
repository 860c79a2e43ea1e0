"""What the frontend routes per app: its name, model, router pool and replica prefixes, fail mode, body forwarding
and session header (`AppRoute`), checked before anything is rendered (infra/haproxy/README.md).
"""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict, Field, field_validator

from base.contracts import INTERNAL_HEADER_PREFIXES, SESSION_HEADER_DEFAULT
from infra.haproxy.models import MODEL_NAME_PATTERN

# Default forwarding buffer for body-aware policies (shared with `sluice.bench.stack_harness.DirectStreamSpec`).
BODY_BUFFER_BYTES_DEFAULT = 262144

_HEADER_NAME = re.compile(r"^[a-z0-9][a-z0-9-]*$")
_APP_NAME = re.compile(r"^[A-Za-z0-9_.:-]+$")


class AppRoute(BaseModel):
    """How the frontend routes one app's requests through its router pool."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    # The served model name that selects this app on a frontend with several apps (`infra.haproxy.models`).
    model: str | None = None
    # Fail-open: a request the router could not place is load-balanced normally and the response carries
    # `x-serve-fallback: <reason>`. Off by default: fail closed with a 503.
    fail_open: bool = False
    # Send the client body (up to body_buffer_bytes) to the router; needed by body-aware policies only.
    forward_body: bool = False
    body_buffer_bytes: int = Field(BODY_BUFFER_BYTES_DEFAULT, ge=1024, le=64 * 1024 * 1024)
    session_header: str = SESSION_HEADER_DEFAULT
    # Decide from the routers' table when their policy has one (`base.route_wire.RouteTable`): no route call per
    # request while the table is in force (infra/haproxy/README.md). Off: every routed request asks a router.
    table_decisions: bool = False
    # Route prefix of the router deployment: the route call goes to `<prefix>/internal/route` ("" = at the root).
    router_route_prefix: str = ""
    # Route prefix of the LLM app: a replica serves vLLM's paths under it, so the frontend prepends it.
    replica_route_prefix: str = ""
    # Route prefix of the app's retained legacy ingress (None: the app has no legacy path, e.g. prefill/decode).
    legacy_route_prefix: str | None = None

    @field_validator("router_route_prefix", "replica_route_prefix", "legacy_route_prefix")
    @classmethod
    def _route_prefix(cls, value: str | None) -> str | None:
        if value is None:
            return None
        value = value.rstrip("/")
        if value and not re.match(r"^(/[A-Za-z0-9._~-]+)+$", value):
            raise ValueError(f"route prefix {value!r} must look like /name[/name...]")
        return value

    @field_validator("model")
    @classmethod
    def _model_name(cls, value: str | None) -> str | None:
        if value is not None and not MODEL_NAME_PATTERN.match(value):
            raise ValueError(f"model {value!r} is not a served model name: letters, digits and . _ : / - only")
        return value

    @field_validator("name")
    @classmethod
    def _app_name(cls, value: str) -> str:
        if not _APP_NAME.match(value):
            raise ValueError(f"app name {value!r} must match {_APP_NAME.pattern}")
        return value

    @field_validator("session_header")
    @classmethod
    def _session_header(cls, value: str) -> str:
        return session_header_name(value)


def session_header_name(value: str) -> str:
    """A session header as the frontend compares it (lower case); refuses what is no header name or what the
    frontend strips."""
    value = value.lower()
    if not _HEADER_NAME.match(value):
        raise ValueError(f"session header {value!r} is not a header name: use letters, digits and '-'")
    if value.startswith(INTERNAL_HEADER_PREFIXES):
        raise ValueError(f"session header {value!r} uses an internal prefix the frontend strips: pick another name")
    return value
