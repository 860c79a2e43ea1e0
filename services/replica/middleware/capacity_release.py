"""ASGI middleware on the LLM replica: give a request's capacity token back to the ledger exactly once.

On the direct path the router (capacity_queue policy) takes a token for the replica it chose and
HAProxy passes it to that replica in `x-sluice-capacity-token`. Only the replica sees the request
end, so the replica releases the token, at the first of: the final response body message, an
exception, a client disconnect (an `http.disconnect` from receive, or the request task being
cancelled), and never twice.

The release is started as a background task at the moment the end is seen, synchronously: the
response never waits on the ledger, and a cancelled request cannot interrupt its own release. A
release that fails is logged and counted and never breaks the response; the ledger's TTL reaper
takes back a token whose release was lost. Outcomes are counted in
`sluice_capacity_releases_total{outcome}`: `released`, `not_held` (the ledger did not hold it:
unknown after a ledger restart, already reaped; the ledger counts which) and `error`.

Pure ASGI (not Starlette's BaseHTTPMiddleware), like ReplicaHeadersMiddleware, so SSE chunks pass
through unbuffered and a client disconnect still reaches vLLM.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

import ray
from prometheus_client import Counter

from base.contracts import CAPACITY_TOKEN_HEADER
from routers.background import run_in_background
from routers.ledger_actor import LEDGER_NAMESPACE, ActorLedgerClient
from services.replica.middleware.replica_headers import ASGIApp, Message, Receive, Scope, Send

logger = logging.getLogger(__name__)

_TOKEN = CAPACITY_TOKEN_HEADER.encode()

RELEASES_TOTAL = Counter(
    "sluice_capacity_releases", "Capacity tokens given back by this replica, by outcome.", ["outcome"]
)


def _token(scope: Scope) -> str:
    return next((v for k, v in scope["headers"] if k.lower() == _TOKEN), b"").decode("latin-1").strip()


class TokenReleaser(Protocol):
    async def release(self, token_id: str) -> bool: ...


class NamedLedgerClient:
    """Releases through the named ledger actor, looked up on first use (and again after a failed lookup)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._client: ActorLedgerClient | None = None

    async def release(self, token_id: str) -> bool:
        if self._client is None:
            # A blocking lookup at the control store: keep it off the event loop that streams responses.
            handle = await asyncio.to_thread(ray.get_actor, self.name, namespace=LEDGER_NAMESPACE)
            self._client = ActorLedgerClient(handle)
        return await self._client.release(token_id)


class CapacityReleaseMiddleware:
    """Release the request's `x-sluice-capacity-token` (if any) exactly once when the request ends."""

    def __init__(self, app: ASGIApp, ledger: TokenReleaser) -> None:
        self.app = app
        self.ledger = ledger
        self._releases: set[asyncio.Task] = set()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        token = _token(scope) if scope["type"] == "http" else ""
        if not token:
            await self.app(scope, receive, send)
            return
        released = False

        def release_once() -> None:
            nonlocal released
            if not released:
                released = True
                run_in_background(self._releases, self._release(token))

        async def receive_watching() -> Message:
            message = await receive()
            if message["type"] == "http.disconnect":
                release_once()
            return message

        async def send_watching(message: Message) -> None:
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                release_once()

        try:
            await self.app(scope, receive_watching, send_watching)
        finally:
            release_once()

    async def _release(self, token: str) -> None:
        try:
            held = await self.ledger.release(token)
        except Exception:
            RELEASES_TOTAL.labels("error").inc()
            logger.warning("releasing capacity token %s failed; the reaper will reclaim it", token, exc_info=True)
            return
        RELEASES_TOTAL.labels("released" if held else "not_held").inc()
