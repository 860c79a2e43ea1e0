"""A paged KV cache with vLLM v1's prefix caching (`vllm/v1/core/block_pool.py`, `kv_cache_utils.py`), without the
tensors: which blocks hold which prefix, which are free, what is evicted, and the events a real engine publishes.

- **Block hash**: vLLM's default (`prefix_caching_hash_algo` sha256): block i's hash is
  `sha256(pickle((hash of block i-1, tuple(its token ids), None)))`, block 0's parent being `NONE_HASH`, the sha256
  of the pickled seed: `PYTHONHASHSEED` when set, else "vllm-none-hash". So an engine and its stand-in, or two
  stand-ins, name the same prefix alike. Events carry the hash's low 64 bits as an int (vLLM's
  `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`, on by default).
- **Hits**: the longest run of cached blocks from a sequence's first block, at most `num_tokens - 1` tokens rounded
  down to whole blocks: the last token is always computed, for its logits. Only full blocks are ever cached.
- **Free queue, LRU**: allocation takes from the head. A sequence frees its blocks tail first: those holding no hash
  go to the head (reused first: they can never hit), cached ones to the tail, so the least recently used prefix is
  evicted first, and the end of a prefix before its start. A cached block hit while free leaves the queue ("touch").
  Reallocating a free block that still carries a hash drops the hash: a `BlockRemoved` event.
- **Duplicates**: as in vLLM, a block is never deduplicated on caching (block tables are append-only), so one hash
  may name several blocks; a hit takes the first.
- **Counters** as vLLM's `PrefixCacheStats` for new requests (not resumed ones): `requests`, `queries` (their
  tokens), `hits` (their cached tokens).

vLLM reserves one block of its pool as a null block; `num_blocks` here counts usable blocks only.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from services.replica.sim.kv_events_wire import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
)

# vLLM's seed of the first parent hash when PYTHONHASHSEED is unset (`DEFAULT_NONE_HASH_SEED`).
DEFAULT_NONE_HASH_SEED = "vllm-none-hash"
_EXTERNAL_MASK = (1 << 64) - 1


def _sha256(value: object) -> bytes:
    return hashlib.sha256(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def none_hash() -> bytes:
    """Block 0's parent hash, from the environment as vLLM's `init_none_hash` reads it at engine start."""
    return _sha256(os.environ.get("PYTHONHASHSEED", DEFAULT_NONE_HASH_SEED))


def hash_block(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """A full block's hash (vLLM's `hash_block_tokens` with sha256 and no extra keys)."""
    return _sha256((parent, tuple(token_ids), None))


def external_hash(block_hash: bytes) -> int:
    """The hash as events carry it (vLLM's `maybe_convert_block_hash`)."""
    return int.from_bytes(block_hash, "big") & _EXTERNAL_MASK


@dataclass(slots=True, eq=False)
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None


class KVCache:
    """`num_blocks` blocks of `block_size` tokens; the events of its changes wait in `take_events`."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._blocks = [Block(block_id) for block_id in range(num_blocks)]
        # Free blocks, next to allocate first. An OrderedDict: O(1) at both ends and for a touch in the middle.
        self._free: OrderedDict[int, Block] = OrderedDict((block.block_id, block) for block in self._blocks)
        self._cached: dict[bytes, dict[int, Block]] = {}
        self._none_hash = none_hash()
        self._events: list[KVCacheEvent] = []
        self.requests = self.queries = self.hits = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    def usage(self) -> float:
        """The share of blocks in use (referenced by a sequence)."""
        return (self.num_blocks - len(self._free)) / self.num_blocks

    def hash_blocks(self, token_ids: Sequence[int], hashes: list[bytes]) -> None:
        """Extend `hashes`, a sequence's block hashes so far, with those of the blocks `token_ids` now fills."""
        size = self.block_size
        parent = hashes[-1] if hashes else self._none_hash
        for start in range(len(hashes) * size, len(token_ids) - size + 1, size):
            parent = hash_block(parent, token_ids[start : start + size])
            hashes.append(parent)

    def longest_hit(self, hashes: Sequence[bytes], num_tokens: int) -> list[Block]:
        """The cached blocks a sequence of `num_tokens` tokens starts with, leaving its last token to compute."""
        hit = []
        for block_hash in hashes[: (num_tokens - 1) // self.block_size]:
            holders = self._cached.get(block_hash)
            if holders is None:
                break
            hit.append(next(iter(holders.values())))
        return hit

    def blocks_to_allocate(self, num_tokens: int, hit: Sequence[Block]) -> int:
        """Free blocks a sequence of `num_tokens` tokens takes with `hit`: the blocks past the hit, and the hit
        blocks that sit in the free queue (taking them leaves fewer free)."""
        return -(-num_tokens // self.block_size) - len(hit) + sum(1 for block in hit if block.ref_cnt == 0)

    def record(self, num_tokens: int, num_hits: int) -> None:
        """Count a new request's lookup."""
        self.requests += 1
        self.queries += num_tokens
        self.hits += num_hits

    def touch(self, blocks: Sequence[Block]) -> None:
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def allocate(self, count: int) -> list[Block]:
        if count > len(self._free):
            raise ValueError(f"{count} blocks asked, {len(self._free)} free")
        blocks = []
        for _ in range(count):
            _, block = self._free.popitem(last=False)
            if block.block_hash is not None:
                self._evict(block, block.block_hash)
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def _evict(self, block: Block, block_hash: bytes) -> None:
        holders = self._cached[block_hash]
        del holders[block.block_id]
        if not holders:
            del self._cached[block_hash]
        block.block_hash = None
        self._events.append(BlockRemoved(block_hashes=[external_hash(block_hash)], medium=MEDIUM_GPU, group_idx=0))

    def cache_full_blocks(
        self, blocks: Sequence[Block], hashes: Sequence[bytes], token_ids: Sequence[int], num_cached: int, num_full: int
    ) -> None:
        """Cache a sequence's blocks `num_cached` to `num_full` (now full and computed): one `BlockStored`."""
        if num_cached >= num_full:
            return
        for block, block_hash in zip(blocks[num_cached:num_full], hashes[num_cached:num_full], strict=True):
            block.block_hash = block_hash
            self._cached.setdefault(block_hash, {})[block.block_id] = block
        size = self.block_size
        self._events.append(
            BlockStored(
                block_hashes=[external_hash(block_hash) for block_hash in hashes[num_cached:num_full]],
                parent_block_hash=external_hash(hashes[num_cached - 1]) if num_cached else None,
                token_ids=list(token_ids[num_cached * size : num_full * size]),
                block_size=size,
                lora_id=None,
                medium=MEDIUM_GPU,
                lora_name=None,
                extra_keys=[None] * (num_full - num_cached),
                group_idx=0,
            )
        )

    def free(self, blocks: Sequence[Block]) -> None:
        """Release a sequence's blocks (in the sequence's order)."""
        first, last = [], []
        for block in reversed(blocks):
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                (first if block.block_hash is None else last).append(block)
        for block in reversed(first):
            self._free[block.block_id] = block
            self._free.move_to_end(block.block_id, last=False)
        for block in last:
            self._free[block.block_id] = block

    def reset(self) -> None:
        """Forget every cached prefix and zero the counters; only with no block in use."""
        if len(self._free) != self.num_blocks:
            raise RuntimeError(f"{self.num_blocks - len(self._free)} blocks are in use")
        self._cached.clear()
        for block in self._blocks:
            block.block_hash = None
        self.requests = self.queries = self.hits = 0
        self._events.append(AllBlocksCleared())

    def take_events(self) -> list[KVCacheEvent]:
        events, self._events = self._events, []
        return events
