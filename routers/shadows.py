"""Shadow policies: what other policies would do with the live traffic, so a team sees a policy's effect before it
switches (`routing.shadow_policies`).

After each live decision (off its path: the route call is answered first), every shadow policy ranks the same views
for the same request, and its pick is scored by the prefix of the request's prompt that replica would hold had that
policy been live: each shadow keeps a virtual cache per replica (`VirtualCaches`: the chain keys of the prompts it
sent there, least recently used first out past the engine's KV blocks), because the real caches hold what the live
policy placed, not what the shadow would have. The live pick is scored from the engines' own KV index (what that
replica holds now). A score counts as vLLM counts a hit: whole blocks, at most the prompt less one token; so the
predicted hit ratio (cached over prompt tokens) compares with the engines' prefix cache hit ratio, which the engine
load poller reads from the same replicas (`engine_hit`). The spread of a policy's picks is the most picked replica's
share of the last `SPREAD_WINDOW` decisions over the mean share.

A shadow's own state (its rotation, its ring, its in-flight tracker) is its own; its decisions are not counted on the
router's decision metrics. Costs: the whole prompt tokenized once more per request (cached pieces are free) and one
ranking per shadow; only policies that need neither a prompt nor a capacity ledger can shadow (`shadow_refusal`).
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from routers.core import ReplicaView, RouteRequest, RoutingPolicy
from routers.engine_load import EngineLoads
from routers.kv_events import KVEventTarget, ReplicaEvents
from routers.kv_index import KVBlockIndex, chain_keys
from routers.metrics import ENGINE_HIT_RATIO, PICK_SPREAD, PREDICTED_HIT_RATIO, DecisionCounts
from routers.prompt_tokens import Tokenize

# The decisions a pick spread is taken over: a few seconds of traffic at 100 requests per second.
SPREAD_WINDOW = 1000
# A replica's virtual cache before any engine reported its size.
DEFAULT_CACHE_BLOCKS = 4096
# Where a router's `describe` reports its shadows (`ShadowPolicies.report`).
SHADOWS_KEY = "shadows"
LIVE = "live"
SHADOW = "shadow"


def shadow_refusal(needs_prompt: bool, needs_ledger: bool) -> str | None:
    """Why a policy cannot shadow, or None."""
    if needs_ledger:
        return "takes capacity tokens, which a shadow cannot take"
    if needs_prompt:
        return "is scored from the live KV index, which holds the live policy's placement"
    return None


class VirtualCaches:
    """Per replica, the chain keys a shadow sent there, least recently used out first past `blocks`."""

    def __init__(self, blocks: int) -> None:
        self.blocks = blocks
        self._caches: dict[str, OrderedDict[int, None]] = {}

    def matched(self, replica_id: str, keys: Sequence[int]) -> int:
        cache = self._caches.get(replica_id)
        if cache is None:
            return 0
        for depth, key in enumerate(keys):
            if key not in cache:
                return depth
        return len(keys)

    def stored(self, replica_id: str, keys: Sequence[int]) -> None:
        cache = self._caches.setdefault(replica_id, OrderedDict())
        for key in keys:
            cache[key] = None
            cache.move_to_end(key)
        while len(cache) > self.blocks:
            cache.popitem(last=False)

    def forget(self, replica_id: str) -> None:
        self._caches.pop(replica_id, None)


@dataclass
class PolicyScore:
    """What one policy (live or shadow) was predicted to hit, and where it sent requests."""

    role: str
    cached_tokens: int = 0
    prompt_tokens: int = 0
    picks: deque[str] = field(default_factory=lambda: deque(maxlen=SPREAD_WINDOW))

    def add(self, replica_id: str, cached: int, prompt: int) -> None:
        self.cached_tokens += cached
        self.prompt_tokens += prompt
        self.picks.append(replica_id)

    @property
    def hit(self) -> float | None:
        return round(self.cached_tokens / self.prompt_tokens, 4) if self.prompt_tokens else None

    def spread(self, replicas: int) -> float | None:
        if not self.picks or not replicas:
            return None
        return round(max(Counter(self.picks).values()) / (len(self.picks) / replicas), 3)


class ShadowPolicies:
    """The shadows of one router. Also a KV event target (`routers.kv_events.KVEventTarget`): where the live policy
    keeps no KV index of its own, the router's subscriber and load poller feed this one; `target` is whichever the
    live pick is scored from (the live policy's own, where it keeps one)."""

    def __init__(self, live: str, shadows: dict[str, RoutingPolicy], tokenize: Tokenize) -> None:
        self.live = live
        self.shadows = shadows
        for name, policy in shadows.items():
            policy.counts = DecisionCounts(name, exported=False)
        self.tokenize = tokenize
        self.index = KVBlockIndex()
        self.sources: dict[str, ReplicaEvents] = {}
        self.block_size: int | None = None
        self.engine_loads = EngineLoads()
        self.target: KVEventTarget = self
        self.virtual = {name: VirtualCaches(DEFAULT_CACHE_BLOCKS) for name in shadows}
        self.scores = {live: PolicyScore(LIVE), **{name: PolicyScore(SHADOW) for name in shadows}}
        self._replicas = 0

    def replica_left(self, replica_id: str) -> None:
        self.index.cleared(replica_id)
        self.sources.pop(replica_id, None)
        self.engine_loads.forget(replica_id)
        for caches in self.virtual.values():
            caches.forget(replica_id)

    def observe(self, views: Sequence[ReplicaView], request: RouteRequest, live_pick: str) -> None:
        """Score the live pick and every shadow's pick for this request."""
        index, block_size = self.target.index, self.target.block_size
        if block_size is None or request.body_truncated or not views:
            return
        tokens = self.tokenize(request.body_prefix, None)
        if not tokens:
            return
        self._replicas = len(views)
        keys = chain_keys(tokens, block_size)
        cache_tokens = self.target.engine_loads.cache_tokens()
        for caches in self.virtual.values():
            caches.blocks = cache_tokens // block_size if cache_tokens else DEFAULT_CACHE_BLOCKS
        most = (len(tokens) - 1) // block_size
        held = index.matched_blocks(keys, [live_pick])[live_pick]
        self.scores[self.live].add(live_pick, min(held, most) * block_size, len(tokens))
        for name, policy in self.shadows.items():
            pick = policy.rank(views, request)[0][0].replica_id
            caches = self.virtual[name]
            self.scores[name].add(pick, min(caches.matched(pick, keys), most) * block_size, len(tokens))
            caches.stored(pick, keys)

    def report(self) -> dict[str, Any]:
        """Per policy: role, predicted hit ratio, pick spread; and the engines' own prefix cache hit ratio."""
        return {
            "live": self.live,
            "shadows": list(self.shadows),
            "predicted_hit": {name: score.hit for name, score in self.scores.items()},
            "spread": {name: score.spread(self._replicas) for name, score in self.scores.items()},
            "engine_hit": self.target.engine_loads.prefix_hit_ratio(),
        }

    def refresh_metrics(self, app: str) -> None:
        """The report as the router's gauges (before its /metrics is read)."""
        report = self.report()
        for name, score in self.scores.items():
            if report["predicted_hit"][name] is not None:
                PREDICTED_HIT_RATIO.labels(app, name, score.role).set(report["predicted_hit"][name])
            if report["spread"][name] is not None:
                PICK_SPREAD.labels(app, name, score.role).set(report["spread"][name])
        if report["engine_hit"] is not None:
            ENGINE_HIT_RATIO.labels(app).set(report["engine_hit"])


def shadow_lines(report: dict[str, Any]) -> list[str]:
    """`ShadowPolicies.report` as `sluice status` prints it."""
    engine = report.get("engine_hit")
    lines = [f"hit ratio the engines report: {engine if engine is not None else 'none yet'}"]
    for name in [report["live"], *report["shadows"]]:
        role = "live" if name == report["live"] else "shadow"
        hit, spread = report["predicted_hit"].get(name), report["spread"].get(name)
        lines.append(f"{role} {name}: predicted hit {hit}, pick spread {spread}")
    return lines
