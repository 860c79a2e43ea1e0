"""A target app's replicas as routing views, kept fresh by polling Serve's endpoint list in the background (the
router's candidate set; the refresh interval's rationale is in services/router/README.md)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence

from base.route_wire import endpoint_id
from base.waiting import START_DEADLINE_S, async_wait_until
from routers.core import ReplicaView
from services.serve_internals import REPLICA_LOGGER, ReplicaEndpoint

logger = logging.getLogger(REPLICA_LOGGER)


class LiveReplicas:
    """The target app's replicas as views, kept fresh by polling `source` in the background."""

    def __init__(
        self,
        source: Callable[[], Awaitable[Sequence[ReplicaEndpoint]]],
        capacity: int,
        refresh_interval_s: float,
        ranks: int = 1,
        what: str = "the target replicas' endpoints",
    ) -> None:
        self._source = source
        self._what = what
        self._capacity = capacity
        self._ranks = ranks
        self.refresh_interval_s = refresh_interval_s
        self._endpoints: tuple[ReplicaEndpoint, ...] = ()
        self._views: tuple[ReplicaView, ...] = ()
        self._poll_failing = False
        self._task: asyncio.Task | None = None

    def views(self) -> tuple[ReplicaView, ...]:
        return self._views

    async def start(self, timeout_s: float = START_DEADLINE_S) -> None:
        """Return once the set is known and non-empty (`base.waiting.StartDeadline` past `timeout_s`, saying what it
        waited for); keep polling in the background after that."""

        async def known() -> tuple[ReplicaView, ...] | None:
            await self._refresh()
            return self._views or None

        await async_wait_until(timeout_s, known, self._what, self.refresh_interval_s, logger)
        self._task = asyncio.get_running_loop().create_task(self._poll())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_interval_s)
            await self._refresh()

    def _rank_capacities(self) -> list[tuple[int | None, int]]:
        """(engine rank, its share of the replica's capacity); one unranked view without data parallelism."""
        if self._ranks == 1:
            return [(None, self._capacity)]
        return [(rank, max(1, self._capacity // self._ranks)) for rank in range(self._ranks)]

    async def _refresh(self) -> None:
        try:
            endpoints = tuple(await self._source())
        except Exception:
            if not self._poll_failing:
                logger.warning("listing the target replicas failed; keeping the last known set", exc_info=True)
            self._poll_failing = True
            return
        self._poll_failing = False
        if endpoints != self._endpoints:
            self._endpoints = endpoints
            self._views = tuple(
                ReplicaView(replica_id=endpoint_id(e.replica_id, rank), endpoint=e.url, capacity=capacity)
                for e in endpoints
                for rank, capacity in self._rank_capacities()
            )
            logger.info("target replicas: %s", [e.replica_id for e in endpoints])
