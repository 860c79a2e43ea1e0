"""A router app served in-process (no server) and the calls the router-service unit tests make to it."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable, Sequence

import httpx
from prometheus_client import REGISTRY

from base.contracts import (
    APP_HEADER,
    FRONTEND_HEADER,
    MEMBERSHIP_PATH,
    REQUEST_ID_HEADER,
    ROUTE_PATH,
    SESSION_HEADER_DEFAULT,
)
from base.route_wire import RouteReply
from routers.core import ReplicaView
from services.router.http_app import build_router_app
from services.router.settings import RouterSettings, build_policy

REPLICA_IDS = ["r1a2b3c4", "r5d6e7f8", "r9g0h1i2", "rj3k4l5m"]


def views(ids: Sequence[str] = REPLICA_IDS, capacity: int = 4) -> list[ReplicaView]:
    return [
        ReplicaView(replica_id=r, endpoint=f"http://127.0.0.1:{30000 + i}", capacity=capacity)
        for i, r in enumerate(ids)
    ]


def router(
    settings: RouterSettings,
    replicas: Sequence[ReplicaView] | Callable[[], Sequence[ReplicaView]],
    ledger=None,
) -> httpx.AsyncClient:
    """A client of a router app; `replicas` is a fixed set or, to change it between calls, a callable."""
    source = replicas if callable(replicas) else lambda: replicas
    app = build_router_app(settings, build_policy(settings, ledger), source)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router")


def unique_app() -> str:
    """A fresh `app` label, so counter checks are not disturbed by other tests in this process."""
    return f"app-{uuid.uuid4().hex[:8]}"


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def route(
    client: httpx.AsyncClient,
    session: str | None = None,
    body: bytes = b"",
    *,
    frontend: str | None = None,
    **headers: str,
):
    sent = {REQUEST_ID_HEADER: uuid.uuid4().hex, APP_HEADER: "llm", **headers}
    if session is not None:
        sent[SESSION_HEADER_DEFAULT] = session
    if frontend is not None:
        sent[FRONTEND_HEADER] = frontend
    return await client.post(ROUTE_PATH, content=body, headers=sent)


async def publish(client: httpx.AsyncClient, frontend: str, replica_ids: Iterable[str]) -> None:
    reply = await client.post(MEMBERSHIP_PATH, json={"frontend": frontend, "replica_ids": list(replica_ids)})
    assert reply.status_code == 204 and reply.content == b""


async def named_ids(client: httpx.AsyncClient, calls: int = 8, frontend: str | None = None) -> set[str]:
    """Every replica id (primary or fallback) that `calls` route calls name; all must succeed."""
    names: set[str] = set()
    for _ in range(calls):
        reply = await route(client, frontend=frontend)
        assert reply.status_code == 200, reply.text
        parsed = RouteReply.model_validate(reply.json())
        names.update([parsed.replica_id, *parsed.fallbacks])
    return names
