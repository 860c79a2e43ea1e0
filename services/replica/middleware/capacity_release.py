"""ASGI middleware on the LLM replica: give a request's capacity token back to the ledger exactly once.

The router took the token and HAProxy passed it in `x-sluice-capacity-token`; only the replica sees the request
end (the last body message, an exception or a client disconnect). The release runs in the background and never
breaks the response; outcomes count in `sluice_capacity_releases_total{outcome}`. Details: services/replica/README.md.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

import ray
from prometheus_client import Counter
from ray.exceptions import RayActorError

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
    """Releases through the named ledger actor, looked up on first use, again after a failed lookup, and again
    once the actor it found is dead: a ledger killed for good is created anew under its name by the next router,
    and the tokens that one grants must come back to it, not to the dead one."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._client: ActorLedgerClient | None = None

    async def release(self, token_id: str) -> bool:
        try:
            return await (await self._ledger()).release(token_id)
        except RayActorError:
            self._client = None
            return await (await self._ledger()).release(token_id)

    async def _ledger(self) -> ActorLedgerClient:
        if self._client is None:
            # A blocking lookup at the control store: keep it off the event loop that streams responses.
            handle = await asyncio.to_thread(ray.get_actor, self.name, namespace=LEDGER_NAMESPACE)
            self._client = ActorLedgerClient(handle)
        return self._client


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
