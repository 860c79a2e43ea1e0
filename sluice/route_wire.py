"""Wire format of the route call (HAProxy Lua -> router service), DESIGN.md §3."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class RouteReply(BaseModel):
    """200 reply: a small flat JSON object the Lua action parses with patterns, so no nesting."""

    model_config = ConfigDict(extra="forbid")

    replica_id: str
    server: str | None = None
    fallbacks: list[str] = []
    capacity_token: str | None = None


class RouteRefusal(BaseModel):
    """Non-200 reply; `reason` becomes the client's `X-Serve-Reason`."""

    reason: str
