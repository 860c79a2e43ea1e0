"""Which replica's KV cache holds which prompt prefix: the index a `kv_aware` router keeps from the engines' events.

vLLM names a cached block by a hash of its parent's hash and its tokens, seeded per engine process: two engines (or
one engine restarted) name the same prefix differently. So the index keys blocks by its own *chain key*: block i's
key hashes block i-1's key and block i's token ids, from the same tokens the router computes for a request. A
`BlockStored` event carries the tokens, so each replica's engine hash is translated to the chain key once, when
stored; a removal finds it by the engine hash. Chain keys use Python's hash of a tuple of ints, which is the same in
every process (ints and tuples are not salted), so every router builds the same index from the same events.

Lookup walks a request's chain keys from the first block: a replica matches as long as it holds every block so far
(a cache holds a block only with its parents). Complexity: O(blocks) per lookup and per stored block.

A replica without events gets the same treatment from `RoutedPrefixes`: the prefixes this router itself sent there,
forgotten after a TTL (an approximation: the engine may have evicted them, and other routers' requests are unseen).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence

# Where the chain starts: block 0's parent key.
ROOT_KEY = 0x5_1CE_C0DE
_NONE: set[str] = set()


def chain_keys(token_ids: Sequence[int], block_size: int, parent: int = ROOT_KEY) -> list[int]:
    """The chain key of each *full* block of `token_ids` (a partial last block is never cached)."""
    keys = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash((parent, tuple(token_ids[start : start + block_size])))
        keys.append(parent)
    return keys


class PromptChain:
    """The chain keys of a prompt read in growing leading parts: each part's keys extend the previous part's, so
    no block is hashed twice. Every part must begin with the one before it."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.keys: list[int] = []

    def extended(self, token_ids: Sequence[int]) -> list[int]:
        done = len(self.keys) * self.block_size
        self.keys.extend(chain_keys(token_ids[done:], self.block_size, self.keys[-1] if self.keys else ROOT_KEY))
        return self.keys

    def walk(self, token_ids: Sequence[int]) -> Iterator[int]:
        """Each full block's key in order, computed only as far as the caller reads."""
        index = 0
        while True:
            if index == len(self.keys):
                start = index * self.block_size
                if start + self.block_size > len(token_ids):
                    return
                parent = self.keys[-1] if self.keys else ROOT_KEY
                self.keys.append(hash((parent, tuple(token_ids[start : start + self.block_size]))))
            yield self.keys[index]
            index += 1


class KVBlockIndex:
    """Chain key -> replicas holding that block, from each replica's stored / removed / cleared events."""

    def __init__(self) -> None:
        self._holders: dict[int, set[str]] = {}
        # Per replica: engine hash -> chain key (what its removals name), and how many engine blocks map to a key.
        self._engine_keys: dict[str, dict[object, int]] = {}
        self._key_refs: dict[str, dict[int, int]] = {}
        self.block_size: int | None = None
        # Stored blocks whose parent this index never saw (a gap the subscriber did not repair): not indexed.
        self.orphans = 0

    def replicas(self) -> list[str]:
        return sorted(self._engine_keys)

    def blocks(self, replica_id: str) -> int:
        return len(self._key_refs.get(replica_id, ()))

    def stored(
        self,
        replica_id: str,
        engine_hashes: Sequence[object],
        parent_hash: object | None,
        token_ids: Sequence[int],
        block_size: int,
    ) -> None:
        engine_keys = self._engine_keys.setdefault(replica_id, {})
        refs = self._key_refs.setdefault(replica_id, {})
        self.block_size = block_size
        if parent_hash is None:
            parent = ROOT_KEY
        elif parent_hash in engine_keys:
            parent = engine_keys[parent_hash]
        else:
            self.orphans += len(engine_hashes)
            return
        keys = chain_keys(token_ids, block_size, parent)
        for engine_hash, key in zip(engine_hashes, keys, strict=False):
            if engine_hash in engine_keys:
                continue
            engine_keys[engine_hash] = key
            refs[key] = refs.get(key, 0) + 1
            self._holders.setdefault(key, set()).add(replica_id)

    def removed(self, replica_id: str, engine_hashes: Iterable[object]) -> None:
        engine_keys = self._engine_keys.get(replica_id, {})
        refs = self._key_refs.get(replica_id, {})
        for engine_hash in engine_hashes:
            key = engine_keys.pop(engine_hash, None)
            if key is None:
                continue
            refs[key] -= 1
            if refs[key] == 0:
                del refs[key]
                self._unhold(key, replica_id)

    def cleared(self, replica_id: str) -> None:
        """Every block of the replica is gone (its cache was reset, or it left, or its events had a gap)."""
        for key in self._key_refs.pop(replica_id, {}):
            self._unhold(key, replica_id)
        self._engine_keys.pop(replica_id, None)

    def _unhold(self, key: int, replica_id: str) -> None:
        holders = self._holders.get(key)
        if holders is not None:
            holders.discard(replica_id)
            if not holders:
                del self._holders[key]

    def holders(self, key: int) -> set[str]:
        """The replicas holding the block of this chain key (the index's own set: read, never change it)."""
        return self._holders.get(key, _NONE)

    def matched_blocks(self, keys: Sequence[int], replica_ids: Iterable[str]) -> dict[str, int]:
        """How many leading blocks of `keys` each of `replica_ids` holds (0 when none)."""
        matched = dict.fromkeys(replica_ids, 0)
        alive = set(matched)
        for depth, key in enumerate(keys):
            alive &= self._holders.get(key, set())
            if not alive:
                break
            for replica_id in alive:
                matched[replica_id] = depth + 1
        return matched


class RoutedPrefixes:
    """The prefixes this router sent to each replica, each forgotten `ttl_s` after it was last sent: the index of a
    replica that publishes no events. Bounded: past `max_keys` the oldest keys go first."""

    def __init__(self, ttl_s: float, max_keys: int = 200_000, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self.max_keys = max_keys
        self._clock = clock
        # (replica, chain key) -> when it expires, oldest first.
        self._expiry: OrderedDict[tuple[str, int], float] = OrderedDict()

    def __len__(self) -> int:
        return len(self._expiry)

    def routed(self, replica_id: str, keys: Sequence[int]) -> None:
        expires = self._clock() + self.ttl_s
        for key in keys:
            entry = (replica_id, key)
            self._expiry[entry] = expires
            self._expiry.move_to_end(entry)
        while len(self._expiry) > self.max_keys:
            self._expiry.popitem(last=False)

    def forget(self, replica_id: str) -> None:
        for entry in [e for e in self._expiry if e[0] == replica_id]:
            del self._expiry[entry]

    def matched_blocks(self, keys: Sequence[int], replica_id: str) -> int:
        now = self._clock()
        for depth, key in enumerate(keys):
            expires = self._expiry.get((replica_id, key))
            if expires is None or expires < now:
                return depth
        return len(keys)
