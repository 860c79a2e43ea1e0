"""The handle path: a streaming DeploymentHandle call sent to the replica the deployment's request router chose.

Ray's `handle.choose_replica(...)` runs the deployment's request router (a sluice policy's Serve adapter,
routers/serve_adapters.py) and reserves a slot on the replica it picks; `handle.dispatch(selection, ...)` sends the
call there. Ray's rule: the response is consumed before the choice's context exits, or the completion hook fires
twice (at the context's cleanup, then when the deferred send completes). `chosen_stream` keeps the whole stream
inside the context and cancels what the caller leaves unread before leaving it. The adapters count a request out by
its id, so even a second completion changes no count (it shows as the `repeated_completion` event).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ChosenStream:
    """The replica the request router chose (Ray's unique replica id) and the call's stream from it."""

    replica_id: str
    items: AsyncIterator[Any]


@asynccontextmanager
async def chosen_stream(handle: Any, *args: Any, **kwargs: Any) -> AsyncIterator[ChosenStream]:
    """Choose a replica for the call with `handle` (streaming), dispatch it there, and hold the choice open while
    the caller reads the stream; a stream left unread when the caller exits (or fails) is cancelled first."""
    async with handle.choose_replica(*args, **kwargs) as selection:
        response = handle.dispatch(selection, *args, **kwargs)
        finished = False

        async def items() -> AsyncIterator[Any]:
            nonlocal finished
            async for item in response:
                yield item
            finished = True

        try:
            yield ChosenStream(replica_id=selection.replica_id, items=items())
        finally:
            if not finished:
                response.cancel()
