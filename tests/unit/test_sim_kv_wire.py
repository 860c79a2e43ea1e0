"""The simulated engine against vLLM itself: its block hashes are vLLM's (default seed and PYTHONHASHSEED), its
events encode to vLLM's bytes, its cache evicts and publishes as vLLM's `BlockPool` does, the router's decoder
indexes its batches, and its publisher speaks vLLM's PUB and replay protocol over loopback."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import msgspec
import pytest
import zmq
import zmq.asyncio
from vllm.distributed import kv_events as vllm_events
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core import kv_cache_utils
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, hash_block_tokens, maybe_convert_block_hash
from vllm.v1.request import Request

from routers.kv_events import END_OF_REPLAY, apply_batch, sequence_frame, sequence_number
from routers.kv_index import KVBlockIndex, chain_keys
from services.replica.sim import kv_events_wire as wire
from services.replica.sim.engine import SimEngine
from services.replica.sim.kv_cache import KVCache, external_hash, hash_block, none_hash
from services.replica.sim.kv_publisher import SimKVPublisher
from services.replica.sim.model import SimModel

BLOCK = 4
_ENCODER = msgspec.msgpack.Encoder()


def _encoded(batch: msgspec.Struct) -> bytes:
    return _ENCODER.encode(batch)


@pytest.mark.parametrize("seed", [None, "1234"])
def test_block_hashes_and_their_event_form_are_vllms(monkeypatch: pytest.MonkeyPatch, seed: str | None) -> None:
    if seed is None:
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    else:
        monkeypatch.setenv("PYTHONHASHSEED", seed)
    kv_cache_utils.init_none_hash(sha256)
    assert none_hash() == kv_cache_utils.NONE_HASH
    tokens = list(range(5, 53))
    ours, parent = [], none_hash()
    theirs: list[bytes] = []
    for start in range(0, len(tokens), 16):
        parent = hash_block(parent, tokens[start : start + 16])
        ours.append(parent)
        theirs.append(hash_block_tokens(sha256, theirs[-1] if theirs else None, tokens[start : start + 16]))
    assert ours == theirs
    assert [external_hash(h) for h in ours] == [maybe_convert_block_hash(h) for h in theirs]
    chained: list[bytes] = []
    KVCache(4, 16).hash_blocks(tokens + [1, 2], chained)
    assert chained == ours


def _events(module: ModuleType) -> list[Any]:
    """The same events, from the simulator's wire module or vLLM's."""
    stored: dict[str, Any] = {
        "block_hashes": [1, 2**64 - 1],
        "parent_block_hash": 77,
        "token_ids": list(range(8)),
        "block_size": BLOCK,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "extra_keys": [None, None],
        "group_idx": 0,
    }
    return [
        module.BlockStored(**stored),
        module.BlockStored(**stored | {"parent_block_hash": None}),
        module.BlockRemoved(block_hashes=[3], medium="GPU", group_idx=0),
        module.AllBlocksCleared(),
    ]


def test_batches_encode_to_vllms_bytes() -> None:
    for rank in (None, 0):
        ours = wire.KVEventBatch(ts=1.5, events=_events(wire), data_parallel_rank=rank)
        theirs = vllm_events.KVEventBatch(ts=1.5, events=_events(vllm_events), data_parallel_rank=rank)
        assert _encoded(ours) == _encoded(theirs)


class _Pair:
    """vLLM's `BlockPool` (one more block: its null block) and the simulator's cache, driven alike."""

    def __init__(self, num_blocks: int) -> None:
        kv_cache_utils.init_none_hash(sha256)
        self.pool = BlockPool(num_blocks + 1, True, BLOCK, enable_kv_cache_events=True)
        self.cache = KVCache(num_blocks, BLOCK)
        self.hasher = get_request_block_hasher(BLOCK, sha256)

    def run(self, token_ids: Sequence[int]) -> list[int]:
        """One sequence: hit, touch, allocate the rest, cache its full blocks, free. Returns its block ids."""
        request = Request("r", list(token_ids), SamplingParams(max_tokens=1), None, block_hasher=self.hasher)
        hit = []
        for block_hash in request.block_hashes[: (len(token_ids) - 1) // BLOCK]:
            found = self.pool.get_cached_block(block_hash, [0])
            if found is None:
                break
            hit.append(found[0])
        hashes: list[bytes] = []
        self.cache.hash_blocks(token_ids, hashes)
        our_hit = self.cache.longest_hit(hashes, len(token_ids))
        assert [b.block_id for b in our_hit] == [b.block_id - 1 for b in hit]
        needed = -(-len(token_ids) // BLOCK) - len(hit)
        self.pool.touch(hit)
        self.cache.touch(our_hit)
        theirs = hit + self.pool.get_new_blocks(needed)
        ours = our_hit + self.cache.allocate(needed)
        full = len(token_ids) // BLOCK
        self.pool.cache_full_blocks(request, theirs, len(hit), full, BLOCK, 0)
        self.cache.cache_full_blocks(ours, hashes, token_ids, len(our_hit), full)
        self.pool.free_blocks(reversed(theirs))
        self.cache.free(ours)
        assert [b.block_id for b in ours] == [b.block_id - 1 for b in theirs]
        assert _encoded(wire.KVEventBatch(ts=0.0, events=self.cache.take_events())) == _encoded(
            vllm_events.KVEventBatch(ts=0.0, events=self.pool.take_events())
        )
        return [b.block_id for b in ours]


def test_the_cache_allocates_evicts_and_publishes_as_vllms_block_pool() -> None:
    pair = _Pair(num_blocks=6)
    a, b = list(range(8)), list(range(10, 18))
    pair.run(a)
    pair.run(b)
    pair.run([*a, 99, 98])  # a hit: its blocks leave the free queue; a partial block is freed to the head
    pair.run(list(range(30, 50)))  # evicts across the queue
    pair.run(b)
    assert pair.cache.usage() == 0.0


def test_the_routers_decoder_indexes_the_simulators_batches() -> None:
    async def run() -> None:
        payloads: list[bytes] = []

        def publish(events: list[wire.KVCacheEvent]) -> None:
            payloads.append(_encoded(wire.KVEventBatch(ts=0.0, events=events, data_parallel_rank=0)))

        async def no_time(seconds: float) -> None:
            pass

        engine = SimEngine(SimModel(block_size=BLOCK, num_blocks=8), [7], publish=publish, sleep=no_time)
        prompt = list(range(100, 112))
        async for _ in engine.generate("a", prompt, 6):
            pass
        index = KVBlockIndex()
        for payload in payloads:
            apply_batch(index, "sim-0", payload)
        # The prompt's 3 blocks, and the one the generated tokens filled.
        keys = chain_keys([*prompt, 7, 7, 7, 7], BLOCK)
        assert index.matched_blocks(keys, ["sim-0", "other"]) == {"sim-0": 4, "other": 0}
        engine.reset()
        apply_batch(index, "sim-0", payloads[-1])
        assert index.matched_blocks(keys, ["sim-0"]) == {"sim-0": 0}

    asyncio.run(run())


def test_the_publisher_streams_numbered_batches_and_replays_them_from_any_number() -> None:
    async def run() -> None:
        context = zmq.asyncio.Context()
        publisher = SimKVPublisher(topic="sim", context=context)
        await publisher.start()
        subscriber = context.socket(zmq.SUB)
        subscriber.setsockopt(zmq.SUBSCRIBE, b"sim")
        subscriber.connect(publisher.endpoint)
        dealer = context.socket(zmq.DEALER)
        dealer.connect(publisher.replay_endpoint)
        try:
            # A SUB socket misses what is sent before it joined: publish until one batch arrives.
            published = 0
            while not await subscriber.poll(20):
                publisher.publish([wire.AllBlocksCleared()])
                published += 1
            stored = wire.BlockStored([5], None, [1, 2, 3, 4], BLOCK, None, "GPU", None, [None], 0)
            publisher.publish([stored])
            numbers = []
            while len(numbers) < 1 or numbers[-1] < published:
                topic, number, payload = await subscriber.recv_multipart()
                assert topic == b"sim"
                numbers.append(sequence_number(number))
            last = published
            assert numbers == list(range(numbers[0], last + 1)), "numbered from 0, one more each batch"
            index = KVBlockIndex()
            assert apply_batch(index, "sim-0", payload) == 1
            assert index.matched_blocks(chain_keys([1, 2, 3, 4], BLOCK), ["sim-0"]) == {"sim-0": 1}
            stamp, _, rank = msgspec.msgpack.decode(payload)
            assert stamp > 0 and rank == 0

            for start in (0, last):
                await dealer.send_multipart([b"", sequence_frame(start)])
                numbers = []
                while True:
                    empty, topic, number, payload = await asyncio.wait_for(dealer.recv_multipart(), 1.0)
                    assert empty == b""
                    if sequence_number(number) == END_OF_REPLAY:
                        assert (topic, payload) == (b"", b"")
                        break
                    assert topic == b"sim"
                    numbers.append(sequence_number(number))
                assert numbers == list(range(start, last + 1))
        finally:
            publisher.close()
            subscriber.close(linger=0)
            dealer.close(linger=0)
            context.term()

    asyncio.run(run())
