"""A simulated engine core, for benchmarks only: vLLM v1's continuous batching and prefix caching over a `KVCache`,
with each step's duration taken from a `SimModel` instead of a model run. A stand-in that lets one process hold many
replicas (all on one asyncio loop, no thread each) whose queueing, cache hits and KV events behave like vLLM's;
never a replacement for vLLM.

A request is its token ids (the prompt, then what it generated) and how many of them are computed. Each step, as
vLLM's scheduler with its defaults (FCFS, chunked prefill, recompute preemption):
1. Running requests, in admission order, each get their remaining tokens up to the step's token budget
   (`max_num_batched_tokens`): one for a request that decodes, a chunk for one still prefilling.
2. A request needing a block when none is free preempts the most recently admitted running request (it may be
   itself): its blocks are freed (cached ones stay cached) and it goes back to the head of the waiting queue, to
   recompute its prompt and the tokens it generated. A step that preempted admits nobody.
3. Waiting requests are admitted in order while the budget lasts and fewer than `max_num_seqs` run: each looks up
   its prefix, then must find free blocks for its whole sequence, or it and everyone behind it wait.
4. Blocks are given for the tokens scheduled, and the blocks those complete are cached at once (as vLLM's
   `allocate_slots`), so a request admitted later in the same step already hits them.
5. The step lasts `model.step_seconds(prompt tokens scheduled, requests decoding)`, awaited with `sleep`. Then a
   request whose scheduled tokens reach its last one samples a token: its first comes in the step its prefill
   completes. Token k of every request is `output_token_ids[k % len]`. A request at `max_tokens` finishes and frees
   its blocks. The step's KV events go to `publish` as one batch (none for a step without events).

The loop runs while there is work and is started by the next request: an idle engine costs nothing. A prompt that
cannot fit the cache with its `max_tokens` is refused (`ValueError`). A consumer that stops reading aborts its
request: it leaves the queues and frees its blocks.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from services.replica.request_seconds import RequestSeconds
from services.replica.sim.kv_cache import Block, KVCache
from services.replica.sim.kv_events_wire import KVCacheEvent
from services.replica.sim.model import SimModel


@dataclass(slots=True)
class SimOutput:
    token_ids: list[int]  # this step's new tokens
    finished: bool
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    prompt_tokens: int


@dataclass(slots=True)
class EngineLoad:
    running: int
    waiting: int
    kv_tokens_used: int  # blocks in use × block size
    prefill_tokens_pending: int  # not yet computed, over waiting and prefilling requests (a step in flight included)
    block_size: int
    num_blocks: int


@dataclass(slots=True, eq=False)
class _Request:
    request_id: str
    token_ids: list[int]
    prompt_tokens: int
    max_tokens: int
    outputs: asyncio.Queue[SimOutput | Exception] = field(default_factory=asyncio.Queue)
    block_hashes: list[bytes] = field(default_factory=list)
    blocks: list[Block] = field(default_factory=list)
    num_computed: int = 0
    num_cached_blocks: int = 0  # leading blocks the cache holds by hash
    num_cached_tokens: int = 0  # the prefix hit at its first admission
    decoding: bool = False  # sampled since its last admission
    preempted: bool = False
    done: bool = False
    arrived: float = field(default_factory=time.monotonic)

    @property
    def pending(self) -> int:
        return len(self.token_ids) - self.num_computed


class SimEngine:
    """One simulated engine; `publish` receives each step's KV events, `sleep` spends each step's time."""

    def __init__(
        self,
        model: SimModel,
        output_token_ids: Sequence[int],
        publish: Callable[[list[KVCacheEvent]], None] | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        if not output_token_ids:
            raise ValueError("output_token_ids is empty")
        self.model = model
        self.cache = KVCache(model.num_blocks, model.block_size)
        self._output_token_ids = tuple(output_token_ids)
        self._publish = publish
        self._sleep = sleep
        self._requests: dict[str, _Request] = {}
        self._waiting: deque[_Request] = deque()
        self._running: list[_Request] = []
        self._loop_task: asyncio.Task[None] | None = None
        self.prompt_tokens_total = self.generation_tokens_total = self.requests_finished_total = 0
        self.preemptions_total = 0
        self.request_seconds = RequestSeconds()

    async def generate(self, request_id: str, prompt_token_ids: list[int], max_tokens: int) -> AsyncIterator[SimOutput]:
        """The request's outputs, one per step that samples a token for it; a request refused raises `ValueError`
        before any."""
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} is already in flight")
        if not prompt_token_ids or max_tokens < 1:
            raise ValueError("a request needs a prompt and max_tokens >= 1")
        capacity = self.model.num_blocks * self.model.block_size
        if len(prompt_token_ids) > capacity - max_tokens:
            raise ValueError(
                f"{len(prompt_token_ids)} prompt tokens and max_tokens {max_tokens} exceed the KV cache "
                f"({capacity} tokens)"
            )
        request = _Request(request_id, list(prompt_token_ids), len(prompt_token_ids), max_tokens)
        self.cache.hash_blocks(request.token_ids, request.block_hashes)
        self._requests[request_id] = request
        self._waiting.append(request)
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.get_running_loop().create_task(self._loop())
        try:
            while True:
                output = await request.outputs.get()
                if isinstance(output, Exception):
                    raise output
                yield output
                if output.finished:
                    return
        finally:
            if not request.done:
                self._drop(request)

    def load(self) -> EngineLoad:
        return EngineLoad(
            running=len(self._running),
            waiting=len(self._waiting),
            kv_tokens_used=(self.cache.num_blocks - self.cache.num_free) * self.cache.block_size,
            prefill_tokens_pending=sum(r.pending for r in self._waiting)
            + sum(r.pending for r in self._running if not r.decoding),
            block_size=self.cache.block_size,
            num_blocks=self.cache.num_blocks,
        )

    def reset(self) -> None:
        """Forget the prefix cache and zero the counters; only with no request in flight."""
        if self._requests:
            raise RuntimeError(f"{len(self._requests)} requests in flight")
        self.cache.reset()
        self.prompt_tokens_total = self.generation_tokens_total = self.requests_finished_total = 0
        self.preemptions_total = 0
        self._emit()

    async def _loop(self) -> None:
        try:
            while self._running or self._waiting:
                scheduled = self._schedule()
                prefill = sum(tokens for request, tokens in scheduled if not request.decoding)
                decodes = sum(1 for request, _ in scheduled if request.decoding)
                await self._sleep(self.model.step_seconds(prefill, decodes))
                self._apply(scheduled)
        except Exception as error:  # a fault fails every request in flight rather than leaving them waiting
            for request in self._requests.values():
                request.outputs.put_nowait(error)
            raise

    def _schedule(self) -> list[tuple[_Request, int]]:
        budget = self.model.max_num_batched_tokens
        scheduled: list[tuple[_Request, int]] = []
        running_before = len(self._running)
        index = 0
        while index < len(self._running) and budget > 0:
            request = self._running[index]
            tokens = min(request.pending, budget)
            if not self._make_room(request, self._blocks_short(request, tokens)):
                break
            self._extend(request, tokens)
            scheduled.append((request, tokens))
            budget -= tokens
            index += 1
        if len(self._running) < running_before:
            return scheduled
        while self._waiting and budget > 0 and len(self._running) < self.model.max_num_seqs:
            request = self._waiting[0]
            hit = self.cache.longest_hit(request.block_hashes, len(request.token_ids))
            if self.cache.blocks_to_allocate(len(request.token_ids), hit) > self.cache.num_free:
                break
            self._waiting.popleft()
            self.cache.touch(hit)
            request.blocks = list(hit)
            request.num_cached_blocks = len(hit)
            request.num_computed = len(hit) * self.cache.block_size
            if not request.preempted:
                request.num_cached_tokens = request.num_computed
                self.cache.record(len(request.token_ids), request.num_computed)
            tokens = min(request.pending, budget)
            self._extend(request, tokens)
            self._running.append(request)
            scheduled.append((request, tokens))
            budget -= tokens
        return scheduled

    def _blocks_short(self, request: _Request, tokens: int) -> int:
        """New blocks `request` needs to compute its next `tokens`."""
        return -(-(request.num_computed + tokens) // self.cache.block_size) - len(request.blocks)

    def _make_room(self, request: _Request, blocks: int) -> bool:
        """Preempt the latest admitted running requests until `blocks` are free; False when `request` had to go."""
        while blocks > self.cache.num_free:
            victim = self._running.pop()
            self.cache.free(victim.blocks)
            victim.blocks = []
            victim.num_computed = victim.num_cached_blocks = 0
            victim.decoding = False
            victim.preempted = True
            self._waiting.appendleft(victim)
            self.preemptions_total += 1
            if victim is request:
                return False
        return True

    def _extend(self, request: _Request, tokens: int) -> None:
        """Give `request` the blocks for its next `tokens` and cache the blocks those complete."""
        request.blocks += self.cache.allocate(self._blocks_short(request, tokens))
        full = (request.num_computed + tokens) // self.cache.block_size
        self.cache.cache_full_blocks(
            request.blocks, request.block_hashes, request.token_ids, request.num_cached_blocks, full
        )
        request.num_cached_blocks = full

    def _apply(self, scheduled: list[tuple[_Request, int]]) -> None:
        for request, tokens in scheduled:
            if request.done:  # aborted during the step
                continue
            request.num_computed += tokens
            if request.pending:
                continue  # a chunk of its prefill
            generated = len(request.token_ids) - request.prompt_tokens
            request.token_ids.append(self._output_token_ids[generated % len(self._output_token_ids)])
            self.cache.hash_blocks(request.token_ids, request.block_hashes)
            request.decoding = True
            if generated == 0:
                self.prompt_tokens_total += request.prompt_tokens
            self.generation_tokens_total += 1
            finished = generated + 1 == request.max_tokens
            request.outputs.put_nowait(
                SimOutput([request.token_ids[-1]], finished, request.num_cached_tokens, request.prompt_tokens)
            )
            if finished:
                self.requests_finished_total += 1
                self.request_seconds.finished(time.monotonic() - request.arrived)
                self._drop(request)
        self._emit()

    def _drop(self, request: _Request) -> None:
        """The request leaves (finished or aborted): its blocks are freed, cached ones stay cached."""
        request.done = True
        del self._requests[request.request_id]
        if request in self._running:
            self._running.remove(request)
            self.cache.free(request.blocks)
            request.blocks = []
        else:
            self._waiting.remove(request)

    def _emit(self) -> None:
        events = self.cache.take_events()
        if events and self._publish is not None:
            self._publish(events)
