"""vLLM's KV event wire format (`vllm.distributed.kv_events`), restated without importing vLLM: the simulated engine
publishes batches that encode byte for byte as a real engine's.

msgspec encodes a Struct from its class options and its fields, in declaration order, so these copy both:
`KVEventBatch` is an array (`[ts, [event, ...], data_parallel_rank]`), each event a map tagged `type` with its class
name; fields left at their default are omitted. `BlockStored` and `BlockRemoved` carry the fields vLLM 0.32 fills
for a plain request (`extra_keys` one None per block, `group_idx` 0); the fields it adds for LoRA, multimodal,
offload tiers and sessions (`kv_cache_spec_*`, `locality`, `ownership`, `session_id`) are never set here, so they are
left out: omitted either way, they cannot change a byte.
"""

from __future__ import annotations

from typing import Any

import msgspec

# vLLM's name for an engine's own KV cache tier (`MEDIUM_GPU`).
MEDIUM_GPU = "GPU"


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """One change to an engine's prefix cache."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """The events of one engine step, as one message."""

    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None
