"""The handle path: a streaming DeploymentHandle call sent to the replica the deployment's request router chose.

Ray's `handle.choose_replica(...)` runs the deployment's request router (a sluice policy's Serve adapter,
routers/serve_adapters.py) and reserves a slot on the replica it picks; `handle.dispatch(selection, ...)` sends the
call there. Ray's rule: the response is consumed before the choice's context exits, or the completion hook fires
twice (at the context's cleanup, then when the deferred send completes). `chosen_stream` keeps the whole stream
inside the context and cancels what the caller leaves unread before leaving it. The adapters count a request out by
its id, so even a second completion changes no count (it shows as the `repeated_completion` event).

A prefill/decode model's legacy path also chooses its prefill replica here (`prefill_choice`), with the prefill
deployment's request router: the policy the direct path's router uses for the prefill side.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from base.contracts import PREFILL_REPLICA_HEADER, PREFILL_URL_HEADER


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


@asynccontextmanager
async def prefill_choice(
    handle: Any, url_of: Callable[[str], Awaitable[str | None]], *args: Any
) -> AsyncIterator[dict[str, str]]:
    """The prefill replica the prefill deployment's request router chose for the call, as the headers a decode
    replica reads (services/replica/middleware/remote_prefill.py: the replica id and `url_of` it, its own port under
    its app's prefix); empty when its URL is unknown (the decode replica then answers `prefill_unrouted`, or prefills
    locally where its spec allows). The replica's reserved slot is held until the caller leaves: the call goes out of
    band (the decode replica's HTTP call), so nothing is dispatched on it."""
    async with handle.choose_replica(*args) as selection:
        url = await url_of(selection.replica_id)
        yield {PREFILL_REPLICA_HEADER: selection.replica_id, PREFILL_URL_HEADER: url} if url is not None else {}
