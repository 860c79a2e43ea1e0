"""Every target replica's KV events into the index of a policy scored by them (`routers.kv_events.KVEventTarget`):
one ZMQ subscription per engine rank.

On each refresh of the replica set, a new replica is asked where it publishes (`KV_EVENTS_PATH` under its app's
prefix, a `KVEventSources`); the router subscribes to each publisher, then asks its replay socket for every batch it
still buffers, so a router that starts late, or reconnects, knows what the engine already holds. Batches apply in
sequence order (`routers.kv_events.StreamPosition`); a gap is replayed, and one the replay does not close (no replay
socket, a replay timeout, batches the publisher no longer buffers) clears the replica first: what it missed may
have removed blocks (`unrepaired_gaps`). A batch that does not apply clears the replica, and the stream goes on. A
stream that ended anyway is started again at the next announcement check. A replica that publishes nothing, or that
cannot be asked, is scored by what this router sent it (`ReplicaEvents.APPROXIMATE`); one whose connection drops
(it died, or its node did) is cleared and marked `LOST` at once, before Serve's replica list catches up. A replica
that leaves the set is forgotten. Publishers are only ever connected to at the address the replica announced: its
node's own address (loopback on one machine, the stack's private network across nodes).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence

import httpx
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from base.contracts import KV_EVENTS_PATH
from base.route_wire import KVEventSource, KVEventSources, endpoint_id, replica_of
from routers.core import ReplicaView
from routers.kv_events import (
    END_OF_REPLAY,
    KVEventTarget,
    ReplicaEvents,
    Step,
    StreamPosition,
    apply_batch,
    sequence_frame,
    sequence_number,
)
from services.serve_internals import REPLICA_LOGGER

logger = logging.getLogger(REPLICA_LOGGER)

# Each replica is asked again this often where it publishes: one whose events were turned off (or on), or whose
# engine restarted on other ports, is followed anew; one that did not answer is tried again.
ANNOUNCE_REFRESH_S = 5.0
# How long a replay may take before the stream goes on without it (what it missed stays unknown).
REPLAY_TIMEOUT_S = 2.0
# ZMTP heartbeats: a publisher whose node vanished (no TCP reset) is noticed as lost within this.
HEARTBEAT_IVL_MS, HEARTBEAT_TIMEOUT_MS = 500, 1500


class KVEventSubscriber:
    """Keeps `target`'s index and per-replica sources current for the replica views it is given."""

    def __init__(
        self,
        target: KVEventTarget,
        route_prefix: str,
        ranks: int = 1,
        client: httpx.AsyncClient | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        """`client`: what asks the replicas where they publish (default: a client with `headers`, the internal
        credential, 5 s timeout)."""
        self.target = target
        self._route_prefix = route_prefix
        self._ranks = ranks
        self._context = zmq.asyncio.Context()
        self._client = client or httpx.AsyncClient(timeout=5.0, headers=headers)
        # Per replica: what it announced last, and a stream task per publisher.
        self._streams: dict[str, tuple[KVEventSources | None, list[asyncio.Task]]] = {}
        self._asked_at: dict[str, float] = {}
        self.batches = 0
        self.unrepaired_gaps = 0

    async def sync(self, views: Sequence[ReplicaView]) -> None:
        """Subscribe to replicas new in `views`, drop those gone from it."""
        by_replica: dict[str, str] = {replica_of(view.replica_id): view.endpoint for view in views}
        for replica in [r for r in self._streams if r not in by_replica]:
            self._drop(replica)
        now = asyncio.get_running_loop().time()
        for replica, url in by_replica.items():
            if now - self._asked_at.get(replica, -ANNOUNCE_REFRESH_S) >= ANNOUNCE_REFRESH_S:
                self._asked_at[replica] = now
                await self._follow(replica, url)

    def _view_id(self, replica: str, rank: int) -> str:
        return endpoint_id(replica, rank if self._ranks > 1 else None)

    def _view_ids(self, replica: str) -> list[str]:
        return [self._view_id(replica, rank) for rank in range(self._ranks)]

    async def _follow(self, replica: str, url: str) -> None:
        """Ask the replica where it publishes; (re)subscribe when that changed."""
        try:
            response = await self._client.get(f"{url}{self._route_prefix}{KV_EVENTS_PATH}")
            response.raise_for_status()
            announced: KVEventSources | None = KVEventSources.model_validate_json(response.content)
        except (httpx.HTTPError, ValueError) as error:
            if replica in self._streams and self._streams[replica][1]:
                return  # a busy replica's slow answer is no reason to drop streams that flow
            logger.warning("replica %s does not say where it publishes KV events (%s)", replica, error)
            announced = None
        current = self._streams.get(replica)
        if current is not None and current[0] == announced and not any(task.done() for task in current[1]):
            return  # unchanged, and every stream flows (one that ended is started again below)
        self._stop(replica)
        if announced is not None:
            self.target.block_size = announced.block_size
        if announced is None or not announced.sources:
            logger.info("replica %s publishes no KV events: scored by what this router sent it", replica)
            for view_id in self._view_ids(replica):
                self.target.sources[view_id] = ReplicaEvents.APPROXIMATE
            self._streams[replica] = (announced, [])
            return
        tasks = []
        for rank in range(self._ranks):
            view_id = self._view_id(replica, rank)
            source = announced.sources.get(rank if self._ranks > 1 else min(announced.sources, default=0))
            if source is None:
                self.target.sources[view_id] = ReplicaEvents.APPROXIMATE
                continue
            self.target.sources[view_id] = ReplicaEvents.EVENTS
            tasks.append(asyncio.get_running_loop().create_task(self._stream(view_id, source)))
        self._streams[replica] = (announced, tasks)
        logger.info("replica %s: KV events from %s", replica, [s.endpoint for s in announced.sources.values()])

    def _stop(self, replica: str) -> None:
        """End the replica's streams and forget what they said."""
        _, tasks = self._streams.pop(replica, (None, []))
        for task in tasks:
            task.cancel()
        for view_id in self._view_ids(replica):
            self.target.replica_left(view_id)

    def _drop(self, replica: str) -> None:
        self._stop(replica)
        self._asked_at.pop(replica, None)

    async def _stream(self, view_id: str, source: KVEventSource) -> None:
        subscriber = self._context.socket(zmq.SUB)
        subscriber.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
        subscriber.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        subscriber.setsockopt(zmq.SUBSCRIBE, source.topic.encode())
        monitor = subscriber.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        subscriber.connect(source.endpoint)
        position = StreamPosition()
        poller = zmq.asyncio.Poller()
        poller.register(subscriber, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        try:
            while True:
                ready = dict(await poller.poll())
                if monitor in ready:
                    event = parse_monitor_message(await monitor.recv_multipart())["event"]
                    if event == zmq.EVENT_DISCONNECTED:
                        logger.warning("KV events of %s: publisher lost; its blocks are dropped", view_id)
                        self.target.index.cleared(view_id)
                        self.target.sources[view_id] = ReplicaEvents.LOST
                        position = StreamPosition()
                    elif event == zmq.EVENT_CONNECTED:
                        self.target.sources[view_id] = ReplicaEvents.EVENTS
                        await self._replay(view_id, source, position, 0)
                if subscriber in ready:
                    _, number_frame, payload = await subscriber.recv_multipart()
                    number = sequence_number(number_frame)
                    step = position.step(number)
                    if step == Step.GAP:
                        await self._replay(view_id, source, position, position.expected or 0)
                        step = position.step(number)
                        if step == Step.GAP:
                            self._unrepaired(view_id, number)
                    if step != Step.SKIP:
                        self._apply(view_id, payload, position, number)
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("KV events of %s stopped; its blocks are dropped", view_id)
            self.target.index.cleared(view_id)
            self.target.sources[view_id] = ReplicaEvents.LOST
        finally:
            subscriber.disable_monitor()
            monitor.close(linger=0)
            subscriber.close(linger=0)

    def _unrepaired(self, view_id: str, number: int) -> None:
        """Batches before `number` are lost for good: the blocks they removed would stay in the index forever."""
        logger.warning("KV events of %s: batches before %d are lost; its blocks are dropped", view_id, number)
        self.target.index.cleared(view_id)
        self.unrepaired_gaps += 1

    def _apply(self, view_id: str, payload: bytes, position: StreamPosition, number: int) -> None:
        try:
            apply_batch(self.target.index, view_id, payload)
        except Exception:  # does not decode, or an event field is not what this version knows: resynchronize
            logger.warning("KV events of %s: batch %d does not apply; its blocks are dropped", view_id, number)
            self.target.index.cleared(view_id)
        position.applied(number)
        self.batches += 1

    async def _replay(self, view_id: str, source: KVEventSource, position: StreamPosition, start: int) -> None:
        """Apply every buffered batch from `start` that the stream has not applied yet."""
        if source.replay_endpoint is None:
            return
        dealer = self._context.socket(zmq.DEALER)
        dealer.connect(source.replay_endpoint)
        try:
            await dealer.send_multipart([b"", sequence_frame(start)])
            while True:
                frames = await asyncio.wait_for(dealer.recv_multipart(), REPLAY_TIMEOUT_S)
                _, _, number_frame, payload = frames
                number = sequence_number(number_frame)
                if number == END_OF_REPLAY:
                    return
                step = position.step(number)
                if step == Step.GAP:  # the publisher no longer buffers what came before
                    self._unrepaired(view_id, number)
                if step != Step.SKIP:
                    self._apply(view_id, payload, position, number)
        except TimeoutError:
            logger.warning("KV events of %s: replay from %d timed out; going on without it", view_id, start)
        finally:
            dealer.close(linger=0)

    async def close(self) -> None:
        """End every stream, then the ZMQ context: its `term` waits for every socket, and a cancelled stream closes
        its sockets only once it has run its cancellation."""
        streams = [task for _, tasks in self._streams.values() for task in tasks]
        for replica in list(self._streams):
            self._drop(replica)
        await asyncio.gather(*streams, return_exceptions=True)
        await self._client.aclose()
        with contextlib.suppress(Exception):
            self._context.term()
