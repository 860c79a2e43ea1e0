"""ASGI middleware: a request whose task is cancelled reaches the app as a client disconnect, so vLLM aborts the
engine request.

Serve's direct ingress cancels a request's task when its client leaves (a closed connection, HAProxy's 504 after a
server timeout), and the handle path cancels it when its caller stops reading. vLLM's non-streamed handlers race
their work against `receive()` for `http.disconnect` (`with_cancellation`) inside `asyncio.wait`, which leaves both
tasks running when the wait itself is cancelled: the engine request ran to its natural end, 1.1 s after a client
that left at 0.5 s (900 tokens, measured on a replica's own port; the same request on vLLM's own server was aborted at
once). A streamed response was aborted at once either way (Starlette cancels its task group).

Here the app runs in a task the cancel does not reach. The cancel becomes an `http.disconnect` on the app's
`receive`, the app's further sends go nowhere (no one reads them), and the middleware gives the app up to
`CANCEL_GRACE_S` to wind down (vLLM aborts within milliseconds) before it cancels it outright and lets the cancel
through. Outermost of the replica's middleware, so both paths get it.
"""

from __future__ import annotations

import asyncio

from services.replica.middleware.replica_headers import ASGIApp, Message, Receive, Scope, Send

# How long a cancelled request's app may take to wind down after it was told of the disconnect.
CANCEL_GRACE_S = 5.0
_DISCONNECT: Message = {"type": "http.disconnect"}


class DisconnectOnCancelMiddleware:
    """Turn a cancelled HTTP request into a client disconnect the app sees."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        cancelled = asyncio.Event()

        async def receive_until_cancelled() -> Message:
            if cancelled.is_set():
                return dict(_DISCONNECT)
            received = asyncio.ensure_future(receive())
            told = asyncio.ensure_future(cancelled.wait())
            try:
                await asyncio.wait({received, told}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for waiting in (received, told):
                    waiting.cancel()
            return received.result() if received.done() and not received.cancelled() else dict(_DISCONNECT)

        async def send_unless_cancelled(message: Message) -> None:
            if not cancelled.is_set():
                await send(message)

        app_task = asyncio.ensure_future(self.app(scope, receive_until_cancelled, send_unless_cancelled))
        try:
            await asyncio.shield(app_task)
        except asyncio.CancelledError:
            cancelled.set()
            await asyncio.wait({app_task}, timeout=CANCEL_GRACE_S)
            app_task.cancel()
            raise
