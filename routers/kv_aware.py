"""KVAware: send a request to the replica where it costs the fewest tokens of work, counting the prefix its KV cache
already holds; by cached prefix and in-flight counts where the engines report no load.

The router turns the forwarded body into the prompt tokens vLLM will compute (`PromptTokens`: the served model's
tokenizer and chat template), cuts them into the engine's KV blocks and finds how many leading blocks each replica
holds (`KVBlockIndex`, fed by every replica's vLLM KV events; a replica that publishes none is scored by what this
router itself sent there, `RoutedPrefixes`).

**Token load** (every candidate's engine reported within `engine_load.STALE_AFTER_S`): a replica's cost is the
prefill it would do, the prompt less its cached prefix, plus its token load: the prompt tokens it has still to
compute and `decode_weight` times the KV its running requests hold (`EngineLoads`: the engines' reports plus this
router's placements since). The prompt's length is the same everywhere, so the ranking is by load minus cached
tokens (Dynamo's KV router weighs prefill and active blocks one to one). A hot prefix stays on the replica that
caches it until the KV of its requests there outweighs a whole prefill elsewhere, then a second replica warms up:
load follows the tokens, not the count of requests. The primary is the cheapest replica not saturated (below).

**In-flight counts** (the fallback): more matched blocks first, then fewer live in-flight requests
(`live_in_flight`: the open requests its frontends last counted, plus this router's decisions since).

Either way the primary is the best-ranked replica that is not saturated: its requests plus this one would pass both
`saturation_factor` times the mean (the bound of consistent hashing with bounded loads, Mirrokni et al. 2018) and
`saturation_floor`, or its live in-flight count its capacity. Its requests: on token load the engine's running and
waiting plus this router's placements still counted (a frontend samples its open requests every quarter second, so a
client's short requests one after another would count as open at once); in the fallback its live in-flight count.

Ties break by a hash of the prompt's first block and the replica id (the same in every router, and
spreading different prompts over equally loaded replicas); fallbacks follow in rank order. A replica whose event
stream was lost (its publisher went away: it died or restarted) holds nothing and ranks last until its stream is
back. Reasons: `match`, `approximate_match`, `saturated` (a longer match lost to load), `miss`, `no_index`,
`no_prompt`, `body_truncated`. Settings and measured figures: routers/README.md#kv_aware.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import mmh3
from pydantic import Field

from base.running_mean import RunningMean
from routers.core import DEFAULT_NUM_FALLBACK_REPLICAS, ReplicaView, RouteRequest, RoutingPolicy
from routers.engine_load import EngineLoads, TokenLoad
from routers.entry import PolicyContext, PolicyEntry, PolicyReport, PolicySettings
from routers.kv_events import ReplicaEvents
from routers.kv_index import KVBlockIndex, PromptChain, RoutedPrefixes
from routers.metrics import KV_REPLICAS
from routers.prompt_tokens import Tokenize

NAME = "kv_aware"
# Where a kv_aware router serves `kv_index_report` (the internal credential required), for operators and tests.
KV_INDEX_PATH = "/internal/kv-index"
# Equal to the acceptance bound on hot sessions (no replica over 1.5x the mean in flight): below it a prefix stays on
# the replica that caches it; past it a second replica warms up, at the price of one miss.
DEFAULT_SATURATION_FACTOR = 1.5
# Below this many live in-flight requests a replica is never saturated: at low load the mean is near 0 and the
# factor's bound is 1, which would spill every second request of a prefix; a replica batches a few sequences at
# little cost, while a spill costs a whole prefill elsewhere.
DEFAULT_SATURATION_FLOOR = 4
# How long a replica without events is taken to keep a prefix this router sent it: a small cache under load turns
# over in minutes; a longer guess sends conversations to blocks long evicted.
DEFAULT_APPROXIMATE_TTL_S = 120.0
# What a token of KV held by a running request weighs against a token of prefill: one to one, as Dynamo's KV router
# and llm-d's load-aware scoring weigh them. Lower keeps prefixes together longer under load, higher spreads sooner.
DEFAULT_DECODE_WEIGHT = 0.25
# What a token of the request's own prefill weighs against a token of the replica's load. Above 1: a miss is work the
# whole stack does (and the next requests queue behind), not only this request's wait.
DEFAULT_PREFIX_WEIGHT = 4.0
# A prompt whose tokens were read only as far as the ranking needed counts its body's bytes at the bytes per token
# of the prompts this router read whole (a running mean, the newest weighing `_BYTES_PER_TOKEN_WEIGHT`: about the
# last 50), starting from this (JSON-escaped English through a BPE vocabulary of 32k-128k tokens).
BODY_BYTES_PER_TOKEN = 4.0
_BYTES_PER_TOKEN_WEIGHT = 0.02
_TIE_SEED = 0x6B76


class KVAwareSettings(PolicySettings):
    saturation_factor: float = Field(DEFAULT_SATURATION_FACTOR, ge=1.0)
    saturation_floor: int = Field(DEFAULT_SATURATION_FLOOR, ge=1)
    approximate_ttl_s: float = Field(DEFAULT_APPROXIMATE_TTL_S, gt=0)
    decode_weight: float = Field(DEFAULT_DECODE_WEIGHT, ge=0)
    prefix_weight: float = Field(DEFAULT_PREFIX_WEIGHT, ge=0)
    num_fallback_replicas: int = Field(DEFAULT_NUM_FALLBACK_REPLICAS, ge=0)


def _tie_key(replica_id: str) -> int:
    return mmh3.hash64(replica_id, seed=_TIE_SEED, signed=False)[0]


class KVAware(RoutingPolicy):
    name = NAME
    sticky = True

    def __init__(
        self,
        tokenize: Tokenize,
        read_left: Callable[[], None] | None = None,
        saturation_factor: float = DEFAULT_SATURATION_FACTOR,
        saturation_floor: int = DEFAULT_SATURATION_FLOOR,
        approximate_ttl_s: float = DEFAULT_APPROXIMATE_TTL_S,
        num_fallback_replicas: int = DEFAULT_NUM_FALLBACK_REPLICAS,
        decode_weight: float = DEFAULT_DECODE_WEIGHT,
        prefix_weight: float = DEFAULT_PREFIX_WEIGHT,
    ) -> None:
        if saturation_factor < 1.0:
            raise ValueError(f"saturation_factor must be >= 1.0, got {saturation_factor}")
        super().__init__()
        self.tokenize = tokenize
        # What reads the prompt parts decisions left unread (`PromptTokens.read_left_pieces`), after the answer.
        self.read_left = read_left
        self.saturation_factor = saturation_factor
        self.saturation_floor = saturation_floor
        self.num_fallback_replicas = num_fallback_replicas
        self.decode_weight = decode_weight
        self.prefix_weight = prefix_weight
        self.index = KVBlockIndex()
        self.routed_prefixes = RoutedPrefixes(approximate_ttl_s)
        # Set by whoever feeds the index (the router's event subscriber); a replica not named here has no index yet.
        self.sources: dict[str, ReplicaEvents] = {}
        # The engines' block size, as the replicas announce it; None until one did.
        self.block_size: int | None = None
        # The engines' token loads, as the router service polls them, and the loads last computed from them.
        self.engine_loads = EngineLoads()
        self._kept_loads: _TokenLoads | None = None
        self._tie_keys: dict[str, int] = {}
        self.body_bytes_per_token = RunningMean(_BYTES_PER_TOKEN_WEIGHT, BODY_BYTES_PER_TOKEN)

    def on_replicas_changed(self, replica_ids: Sequence[str]) -> None:
        self._tie_keys = {replica_id: _tie_key(replica_id) for replica_id in replica_ids}

    def after_decision(self) -> None:
        if self.read_left is not None:
            self.read_left()

    def replica_left(self, replica_id: str) -> None:
        """Forget everything about a replica that left the set."""
        self.index.cleared(replica_id)
        self.routed_prefixes.forget(replica_id)
        self.sources.pop(replica_id, None)
        self.engine_loads.forget(replica_id)

    def live_in_flight(self, view: ReplicaView) -> int:
        """A replica's open requests as its frontends last counted them, plus what this router sent it since; with
        no count published, the base rule (this router's decisions of the last `forget_after_s`)."""
        if view.in_flight_sampled:
            return view.in_flight + self.tracker.placed_since_sample(view.replica_id)
        return super().live_in_flight(view)

    def token_loads(self, replicas: list[ReplicaView]) -> _TokenLoads | None:
        """Each replica's token load (prefill to come plus `decode_weight` times its running KV), or
        None unless every one of them has a fresh report. Kept between decisions while the replica set is the same
        (this router's placements are added to it as they are made, the replicas whose report came or placements
        expired since are computed anew): a decision pays for what changed, not for every replica."""
        book = self.engine_loads
        book.expire()
        changed = book.take_changed()
        kept = self._kept_loads
        if kept is not None and kept.version == book.version and kept.replicas is replicas:
            # Reports only get newer: while the oldest kept is fresh, every one is.
            if book.fresh_since(kept.oldest) and all(kept.update(r, book.load(r)) for r in changed & kept.costs.keys()):
                return kept
        ids = [view.replica_id for view in replicas]
        oldest = book.oldest_report(ids)
        if oldest is None or not book.fresh_since(oldest):
            self._kept_loads = None
            return None
        kept = _TokenLoads(book.version, replicas, oldest, self.decode_weight)
        for replica_id in ids:
            kept.update(replica_id, book.load(replica_id))
        self._kept_loads = kept
        return kept

    def _rank(self, replicas: list[ReplicaView], request: RouteRequest) -> tuple[list[list[ReplicaView]], str]:
        token_loads = self.token_loads(replicas)
        chain = PromptChain(self.block_size or 1)
        costs_now = token_loads.costs if token_loads is not None else None
        settled = _Settled(self.index, chain, costs_now, (self.block_size or 0) * self.prefix_weight)
        tokens, reason = self._prompt_tokens(request, settled)
        keys, matched, leader = self._matched(chain, tokens, replicas, settled)
        prompt_tokens = len(tokens)
        first = keys[0] if keys else mmh3.hash64(request.request_id, signed=False)[0]
        if token_loads is not None:
            block_size = self.block_size or 0
            weight = self.prefix_weight * block_size
            costs = {rid: load - matched[rid] * weight for rid, load in token_loads.costs.items()}
        else:
            costs = {view.replica_id: self.live_in_flight(view) for view in replicas}

        def order(view: ReplicaView) -> tuple[bool, float, int, int]:
            tie = self._tie_keys.get(view.replica_id) or _tie_key(view.replica_id)
            lost_stream = self.sources.get(view.replica_id) == ReplicaEvents.LOST
            if token_loads is not None:
                return lost_stream, costs[view.replica_id], 0, tie ^ first
            return lost_stream, -matched[view.replica_id], costs[view.replica_id], tie ^ first

        ranked = sorted(replicas, key=order)
        # Requests per replica: the engines' own counts where they report (a frontend samples its open requests every
        # quarter second, so a client's short requests one after the other would count as open at once).
        in_flight = costs if token_loads is None else token_loads.requests
        total = sum(in_flight.values()) if token_loads is None else token_loads.total_requests
        bound = max(self.saturation_floor, math.ceil(self.saturation_factor * (total + 1) / len(replicas)))
        primary = next(
            (view for view in ranked if not self._saturated(view, in_flight[view.replica_id], bound)), ranked[0]
        )
        longest = max(matched.values())
        if reason is None:
            if longest == 0:
                reason = "miss"
            elif matched[primary.replica_id] < longest:
                reason = "saturated"
            elif self.sources.get(primary.replica_id) == ReplicaEvents.APPROXIMATE:
                reason = "approximate_match"
            else:
                reason = "match"
        if keys and self.sources.get(primary.replica_id) == ReplicaEvents.APPROXIMATE:
            self.routed_prefixes.routed(primary.replica_id, keys)
        estimated_prompt = prompt_tokens
        if settled.cut:  # the rest of the prompt was never tokenized: its length from the body's
            estimated_prompt = max(prompt_tokens, round(len(request.body_prefix) / self.body_bytes_per_token.value))
        elif prompt_tokens:
            self.body_bytes_per_token.add(len(request.body_prefix) / prompt_tokens)
        held = matched[primary.replica_id] * (self.block_size or 0)
        if primary.replica_id == leader:
            # The walk stopped once this replica alone held the prompt and led: taken as holding all of it (a
            # conversation's history, a document asked again; what follows is a turn or a question).
            held = estimated_prompt
        cached = min(held, estimated_prompt)
        self.engine_loads.placed(primary.replica_id, estimated_prompt, estimated_prompt - cached)
        if token_loads is not None:
            token_loads.placed(primary.replica_id, estimated_prompt - cached, cached)
        fallbacks = [view for view in ranked if view is not primary][: self.num_fallback_replicas]
        return [[primary], *([view] for view in fallbacks)], reason

    def _prompt_tokens(self, request: RouteRequest, settled: _Settled) -> tuple[list[int], str | None]:
        """The request's prompt tokens as far as the ranking needs them, or none and the reason it has none."""
        if self.block_size is None:
            return [], "no_index"
        if request.body_truncated:
            return [], "body_truncated"
        # A replica scored by what this router sent it learns the whole prompt: tokenize all of it then.
        approximate = ReplicaEvents.APPROXIMATE in self.sources.values()
        tokens = self.tokenize(request.body_prefix, None if approximate else settled.read_on)
        if tokens is None:
            return [], "no_prompt"
        return tokens, None

    def _matched(
        self, chain: PromptChain, tokens: list[int], replicas: list[ReplicaView], settled: _Settled
    ) -> tuple[list[int], dict[str, int], str | None]:
        """The chain keys computed, how many leading blocks each replica holds, and the replica the walk stopped at
        because it led (None: the walk ran out). The walk stops where no replica holds the next block, or where one
        alone does and the ranking is settled (`_Settled.blocks_to_lead`): its keys past that are never hashed (an
        8k-token prompt cached on one replica costs its first blocks, not 512 hashes); that replica's count is then
        a lower bound."""
        ids = [view.replica_id for view in replicas]
        matched = dict.fromkeys(ids, 0)
        if not tokens:
            return [], matched, None
        if ReplicaEvents.APPROXIMATE in self.sources.values():
            keys = chain.extended(tokens)
            matched = self.index.matched_blocks(keys, ids)
            for replica_id in ids:
                if self.sources.get(replica_id) == ReplicaEvents.APPROXIMATE:
                    matched[replica_id] = self.routed_prefixes.matched_blocks(keys, replica_id)
            return keys, matched, None
        alive = set(ids)
        lone, enough = None, 0
        for depth, key in enumerate(chain.walk(tokens), start=1):
            holders = self.index.holders(key)
            if lone is not None:  # one replica left: it only needs to hold `enough` blocks to lead
                if lone not in holders:
                    break
                matched[lone] = depth
                if depth >= enough:
                    return chain.keys, matched, lone
                continue
            alive = alive & holders
            if not alive:
                break
            for replica_id in alive:
                matched[replica_id] = depth
            if len(alive) == 1:
                lone = next(iter(alive))
                enough = settled.blocks_to_lead(lone, depth)
                if depth >= enough:
                    return chain.keys, matched, lone
        return chain.keys, matched, None

    def _saturated(self, view: ReplicaView, requests: int, bound: int) -> bool:
        """Taking one more would pass the bound (`requests`: the replica's, as the ranking counts them) or the
        replica's capacity (its live in-flight count); a lost stream counts as saturated."""
        if requests + 1 > bound or self.sources.get(view.replica_id) == ReplicaEvents.LOST:
            return True
        return self.live_in_flight(view) + 1 > view.capacity


class _TokenLoads:
    """The replicas' token loads (`KVAware.token_loads`) as a decision reads them, and what they were computed from
    (the load book's version, the replica views, the oldest report)."""

    def __init__(self, version: int, replicas: list[ReplicaView], oldest: float, decode_weight: float) -> None:
        self.version = version
        self.replicas = replicas
        self.oldest = oldest
        self.decode_weight = decode_weight
        self.costs: dict[str, float] = {}
        self.requests: dict[str, int] = {}
        self.total_requests = 0

    def update(self, replica_id: str, load: TokenLoad | None) -> bool:
        """Take the replica's load as the book has it now; False if it has none (its report went stale)."""
        if load is None:
            return False
        self.costs[replica_id] = load.prefill_tokens + self.decode_weight * load.kv_tokens
        self.total_requests += load.requests - self.requests.get(replica_id, 0)
        self.requests[replica_id] = load.requests
        return True

    def placed(self, replica_id: str, prefill_tokens: int, cached_tokens: int) -> None:
        """This router placed a request there (the book counts it too: `EngineLoads.placed`)."""
        self.costs[replica_id] += prefill_tokens + self.decode_weight * cached_tokens
        self.requests[replica_id] += 1
        self.total_requests += 1


class _Settled:
    """Whether the prompt past its leading tokens can change the ranking (`read_on`, and where the index walk stops).
    While they hold no whole block, or two or more replicas hold the last one, yes. When none does, no: a replica that
    lacks block k matches fewer than k blocks whatever follows. When one replica alone holds it, every other replica's
    match is settled (it lacks that block); by in-flight counts the holder leads whatever follows; by token load it
    leads once its cost with the blocks read so far is below every other's settled cost: each block more it holds
    lowers its cost alone, so it then leads with the rest too."""

    def __init__(
        self, index: KVBlockIndex, chain: PromptChain, token_loads: dict[str, float] | None, block_weight: float
    ) -> None:
        """`block_weight`: what one more cached block takes off a replica's cost."""
        self.index = index
        self.chain = chain
        self.token_loads = token_loads
        self.block_weight = block_weight
        # Per lone holder: the lowest settled cost of every other replica.
        self._best_other: dict[str, float] = {}
        # Whether `read_on` ended the reading (the prompt's tokens are then only its leading part).
        self.cut = False

    def read_on(self, leading_tokens: Sequence[int]) -> bool:
        keys = self.chain.extended(leading_tokens)
        if not keys:
            return True
        holders = self.index.holders(keys[-1])
        if len(holders) != 1:
            go_on = len(holders) >= 2
        else:
            go_on = len(keys) < self.blocks_to_lead(next(iter(holders)), len(keys))
        self.cut = not go_on
        return go_on

    def blocks_to_lead(self, holder: str, depth: int) -> float:
        """How many leading blocks the one replica that holds the first `depth` must hold to rank first whatever
        follows (the others' matches are settled: none holds block `depth`)."""
        loads = self.token_loads
        if loads is None or holder not in loads:
            return depth
        if holder not in self._best_other:
            others = [replica_id for replica_id in loads if replica_id != holder]
            held = self.index.matched_blocks(self.chain.keys[:depth], others)
            costs = (loads[replica_id] - self.block_weight * held[replica_id] for replica_id in others)
            self._best_other[holder] = min(costs, default=math.inf)
        if self._best_other[holder] == math.inf:
            return depth
        if self.block_weight <= 0:
            return depth if loads[holder] < self._best_other[holder] else math.inf
        return math.floor((loads[holder] - self._best_other[holder]) / self.block_weight) + 1


def _build(settings: KVAwareSettings, context: PolicyContext) -> KVAware:
    if context.tokenize is None:
        raise ValueError("kv_aware needs the served model's tokenizer (the router's model_path)")
    return KVAware(
        context.tokenize,
        getattr(context.tokenize, "read_left_pieces", None),
        saturation_factor=settings.saturation_factor,
        saturation_floor=settings.saturation_floor,
        approximate_ttl_s=settings.approximate_ttl_s,
        num_fallback_replicas=settings.num_fallback_replicas,
        decode_weight=settings.decode_weight,
        prefix_weight=settings.prefix_weight,
    )


def _body_use(settings: KVAwareSettings) -> tuple[str, str] | None:
    return ("policy", "kv_aware reads the prompt (messages or prompt) to score each replica's cached prefix")


def kv_index_report(policy: KVAware) -> dict[str, Any]:
    """Where each replica's scores come from (`events`, `approximate`, `lost`), its indexed blocks, and the decisions
    by reason."""
    return {
        "block_size": policy.block_size,
        "replicas": {
            view_id: {"source": str(source), "blocks": policy.index.blocks(view_id)}
            for view_id, source in sorted(policy.sources.items())
        },
        "decisions": dict(policy.counts.decisions),
    }


def kv_index_lines(report: dict[str, Any]) -> list[str]:
    """`kv_index_report` as `sluice status` prints it."""
    scored = ", ".join(f"{rid} {r['source']} ({r['blocks']} blocks)" for rid, r in report["replicas"].items())
    return [f"KV events (block size {report['block_size']}): {scored or 'no replica yet'}"]


def _event_target(policy: KVAware) -> KVAware:
    """The policy keeps its own index: the router's subscriber feeds it directly."""
    return policy


async def _refresh_metrics(policy: KVAware, app: str) -> None:
    counted = Counter(policy.sources.values())
    for source in ReplicaEvents:
        KV_REPLICAS.labels(app, str(source)).set(counted[source])


ENTRY = PolicyEntry(
    NAME,
    KVAwareSettings,
    _build,
    body_use=_body_use,
    needs_prompt=True,
    kv_event_target=_event_target,
    prefill_side=False,
    report=PolicyReport("kv_events", KV_INDEX_PATH, kv_index_report, kv_index_lines),
    refresh_metrics=_refresh_metrics,
)
