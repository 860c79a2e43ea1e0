"""The KV block index from vLLM's own event encoding: chain keys, stored / removed / cleared, orphans, the stream's
sequence rule, and the routed-prefix approximation with its TTL."""

from __future__ import annotations

import msgspec
import pytest
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

from routers.kv_events import Step, StreamPosition, apply_batch, sequence_frame, sequence_number
from routers.kv_index import KVBlockIndex, PromptChain, RoutedPrefixes, chain_keys

BLOCK = 4


def _stored(hashes: list[object], parent: object | None, tokens: list[int], **keyed: object) -> BlockStored:
    fields: dict[str, object] = {"lora_id": None, "medium": "GPU", "lora_name": None, **keyed}
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=BLOCK, **fields)


def _batch(*events: object) -> bytes:
    """A batch as vLLM's ZMQ publisher encodes it."""
    return msgspec.msgpack.Encoder().encode(KVEventBatch(ts=0.0, events=list(events), data_parallel_rank=0))


def test_chain_keys_cover_full_blocks_only_and_depend_on_the_whole_prefix() -> None:
    keys = chain_keys(list(range(10)), BLOCK)
    assert len(keys) == 2
    assert chain_keys(list(range(8)), BLOCK) == keys
    assert chain_keys([99, 1, 2, 3, 4, 5, 6, 7], BLOCK)[1] != keys[1], "block 2's key must depend on block 1"


def test_stored_events_index_the_blocks_under_the_requests_own_keys() -> None:
    index = KVBlockIndex()
    tokens = list(range(12))
    # Engine hashes are the engine's own (bytes or ints, seeded per process): the index never needs to compute them.
    apply_batch(index, "a", _batch(_stored([b"h1", b"h2"], None, tokens[:8])))
    apply_batch(index, "a", _batch(_stored([b"h3"], b"h2", tokens[8:12])))
    apply_batch(index, "b", _batch(_stored([7], None, tokens[:4])))
    keys = chain_keys(tokens + [50, 51], BLOCK)
    assert index.matched_blocks(keys, ["a", "b", "c"]) == {"a": 3, "b": 1, "c": 0}
    assert index.block_size == BLOCK and index.blocks("a") == 3


def test_removed_and_cleared_blocks_leave_the_index() -> None:
    index = KVBlockIndex()
    tokens = list(range(8))
    apply_batch(index, "a", _batch(_stored([1, 2], None, tokens)))
    apply_batch(index, "b", _batch(_stored([5, 6], None, tokens)))
    apply_batch(index, "a", _batch(BlockRemoved(block_hashes=[2], medium="GPU")))
    keys = chain_keys(tokens, BLOCK)
    assert index.matched_blocks(keys, ["a", "b"]) == {"a": 1, "b": 2}
    apply_batch(index, "b", _batch(AllBlocksCleared()))
    assert index.matched_blocks(keys, ["a", "b"]) == {"a": 1, "b": 0}
    index.cleared("a")
    assert index.matched_blocks(keys, ["a", "b"]) == {"a": 0, "b": 0} and index.replicas() == []


@pytest.mark.parametrize(
    "keyed",
    [{"extra_keys": [("salt-1",)]}, {"lora_name": "adapter", "lora_id": 1}, {"medium": "CPU"}],
    ids=["cache_salt", "lora", "offload_tier"],
)
def test_blocks_a_plain_prompt_cannot_hit_are_not_indexed(keyed: dict[str, object]) -> None:
    """vLLM hashes a salted, LoRA or multimodal block with its extra keys: the same tokens of another request do not
    hit it. A block stored in an offload tier is not in the engine's own cache."""
    index = KVBlockIndex()
    tokens = list(range(8))
    apply_batch(index, "a", _batch(_stored([1, 2], None, tokens, **keyed)))
    assert index.matched_blocks(chain_keys(tokens, BLOCK), ["a"]) == {"a": 0}


def test_an_offload_tiers_removal_leaves_the_engines_own_block() -> None:
    index = KVBlockIndex()
    tokens = list(range(8))
    apply_batch(index, "a", _batch(_stored([1, 2], None, tokens)))
    apply_batch(index, "a", _batch(BlockRemoved(block_hashes=[2], medium="CPU")))
    assert index.matched_blocks(chain_keys(tokens, BLOCK), ["a"]) == {"a": 2}


def test_a_block_whose_parent_was_never_seen_is_not_indexed() -> None:
    index = KVBlockIndex()
    apply_batch(index, "a", _batch(_stored([9], b"unknown-parent", [1, 2, 3, 4])))
    assert index.orphans == 1 and index.blocks("a") == 0


def test_a_batch_that_does_not_decode_is_refused() -> None:
    with pytest.raises(ValueError, match="not a KV event batch"):
        apply_batch(KVBlockIndex(), "a", b"\xc1 garbage")


def test_the_stream_applies_in_order_skips_what_it_applied_and_names_gaps() -> None:
    position = StreamPosition()
    assert position.step(5) == Step.APPLY
    position.applied(5)
    assert position.step(6) == Step.APPLY
    assert position.step(4) == Step.SKIP
    assert position.step(9) == Step.GAP and position.expected == 6
    assert sequence_number(sequence_frame(-1)) == -1 and sequence_number((7).to_bytes(8, "big")) == 7


def test_routed_prefixes_match_until_their_ttl_and_forget_a_replica() -> None:
    now = [0.0]
    routed = RoutedPrefixes(ttl_s=10.0, clock=lambda: now[0])
    keys = chain_keys(list(range(12)), BLOCK)
    routed.routed("a", keys[:2])
    assert routed.matched_blocks(keys, "a") == 2 and routed.matched_blocks(keys, "b") == 0
    now[0] = 11.0
    assert routed.matched_blocks(keys, "a") == 0
    routed.routed("a", keys)
    routed.forget("a")
    assert routed.matched_blocks(keys, "a") == 0


def test_routed_prefixes_stay_bounded() -> None:
    routed = RoutedPrefixes(ttl_s=60.0, max_keys=3)
    keys = chain_keys(list(range(20)), BLOCK)
    routed.routed("a", keys)
    assert routed.matched_blocks(keys, "a") == 0, "the oldest keys (the prefix's start) went first"
    assert len(routed) == 3


def test_a_prompt_chain_read_in_parts_has_the_whole_prompts_keys() -> None:
    tokens = list(range(50))
    chain = PromptChain(block_size=4)
    for end in (0, 3, 9, 9, 24, 50):
        assert chain.extended(tokens[:end]) == chain_keys(tokens[:end], 4)
