"""The simulated engine core (`services/replica/sim/`) on a fake clock: prefix hits capped at all but the last token,
LRU eviction with its `BlockRemoved` events, recompute preemption, chunked prefill timed as the sum of its steps,
aborts that free blocks, the load it reports and its counters."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from services.replica.sim.engine import EngineLoad, SimEngine, SimOutput
from services.replica.sim.kv_cache import external_hash, hash_block, none_hash
from services.replica.sim.kv_events_wire import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from services.replica.sim.model import SimModel

BLOCK = 4
OUTPUT = (7, 8, 9)


class Clock:
    """Fake time for one engine: a step's sleep first yields (consumers take the previous step's outputs at that
    step's time), then counts the step and, with `engine` set, the engine's load while the step runs."""

    def __init__(self) -> None:
        self.now = 0.0
        self.steps: list[float] = []
        self.loads: list[EngineLoad] = []
        self.engine: SimEngine | None = None

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(0)
        self.steps.append(seconds)
        self.now += seconds
        if self.engine is not None:
            self.loads.append(self.engine.load())


def _engine(clock: Clock, batches: list[list[KVCacheEvent]] | None = None, **model: int) -> SimEngine:
    settings = {"block_size": BLOCK, "num_blocks": 8, "max_num_seqs": 4, "max_num_batched_tokens": 64, **model}
    publish = None if batches is None else batches.append
    engine = SimEngine(SimModel(**settings), OUTPUT, publish=publish, sleep=clock.sleep)
    clock.engine = engine
    return engine


async def _outputs(engine: SimEngine, request_id: str, prompt: Sequence[int], max_tokens: int) -> list[SimOutput]:
    return [output async for output in engine.generate(request_id, list(prompt), max_tokens)]


def _hashes(token_ids: Sequence[int]) -> list[int]:
    """The event hashes of the full blocks of `token_ids`."""
    hashes, parent = [], none_hash()
    for start in range(0, len(token_ids) - BLOCK + 1, BLOCK):
        parent = hash_block(parent, token_ids[start : start + BLOCK])
        hashes.append(external_hash(parent))
    return hashes


def _stored(token_ids: Sequence[int], first: int, last: int) -> BlockStored:
    """The event of caching blocks `first` to `last` (exclusive) of a sequence."""
    hashes = _hashes(token_ids)
    return BlockStored(
        block_hashes=hashes[first:last],
        parent_block_hash=hashes[first - 1] if first else None,
        token_ids=list(token_ids[first * BLOCK : last * BLOCK]),
        block_size=BLOCK,
        lora_id=None,
        medium="GPU",
        lora_name=None,
        extra_keys=[None] * (last - first),
        group_idx=0,
    )


def _removed(token_ids: Sequence[int], block: int) -> BlockRemoved:
    return BlockRemoved(block_hashes=[_hashes(token_ids)[block]], medium="GPU", group_idx=0)


def test_a_whole_prompt_in_cache_still_computes_its_last_block() -> None:
    async def run() -> None:
        engine = _engine(Clock())
        prompt = list(range(100, 108))  # two full blocks
        assert (await _outputs(engine, "a", prompt, 1))[0].num_cached_tokens == 0
        # 8 tokens may hit 7 at most: whole blocks of those, one.
        assert (await _outputs(engine, "b", prompt, 1))[0].num_cached_tokens == 4
        assert (await _outputs(engine, "c", [*prompt, 200], 1))[0].num_cached_tokens == 8
        assert (engine.cache.requests, engine.cache.queries, engine.cache.hits) == (3, 25, 12)

    asyncio.run(run())


def test_the_least_recently_used_prefix_is_evicted_first_tail_block_first() -> None:
    async def run() -> None:
        batches: list[list[KVCacheEvent]] = []
        engine = _engine(Clock(), batches, num_blocks=4)
        a, b, c = list(range(8)), list(range(10, 18)), list(range(20, 33))
        await _outputs(engine, "a", a, 1)
        await _outputs(engine, "b", b, 1)
        # a again hits both its blocks (they leave the free queue) and takes one more: b's tail goes first.
        assert (await _outputs(engine, "a2", [*a, 99], 1))[0].num_cached_tokens == 8
        assert batches[-1] == [_removed(b, 1)]
        # c takes every block: the free block without a hash, then b (least recently used), then a, tails first.
        await _outputs(engine, "c", c, 1)
        assert batches[-1] == [_removed(b, 0), _removed(a, 1), _removed(a, 0), _stored(c, 0, 3)]
        assert (await _outputs(engine, "a3", a, 1))[0].num_cached_tokens == 0

    asyncio.run(run())


def test_blocks_are_cached_as_prompt_and_generated_tokens_fill_them_one_batch_per_step() -> None:
    async def run() -> None:
        batches: list[list[KVCacheEvent]] = []
        clock = Clock()
        engine = _engine(clock, batches)
        prompt = list(range(8))
        outputs = await _outputs(engine, "a", prompt, 6)
        sequence = prompt + [token for output in outputs for token in output.token_ids]
        assert sequence[8:] == [7, 8, 9, 7, 8, 9]
        # The prompt's blocks in step 1; the block of generated tokens 0-3 once the step computing token 3 ran (5).
        assert len(clock.steps) == 6
        assert batches == [[_stored(sequence, 0, 2)], [_stored(sequence, 2, 3)]]

    asyncio.run(run())


def test_a_request_short_of_a_block_preempts_the_latest_admitted_which_recomputes_later() -> None:
    async def run() -> None:
        clock = Clock()
        engine = _engine(clock, num_blocks=4)
        # Each needs 3 blocks by its 8th token: the pair outgrows 4 blocks in step 6, and b (admitted last) yields.
        a, b = await asyncio.gather(_outputs(engine, "a", [1, 2, 3, 4], 8), _outputs(engine, "b", [5, 6, 7, 8], 8))
        for outputs in (a, b):
            assert [token for output in outputs for token in output.token_ids] == [7, 8, 9] * 2 + [7, 8]
            assert [output.finished for output in outputs] == [False] * 7 + [True]
        assert engine.preemptions_total == 1
        assert [(load.running, load.waiting) for load in clock.loads[5:9]] == [(1, 1), (1, 1), (1, 1), (1, 0)]
        # b comes back with its first block still cached and recomputes the 5 tokens after it as a prefill.
        model = engine.model
        assert clock.steps[8] == pytest.approx(model.step_seconds(5, 0))
        assert (engine.cache.requests, engine.generation_tokens_total) == (2, 16)

    asyncio.run(run())


def test_chunked_prefill_shares_each_steps_budget_with_decodes_and_time_is_the_sum_of_steps() -> None:
    async def run() -> None:
        clock = Clock()
        engine = _engine(clock, num_blocks=64)
        arrivals: dict[str, list[float]] = {"a": [], "b": []}

        async def consume(request_id: str, prompt: range, max_tokens: int) -> None:
            async for _ in engine.generate(request_id, list(prompt), max_tokens):
                arrivals[request_id].append(clock.now)

        await asyncio.gather(consume("a", range(1000, 1010), 4), consume("b", range(2000, 2150), 2))
        model = engine.model
        # Step 1: a's 10 and 54 of b's 150; then a decodes beside b's chunks of 63 and 33; then both decode.
        steps = [model.step_seconds(64, 0), model.step_seconds(63, 1), model.step_seconds(33, 1)]
        steps.append(model.step_seconds(0, 2))
        assert clock.steps == pytest.approx(steps)
        ends = [sum(steps[: i + 1]) for i in range(4)]
        assert arrivals["a"] == pytest.approx(ends)
        assert arrivals["b"] == pytest.approx(ends[2:])

    asyncio.run(run())


def test_an_abandoned_stream_aborts_its_request_and_frees_its_blocks_but_not_its_cache() -> None:
    async def run() -> None:
        engine = _engine(Clock(), max_num_seqs=1)
        prompt = list(range(8))
        stream = engine.generate("a", prompt, 10)
        await anext(stream)
        waiting = asyncio.create_task(_outputs(engine, "b", list(range(50, 58)), 1))
        await asyncio.sleep(0)
        assert (engine.load().running, engine.load().waiting) == (1, 1)
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        await stream.aclose()
        load = engine.load()
        assert (load.running, load.waiting, load.kv_tokens_used, load.prefill_tokens_pending) == (0, 0, 0, 0)
        assert (await _outputs(engine, "a2", [*prompt, 99], 1))[0].num_cached_tokens == 8
        await asyncio.sleep(0)
        assert len(asyncio.all_tasks()) == 1, "an idle engine runs no loop"

    asyncio.run(run())


def test_load_reports_queues_blocks_in_use_and_prompt_tokens_still_to_compute() -> None:
    async def run() -> None:
        clock = Clock()
        engine = _engine(clock, num_blocks=16, max_num_seqs=2, max_num_batched_tokens=16)
        prompts = [range(0, 12), range(100, 112), range(200, 212)]
        await asyncio.gather(*(_outputs(engine, name, prompt, 2) for name, prompt in zip("abc", prompts, strict=True)))
        # Step 1: a (12 tokens, 3 blocks) and 4 of b's (1 block); c waits for a seat. Step 2: a decodes into a 4th
        # block, b's last 8 (3 blocks); a ends. Step 3: b decodes into a 4th block, c's 12 (3 blocks).
        figures = [(s.running, s.waiting, s.kv_tokens_used, s.prefill_tokens_pending) for s in clock.loads[:3]]
        assert figures == [(2, 1, 16, 36), (2, 1, 28, 20), (2, 0, 28, 12)]
        assert (clock.loads[0].block_size, clock.loads[0].num_blocks) == (BLOCK, 16)

    asyncio.run(run())


def test_counters_count_finished_requests_and_reset_clears_cache_and_counters_only_when_idle() -> None:
    async def run() -> None:
        batches: list[list[KVCacheEvent]] = []
        engine = _engine(Clock(), batches)
        await asyncio.gather(_outputs(engine, "a", range(8), 3), _outputs(engine, "b", range(8), 2))
        totals = (engine.prompt_tokens_total, engine.generation_tokens_total, engine.requests_finished_total)
        assert totals == (16, 5, 2)
        stream = engine.generate("c", list(range(8)), 2)
        await anext(stream)
        with pytest.raises(RuntimeError):
            engine.reset()
        await stream.aclose()
        engine.reset()
        assert batches[-1] == [AllBlocksCleared()]
        assert (engine.prompt_tokens_total, engine.cache.queries, engine.cache.hits) == (0, 0, 0)
        assert (await _outputs(engine, "d", range(8), 1))[0].num_cached_tokens == 0

    asyncio.run(run())


def test_a_prompt_that_cannot_fit_with_its_max_tokens_is_refused_before_anything_is_queued() -> None:
    async def run() -> None:
        engine = _engine(Clock(), num_blocks=4)  # 16 tokens
        with pytest.raises(ValueError, match="exceed the KV cache"):
            await anext(engine.generate("a", list(range(13)), 4))
        assert engine.load().waiting == 0
        assert len(await _outputs(engine, "b", range(12), 4)) == 4

    asyncio.run(run())
