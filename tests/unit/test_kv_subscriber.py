"""The router's KV event subscriber against a fake vLLM publisher (a ZMQ PUB socket on loopback, vLLM's own batch
encoding): a stream that ended is started again and its replica is primary material again (review #6); a gap no
replay closes clears the replica before the next batch applies, so blocks it may have removed do not stay (#7)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import httpx
import msgspec
import pytest
import zmq
import zmq.asyncio
from vllm.distributed.kv_events import BlockStored, KVEventBatch

from base.contracts import KV_EVENTS_PATH
from base.route_wire import KVEventSource, KVEventSources
from base.runtime import free_port
from routers.core import ReplicaView
from routers.kv_aware import KVAware
from routers.kv_events import ReplicaEvents, sequence_frame
from services.router import kv_subscriber
from services.router.kv_subscriber import KVEventSubscriber

BLOCK, PREFIX, REPLICA = 4, "/app", "r1"
VIEWS = (ReplicaView(replica_id=REPLICA, endpoint="http://replica"),)


def _batch(block_hash: int) -> bytes:
    stored = BlockStored(
        block_hashes=[block_hash],
        parent_block_hash=None,
        token_ids=[block_hash] * BLOCK,
        block_size=BLOCK,
        lora_id=None,
        medium="GPU",
        lora_name=None,
    )
    return msgspec.msgpack.Encoder().encode(KVEventBatch(ts=0.0, events=[stored], data_parallel_rank=0))


async def _until(condition: Callable[[], bool], what: str, publish: Callable[[], object] | None = None) -> None:
    """Poll (publishing meanwhile: a SUB socket misses what is sent before it joined) up to 10 s."""
    for _ in range(200):
        if condition():
            return
        if publish is not None:
            await publish()
        await asyncio.sleep(0.05)
    raise AssertionError(f"not within 10 s: {what}")


async def _subscribed() -> tuple[KVEventSubscriber, zmq.asyncio.Socket, zmq.asyncio.Context]:
    context = zmq.asyncio.Context()
    publisher = context.socket(zmq.PUB)
    endpoint = f"tcp://127.0.0.1:{free_port('127.0.0.1')}"
    publisher.bind(endpoint)
    announced = KVEventSources(block_size=BLOCK, sources={0: KVEventSource(endpoint=endpoint)})

    def answer(request: httpx.Request) -> httpx.Response:
        assert request.url.path == PREFIX + KV_EVENTS_PATH
        return httpx.Response(200, content=announced.model_dump_json())

    client = httpx.AsyncClient(transport=httpx.MockTransport(answer))
    subscriber = KVEventSubscriber(KVAware(tokenize=lambda body, read_on: None), PREFIX, client=client)
    await subscriber.sync(VIEWS)
    return subscriber, publisher, context


def test_a_stream_that_ended_is_started_again_and_its_replica_indexed_again(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kv_subscriber, "ANNOUNCE_REFRESH_S", 0.0)

    async def run() -> None:
        subscriber, publisher, context = await _subscribed()
        number = iter(range(10_000))
        try:
            policy = subscriber.target

            async def publish() -> None:
                await publisher.send_multipart([b"", sequence_frame(next(number)), _batch(1)])

            await _until(lambda: subscriber.batches > 0, "the first batch", publish)
            await publisher.send_multipart([b"", b"a frame too few"])  # ends the stream task
            await _until(lambda: policy.sources.get(REPLICA) == ReplicaEvents.LOST, "the stream to end")
            await subscriber.sync(VIEWS)  # the announcement check: unchanged, but the stream ended
            applied = subscriber.batches
            await _until(lambda: subscriber.batches > applied, "batches after the restart", publish)
            assert policy.sources[REPLICA] == ReplicaEvents.EVENTS and policy.index.blocks(REPLICA) == 1
        finally:
            await subscriber.close()
            publisher.close(linger=0)
            context.term()

    asyncio.run(run())


def test_a_gap_no_replay_closes_clears_the_replica_before_the_next_batch() -> None:
    async def run() -> None:
        subscriber, publisher, context = await _subscribed()
        try:
            index = subscriber.target.index

            async def first() -> None:
                await publisher.send_multipart([b"", sequence_frame(0), _batch(1)])

            await _until(lambda: index.blocks(REPLICA) == 1, "the first block", first)
            # Batches 1 to 4 never arrive, and there is no replay socket: block 1 may have been removed among them.
            await publisher.send_multipart([b"", sequence_frame(5), _batch(2)])
            await _until(lambda: subscriber.unrepaired_gaps == 1, "the gap to be seen")
            assert index.blocks(REPLICA) == 1  # block 2 alone
        finally:
            await subscriber.close()
            publisher.close(linger=0)
            context.term()

    asyncio.run(run())
