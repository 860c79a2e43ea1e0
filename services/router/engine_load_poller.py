"""Every target replica's engine load into a policy's `EngineLoads` (`routers.engine_load`): a poll of
`ENGINE_LOAD_PATH` under the app's prefix, all replicas at once, every `ENGINE_LOAD_POLL_S`.

A replica that does not answer (or answers nothing for a rank yet) leaves that rank's last report to go stale, and
the policy ranks by in-flight counts until it answers again. Polled rather than pushed: vLLM has no load stream, and
one small GET per replica each half second costs a router about 1 % of a core at 64 replicas.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

import httpx

from base.contracts import ENGINE_LOAD_PATH
from base.route_wire import EngineLoads, endpoint_id, replica_of
from routers.core import ReplicaView
from routers.engine_load import STALE_AFTER_S
from routers.engine_load import EngineLoads as LoadBook
from services.serve_internals import REPLICA_LOGGER

logger = logging.getLogger(REPLICA_LOGGER)

# Ten polls within a report's freshness (`STALE_AFTER_S`): a decision between two polls misses at most this much of
# the engines' own progress, and the router counts its own placements since.
ENGINE_LOAD_POLL_S = STALE_AFTER_S / 10


class EngineLoadPoller:
    def __init__(
        self,
        book: LoadBook,
        route_prefix: str,
        ranks: int = 1,
        client: httpx.AsyncClient | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        self.book = book
        self._route_prefix = route_prefix
        self._ranks = ranks
        self._client = client or httpx.AsyncClient(timeout=ENGINE_LOAD_POLL_S * 2, headers=headers)
        self._failing: set[str] = set()

    async def poll(self, views: Sequence[ReplicaView]) -> None:
        """One report from every replica of `views`."""
        by_replica = {replica_of(view.replica_id): view.endpoint for view in views}
        await asyncio.gather(*(self._ask(replica, url) for replica, url in by_replica.items()))

    async def _ask(self, replica: str, url: str) -> None:
        try:
            response = await self._client.get(f"{url}{self._route_prefix}{ENGINE_LOAD_PATH}")
            response.raise_for_status()
            loads = EngineLoads.model_validate_json(response.content)
        except (httpx.HTTPError, ValueError) as error:
            if replica not in self._failing:
                logger.warning("replica %s does not report its engine load (%s): ranked by in-flight", replica, error)
            self._failing.add(replica)
            return
        self._failing.discard(replica)
        for rank, load in loads.ranks.items():
            view_id = endpoint_id(replica, rank if self._ranks > 1 else None)
            self.book.reported(
                view_id,
                load.kv_tokens_used,
                load.waiting,
                load.prefill_tokens_pending,
                load.kv_tokens_total,
                load.prefix_cache_queries,
                load.prefix_cache_hits,
                load.running,
                load.request_seconds,
            )

    async def run(self, views: Callable[[], Sequence[ReplicaView]]) -> None:
        """Poll `views()` every `ENGINE_LOAD_POLL_S` until cancelled."""
        while True:
            try:
                await self.poll(views())
            except Exception:
                logger.exception("polling the engines' load failed; trying again")
            await asyncio.sleep(ENGINE_LOAD_POLL_S)

    async def close(self) -> None:
        await self._client.aclose()
