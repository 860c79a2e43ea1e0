"""KVAware: send a request to the replica whose KV cache already holds the longest prefix of its prompt, unless that
replica is saturated.

The router turns the forwarded body into the prompt tokens vLLM will compute (`PromptTokens`: the served model's
tokenizer and chat template), cuts them into the engine's KV blocks and scores each replica by how many leading
blocks it holds (`KVBlockIndex`, fed by every replica's vLLM KV events; a replica that publishes none is scored by
what this router itself sent there, `RoutedPrefixes`). Ranking, best first: more matched blocks, then fewer live
in-flight requests (`live_in_flight`: the open requests its frontends last counted, plus this router's decisions
since), then a tie-break hashed from the prompt's first block and the replica id (the same in every
router, and spreading different prompts over equally loaded replicas). The primary is the best replica that is not
saturated: its live in-flight plus this request would pass both `saturation_factor` times the mean (the bound of
consistent hashing with bounded loads, Mirrokni et al. 2018) and `saturation_floor`, or its capacity. Fallbacks
follow in rank order.

A replica whose event stream was lost (its publisher went away: it died or restarted) holds nothing and ranks last
until its stream is back. Reasons: `match`, `approximate_match`, `saturated`, `miss`, `no_index`, `no_prompt`,
`body_truncated`. Settings and measured figures: routers/README.md#kv_aware.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from typing import Any

import mmh3
from pydantic import Field

from routers.core import DEFAULT_NUM_FALLBACK_REPLICAS, ReplicaView, RouteRequest, RoutingPolicy
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
_TIE_SEED = 0x6B76


class KVAwareSettings(PolicySettings):
    saturation_factor: float = Field(DEFAULT_SATURATION_FACTOR, ge=1.0)
    saturation_floor: int = Field(DEFAULT_SATURATION_FLOOR, ge=1)
    approximate_ttl_s: float = Field(DEFAULT_APPROXIMATE_TTL_S, gt=0)
    num_fallback_replicas: int = Field(DEFAULT_NUM_FALLBACK_REPLICAS, ge=0)


def _tie_key(replica_id: str) -> int:
    return mmh3.hash64(replica_id, seed=_TIE_SEED, signed=False)[0]


class KVAware(RoutingPolicy):
    name = NAME
    sticky = True

    def __init__(
        self,
        tokenize: Tokenize,
        saturation_factor: float = DEFAULT_SATURATION_FACTOR,
        saturation_floor: int = DEFAULT_SATURATION_FLOOR,
        approximate_ttl_s: float = DEFAULT_APPROXIMATE_TTL_S,
        num_fallback_replicas: int = DEFAULT_NUM_FALLBACK_REPLICAS,
    ) -> None:
        if saturation_factor < 1.0:
            raise ValueError(f"saturation_factor must be >= 1.0, got {saturation_factor}")
        super().__init__()
        self.tokenize = tokenize
        self.saturation_factor = saturation_factor
        self.saturation_floor = saturation_floor
        self.num_fallback_replicas = num_fallback_replicas
        self.index = KVBlockIndex()
        self.routed_prefixes = RoutedPrefixes(approximate_ttl_s)
        # Set by whoever feeds the index (the router's event subscriber); a replica not named here has no index yet.
        self.sources: dict[str, ReplicaEvents] = {}
        # The engines' block size, as the replicas announce it; None until one did.
        self.block_size: int | None = None
        self._tie_keys: dict[str, int] = {}

    def on_replicas_changed(self, replica_ids: Sequence[str]) -> None:
        self._tie_keys = {replica_id: _tie_key(replica_id) for replica_id in replica_ids}

    def replica_left(self, replica_id: str) -> None:
        """Forget everything about a replica that left the set."""
        self.index.cleared(replica_id)
        self.routed_prefixes.forget(replica_id)
        self.sources.pop(replica_id, None)

    def live_in_flight(self, view: ReplicaView) -> int:
        """A replica's open requests as its frontends last counted them, plus what this router sent it since; with
        no count published, the base rule (this router's decisions of the last `forget_after_s`)."""
        if view.in_flight_sampled:
            return view.in_flight + self.tracker.placed_since_sample(view.replica_id)
        return super().live_in_flight(view)

    def _rank(self, replicas: list[ReplicaView], request: RouteRequest) -> tuple[list[list[ReplicaView]], str]:
        keys, reason = self._prompt_keys(request)
        matched = self._matched(keys, replicas)
        first = keys[0] if keys else mmh3.hash64(request.request_id, signed=False)[0]
        loads = {view.replica_id: self.live_in_flight(view) for view in replicas}

        def order(view: ReplicaView) -> tuple[bool, int, int, int]:
            tie = self._tie_keys.get(view.replica_id) or _tie_key(view.replica_id)
            lost_stream = self.sources.get(view.replica_id) == ReplicaEvents.LOST
            return lost_stream, -matched[view.replica_id], loads[view.replica_id], tie ^ first

        ranked = sorted(replicas, key=order)
        best = ranked[0]
        bound = max(
            self.saturation_floor, math.ceil(self.saturation_factor * (sum(loads.values()) + 1) / len(replicas))
        )
        if reason is None:
            if matched[best.replica_id] == 0:
                reason = "miss"
            elif self.sources.get(best.replica_id) == ReplicaEvents.APPROXIMATE:
                reason = "approximate_match"
            else:
                reason = "match"
        primary = next((view for view in ranked if not self._saturated(view, loads[view.replica_id], bound)), best)
        if primary is not best and matched[best.replica_id] > 0:
            reason = "saturated"
        if keys and self.sources.get(primary.replica_id) == ReplicaEvents.APPROXIMATE:
            self.routed_prefixes.routed(primary.replica_id, keys)
        fallbacks = [view for view in ranked if view is not primary][: self.num_fallback_replicas]
        return [[primary], *([view] for view in fallbacks)], reason

    def _prompt_keys(self, request: RouteRequest) -> tuple[list[int], str | None]:
        """The request's block chain keys, or none and the reason it has none."""
        if self.block_size is None:
            return [], "no_index"
        if request.body_truncated:
            return [], "body_truncated"
        # A replica scored by what this router sent it learns the whole prompt: tokenize all of it then.
        approximate = ReplicaEvents.APPROXIMATE in self.sources.values()
        chain = PromptChain(self.block_size)
        tokens = self.tokenize(request.body_prefix, None if approximate else lambda part: self._read_on(chain, part))
        if tokens is None:
            return [], "no_prompt"
        return chain.extended(tokens), None

    def _read_on(self, chain: PromptChain, leading_tokens: Sequence[int]) -> bool:
        """Whether the prompt past these leading tokens can change the ranking: while they hold no whole block, or
        while two or more replicas hold the last one. A replica that lacks block k matches fewer than k blocks
        whatever follows, so once one replica or none holds it, every replica's order is settled."""
        keys = chain.extended(leading_tokens)
        return not keys or self.index.holder_count(keys[-1]) >= 2

    def _matched(self, keys: list[int], replicas: list[ReplicaView]) -> dict[str, int]:
        ids = [view.replica_id for view in replicas]
        if not keys:
            return dict.fromkeys(ids, 0)
        matched = self.index.matched_blocks(keys, ids)
        for replica_id in ids:
            if self.sources.get(replica_id) == ReplicaEvents.APPROXIMATE:
                matched[replica_id] = self.routed_prefixes.matched_blocks(keys, replica_id)
        return matched

    def _saturated(self, view: ReplicaView, load: int, bound: int) -> bool:
        """Taking one more would pass the bound or the replica's capacity; a lost stream counts as saturated."""
        return load + 1 > min(bound, view.capacity) or self.sources.get(view.replica_id) == ReplicaEvents.LOST


def _build(settings: KVAwareSettings, context: PolicyContext) -> KVAware:
    if context.tokenize is None:
        raise ValueError("kv_aware needs the served model's tokenizer (the router's model_path)")
    return KVAware(
        context.tokenize,
        saturation_factor=settings.saturation_factor,
        saturation_floor=settings.saturation_floor,
        approximate_ttl_s=settings.approximate_ttl_s,
        num_fallback_replicas=settings.num_fallback_replicas,
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
