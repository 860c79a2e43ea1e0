"""Each replica's token load as its engine last reported it, plus what this router placed there since: the load a
cache-aware policy weighs against a cached prefix (`kv_aware`).

An engine's load in tokens is the KV its running requests hold (every decode step reads all of it: the decode load)
plus the prompt tokens it has still to compute (its prefill queue). The engines report both (`base.route_wire.
EngineLoad`, polled by the router service); vLLM's scheduler statistics count waiting requests but not their tokens,
so a waiting request there counts as the mean prompt this router placed. A request placed adds its prompt (the blocks
cached there join the running KV at once, the rest is prefill to come) until a report shows the engine took it in
(its load moved, or its prefix cache was asked for more prompts), or for as long as a request there takes (the
engine's recent mean, `EngineLoad.request_seconds`), `PLACEMENT_TTL_S` at most: a report comes every half second,
and a conversation's turns of a tenth of a second each would otherwise count five times on the replica that holds
it. Idle engines report the same to every router, and routers that made the same decisions within that window
count the same load, so they rank alike. Every router of an app reads the same reports, so they agree but for
their own placements of the last poll interval.

A report older than `STALE_AFTER_S` is no report: the policy then falls back to in-flight counts.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass

from base.running_mean import RunningMean

# Ten missed polls (the router asks every `ENGINE_LOAD_POLL_S`): an engine that stopped answering is not taken as
# idle for long.
STALE_AFTER_S = 5.0
# A placement not in any report that moved is counted this long at most (and where its engine reported no request
# time yet): the router's in-flight window (`RouterSettings.forget_after_s`).
PLACEMENT_TTL_S = 2.0
# A waiting request's prompt before this router placed any (vLLM reports waiting requests, not tokens).
DEFAULT_MEAN_PROMPT_TOKENS = 512
# Weight of the newest placement in the running mean of placed prompts: about the last 50.
_MEAN_WEIGHT = 0.02


@dataclass(frozen=True, slots=True)
class ReportedLoad:
    running: int
    kv_tokens_used: int
    waiting: int
    prefill_tokens_pending: int | None
    at: float
    # The engine's KV cache in tokens, and its prefix cache counters since it started (tokens).
    kv_tokens_total: int | None = None
    prefix_queries: int = 0
    prefix_hits: int = 0
    request_seconds: float | None = None


@dataclass(frozen=True, slots=True)
class TokenLoad:
    """A replica's KV tokens held by running requests (the decode load), prompt tokens it has still to compute, and
    its requests: running and waiting as reported, plus this router's placements still counted."""

    kv_tokens: int
    prefill_tokens: int
    requests: int = 0


class EngineLoads:
    """Token load per replica view id: the engines' reports plus this router's placements not yet in them."""

    def __init__(
        self,
        stale_after_s: float = STALE_AFTER_S,
        placement_ttl_s: float = PLACEMENT_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.stale_after_s = stale_after_s
        self.placement_ttl_s = placement_ttl_s
        self._clock = clock
        self._reports: dict[str, ReportedLoad] = {}
        # Placements by when they stop counting: (then, order, view, its epoch then, cached prompt tokens, prompt
        # tokens to compute); per view the sums of those of its current epoch (a report that moved begins a new one)
        # and how many they are.
        self._placements: list[tuple[float, int, str, int, int, int]] = []
        self._order = itertools.count()
        self._placed: dict[str, tuple[int, int, int]] = {}
        self._epochs: dict[str, int] = {}
        self.mean_prompt_tokens = RunningMean(_MEAN_WEIGHT, DEFAULT_MEAN_PROMPT_TOKENS)
        # The views whose load changed otherwise than by a placement since `take_changed` (reports, expiries).
        self._changed: set[str] = set()
        # Counts the views forgotten: a load kept from an older version must be computed anew.
        self.version = 0

    def reported(
        self,
        view_id: str,
        kv_tokens_used: int,
        waiting: int,
        prefill_tokens_pending: int | None = None,
        kv_tokens_total: int | None = None,
        prefix_queries: int = 0,
        prefix_hits: int = 0,
        running: int = 0,
        request_seconds: float | None = None,
    ) -> None:
        """A new report from the view's engine. One that moved holds the placements made before it (the engine took
        them in); one that did not keeps them (they have not arrived yet)."""
        previous = self._reports.get(view_id)
        report = ReportedLoad(
            running,
            kv_tokens_used,
            waiting,
            prefill_tokens_pending,
            self._clock(),
            kv_tokens_total,
            prefix_queries,
            prefix_hits,
            request_seconds,
        )
        self._reports[view_id] = report
        self._changed.add(view_id)
        if previous is None or _moved(previous, report):
            self._epochs[view_id] = self._epochs.get(view_id, 0) + 1
            self._placed.pop(view_id, None)

    def placed(self, view_id: str, prompt_tokens: int, prefill_tokens: int) -> None:
        """A request placed on the view: its prompt, of which `prefill_tokens` are not cached there."""
        cached = prompt_tokens - prefill_tokens
        report = self._reports.get(view_id)
        counted_s = self.placement_ttl_s
        if report is not None and report.request_seconds is not None:
            counted_s = min(counted_s, report.request_seconds)
        placement = (self._clock() + counted_s, next(self._order), view_id, self._epochs.get(view_id, 0))
        heapq.heappush(self._placements, (*placement, cached, prefill_tokens))
        kv, prefill, count = self._placed.get(view_id, (0, 0, 0))
        self._placed[view_id] = (kv + cached, prefill + prefill_tokens, count + 1)
        self.mean_prompt_tokens.add(prompt_tokens)

    def expire(self) -> None:
        """Forget the placements whose time is up: every router of an app forgets the same ones alike."""
        now = self._clock()
        while self._placements and self._placements[0][0] <= now:
            _, _, view_id, epoch, cached, prefill = heapq.heappop(self._placements)
            if epoch == self._epochs.get(view_id, 0) and view_id in self._placed:
                kv, pending, count = self._placed[view_id]
                self._placed[view_id] = (kv - cached, pending - prefill, count - 1)
                self._changed.add(view_id)

    def take_changed(self) -> set[str]:
        """The views whose load changed otherwise than by a placement since the last call."""
        changed, self._changed = self._changed, set()
        return changed

    def forget(self, view_id: str) -> None:
        self.version += 1
        self._reports.pop(view_id, None)
        self._placed.pop(view_id, None)
        self._epochs[view_id] = self._epochs.get(view_id, 0) + 1

    def load(self, view_id: str) -> TokenLoad | None:
        """The view's token load now; None without a fresh report."""
        report = self._reports.get(view_id)
        if report is None or self._clock() - report.at > self.stale_after_s:
            return None
        pending = report.prefill_tokens_pending
        if pending is None:
            pending = round(report.waiting * self.mean_prompt_tokens.value)
        kv, prefill, count = self._placed.get(view_id, (0, 0, 0))
        return TokenLoad(report.kv_tokens_used + kv, pending + prefill, report.running + report.waiting + count)

    def report_at(self, view_id: str) -> float | None:
        """When the view's last report came (None: it has none)."""
        report = self._reports.get(view_id)
        return None if report is None else report.at

    def oldest_report(self, view_ids: list[str]) -> float | None:
        """When the oldest of these views' reports came (None: one has none)."""
        times = [self.report_at(view_id) for view_id in view_ids]
        return None if None in times else min(times)  # type: ignore[type-var]

    def fresh_since(self, at: float) -> bool:
        """Whether a report that came at `at` is still fresh."""
        return self._clock() - at <= self.stale_after_s

    def cache_tokens(self) -> int | None:
        """The smallest KV cache any engine reported, in tokens (None: none did)."""
        sizes = [report.kv_tokens_total for report in self._reports.values() if report.kv_tokens_total]
        return min(sizes) if sizes else None

    def prefix_hit_ratio(self) -> float | None:
        """The engines' prefix cache hits over queries (tokens), summed over the replicas reporting now."""
        queries = sum(report.prefix_queries for report in self._reports.values())
        hits = sum(report.prefix_hits for report in self._reports.values())
        return round(hits / queries, 4) if queries else None


def _moved(previous: ReportedLoad, report: ReportedLoad) -> bool:
    """Whether the engine took requests in between two reports: its load changed, or it was asked for more prompts
    (its prefix cache's queries grew), though they may have finished before the second report."""
    return (
        previous.running != report.running
        or previous.kv_tokens_used != report.kv_tokens_used
        or previous.waiting != report.waiting
        or previous.prefill_tokens_pending != report.prefill_tokens_pending
        or previous.prefix_queries != report.prefix_queries
    )
