"""The prefill replicas a decode replica may call: its prefill app's, as Serve lists them.

The prefill URL a request carries (`x-sluice-prefill-url`, set by HAProxy from the router's reply) is called only
when it is the URL of the prefill replica the request names (its own port under the prefill app's route prefix, as
the router builds it). A URL this replica does not know makes it ask Serve again, at most every `REFRESH_S`: a new
prefill replica is known within that, and a forged URL (a request sent to the decode replica's port past the
frontend) is never called, so the replica cannot be made to POST a body anywhere.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from services.serve_internals import ReplicaEndpoint

# At most one look-up of the prefill app's replicas per this many seconds (the router's own refresh is 0.25 s).
REFRESH_S = 1.0


class KnownPrefillURLs:
    def __init__(
        self,
        prefill_app: str,
        endpoints: Callable[[], Awaitable[list[ReplicaEndpoint]]],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._route_prefix = f"/{prefill_app}"
        self._endpoints = endpoints
        self._clock = clock
        self._urls: dict[str, str] = {}
        self._looked_at: float | None = None

    async def known(self, replica_id: str, url: str) -> bool:
        """Whether `url` is where prefill replica `replica_id` serves (asking Serve again when it may be new)."""
        if self._urls.get(replica_id) == url:
            return True
        now = self._clock()
        if self._looked_at is not None and now - self._looked_at < REFRESH_S:
            return False
        self._looked_at = now
        self._urls = {e.replica_id: f"{e.url}{self._route_prefix}" for e in await self._endpoints()}
        return self._urls.get(replica_id) == url
