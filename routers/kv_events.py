"""vLLM's KV event batches, decoded and applied to a `KVBlockIndex`; and the sequence rule of one publisher's stream.

vLLM's ZMQ publisher (`--kv-events-config`) sends each batch as (topic, 8-byte big-endian sequence number, msgpack
`KVEventBatch`): `[ts, [event, ...], data_parallel_rank]`, each event a map tagged `type`: `BlockStored` (new
blocks, their parent and tokens), `BlockRemoved` (evicted blocks) or `AllBlocksCleared`. Its replay socket resends
the batches it still buffers from a given sequence number, ending with sequence -1. Numbers rise by one per batch;
a jump means batches were lost (ask the replay socket); a number already applied (a replay overlapping the live
stream) is skipped. An engine that restarts publishes on a new port: a new stream, announced anew.

Only blocks a plain prompt's token chain can hit are indexed: those in the engine's own cache (`medium` "GPU", the
name vLLM gives its primary tier on every device, or none), keyed by tokens alone. A block stored with `extra_keys`
(a LoRA adapter, multimodal inputs, a `cache_salt`) or for a LoRA is hashed by the engine with those too, so the
same tokens from another request never hit it; an offload tier's store or removal leaves the primary cache's entry
as it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Protocol

import msgspec

from routers.engine_load import EngineLoads
from routers.kv_index import KVBlockIndex

END_OF_REPLAY = -1
# vLLM's name for the engine's own KV cache tier (`vllm.distributed.kv_events.MEDIUM_GPU`, on CPU engines too).
PRIMARY_MEDIUM = "GPU"


class ReplicaEvents(StrEnum):
    """Where a replica's score comes from."""

    EVENTS = "events"  # its engine's KV events
    APPROXIMATE = "approximate"  # it publishes none: what the router sent it
    LOST = "lost"  # its stream went away; ranked last until it is back


class KVEventTarget(Protocol):
    """What the router service's KV event subscriber feeds: a policy scored by its replicas' KV events (its entry's
    `kv_event_target`). `sources` says where each replica's score comes from; `block_size` is the engines' as
    announced (None until one did); `engine_loads`, what the router's engine load poller feeds."""

    index: KVBlockIndex
    sources: dict[str, ReplicaEvents]
    block_size: int | None
    engine_loads: EngineLoads

    def replica_left(self, replica_id: str) -> None: ...


def sequence_number(frame: bytes) -> int:
    return int.from_bytes(frame, "big", signed=True)


def sequence_frame(number: int) -> bytes:
    return number.to_bytes(8, "big", signed=True)


def apply_batch(index: KVBlockIndex, replica_id: str, payload: bytes) -> int:
    """Apply one encoded batch to the index as `replica_id`'s; returns how many events it held. A batch that does not
    decode raises `ValueError` (the stream is then resynchronized)."""
    try:
        decoded: Any = msgspec.msgpack.decode(payload)
        events = decoded[1]
    except (msgspec.DecodeError, IndexError, TypeError, KeyError) as error:
        raise ValueError(f"not a KV event batch: {error}") from None
    for event in events:
        if not isinstance(event, dict) or event.get("group_idx") not in (None, 0):
            continue  # a second KV cache group (hybrid models) has blocks of its own kind; group 0 decides
        kind = event.get("type")
        if event.get("medium") not in (None, PRIMARY_MEDIUM):
            continue
        if kind == "BlockStored":
            if (
                event.get("lora_name") is not None
                or event.get("lora_id") is not None
                or any(event.get("extra_keys") or ())
            ):
                continue
            index.stored(
                replica_id, event["block_hashes"], event["parent_block_hash"], event["token_ids"], event["block_size"]
            )
        elif kind == "BlockRemoved":
            index.removed(replica_id, event["block_hashes"])
        elif kind == "AllBlocksCleared":
            index.cleared(replica_id)
    return len(events)


class Step(StrEnum):
    APPLY = "apply"  # the next batch
    SKIP = "skip"  # already applied (seen in a replay)
    GAP = "gap"  # batches were lost: replay from `StreamPosition.expected`


@dataclass
class StreamPosition:
    """Where one publisher's stream is: the next sequence number expected (None before the first)."""

    expected: int | None = None

    def step(self, number: int) -> Step:
        if self.expected is None or number == self.expected:
            return Step.APPLY
        return Step.GAP if number > self.expected else Step.SKIP

    def applied(self, number: int) -> None:
        self.expected = number + 1
