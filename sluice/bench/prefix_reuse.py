"""The routing suite's prefix-reuse section: every policy on the same number of LLM replicas with the same engine
settings, a `multi_turn` campaign with the session header and one without it (`multi_turn_headerless`: the same
conversations, which only a policy reading the prompt can keep together), a `shared_prefix` campaign each, and a
`hot_prefix` campaign for the policies whose hot-session behaviour matters (sluice/bench/README.md, the routing
suite).

Per campaign: the prefix-cache hit rate from vLLM's own counters (read from every replica before and after), the
ideal rate the workload allows (from the rows), TTFT p50 and p90, and each replica's in-flight requests over time
(from the rows: send time, end-to-end latency, the replica that served). Each campaign has a seed of its own, so its
prompts are new to the replicas' caches, which keep blocks from every earlier campaign.

Every replica runs with a small KV cache (`small_cache`): a quarter more than one full-length request, about three
of the workloads' conversations or system prompts. A cache that holds every prefix of the campaign (vLLM's CPU
backend gives the tiny model about a million tokens) lets every sticky policy hit alike; a production cache holds far
fewer prefixes than its traffic has, and that is where placement decides the hit rate.
"""

from __future__ import annotations

import asyncio
import csv
import math
import re
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx

from base.contracts import KV_EVENTS_PATH, SESSION_HEADER_DEFAULT
from base.quantiles import quantile
from base.route_wire import KVEventSources
from loadtests.campaign import Campaign, run
from loadtests.counted import counted_rows
from loadtests.report import prefix_cache_rates
from loadtests.sse_timing import StreamRow
from loadtests.workloads import SYSTEM_PROMPT_TOKENS, system_prompt_key
from services.internal_credential import internal_headers
from services.replica.llm_config import EngineConfig

# Each prefix case: its workload and whether its requests carry the session header.
PREFIX_CASES: dict[str, tuple[str, bool]] = {
    "multi_turn": ("multi_turn", True),
    "multi_turn_headerless": ("multi_turn", False),
    "shared_prefix": ("shared_prefix", True),
}
HOT_WORKLOAD = "hot_prefix"
# Every case a campaign runs: the prefix cases and the hot session's.
CAMPAIGN_CASES = PREFIX_CASES | {HOT_WORKLOAD: (HOT_WORKLOAD, True)}
# Closed-loop users per campaign: 3 per replica of 3, as many live conversations as a replica's cache holds
# (`SMALL_CACHE_REQUESTS`). Spread evenly, every conversation keeps its blocks; a replica given a fourth (a hash does,
# by chance) evicts. Measured on this machine, multi_turn's share of the ideal hit rate: at 6 users consistent hash
# 0.95 and kv_aware 0.94 (no replica ever held a fourth), at 9 users 0.86 and 0.98, at 12 users 0.66 and 0.81.
USERS = 9
_PREFIX = re.compile(r"^vllm:prefix_cache_(hits|queries)_total\{[^}]*\} (\S+)$", re.M)


# vLLM's block size on CPUs when a spec sets none.
VLLM_CPU_BLOCK_SIZE = 128
# The section's cache in full-length requests: vLLM needs one (and a block it keeps in reserve); a quarter more
# holds about three of the workloads' prefixes (a conversation's last turn or a system prompt is ~400 tokens), so a
# replica with two live conversations keeps them and one with four evicts (measured at exactly one request's worth:
# even two evicted each other, and every policy fell short of the ideal alike).
SMALL_CACHE_REQUESTS = 1.25


def small_cache(engine: dict[str, Any]) -> dict[str, Any]:
    """`engine` (a spec model's engine arguments) with the section's KV cache (`SMALL_CACHE_REQUESTS` requests of
    `max_model_len` tokens, in whole blocks) and each response's cached-token count (`prompt_tokens_details`), so
    every row says what its request hit. A spec that sizes the cache keeps its size."""
    block_size = int(engine.get("block_size", VLLM_CPU_BLOCK_SIZE))
    max_model_len = int(engine.get("max_model_len", EngineConfig.model_fields["max_model_len"].default))
    blocks = math.ceil(SMALL_CACHE_REQUESTS * max_model_len / block_size)
    return {"num_gpu_blocks_override": blocks, "enable_prompt_tokens_details": True, **engine}


def _whole_blocks(tokens: int, block_size: int) -> int:
    """What a cache can hit of a shared prefix of `tokens`: whole blocks only (vLLM caches and counts full blocks)."""
    return tokens // block_size * block_size


def ideal_multi_turn_rate(rows: Sequence[StreamRow], block_size: int = 1) -> float:
    """The prefix-cache hit rate a perfect cache allows: each turn reuses what its session's previous turn computed
    (`reusable_tokens`: its prompt, and its answer as far as the re-rendered answer tokenizes alike), in whole blocks
    of `block_size`."""
    ok = [row for row in rows if row.ok]
    total = sum(row.prompt_tokens for row in ok)
    return sum(_whole_blocks(row.reusable_tokens, block_size) for row in ok) / total if total else 0.0


def ideal_shared_prefix_rate(
    rows: Sequence[StreamRow], block_size: int = 1, system_prompt_tokens: int = SYSTEM_PROMPT_TOKENS
) -> float:
    """The hit rate of one perfect cache in front of every replica: each system prompt's first request misses, every
    later one reuses the system prompt's tokens, in whole blocks of `block_size` (`shared_prefix`, `hot_prefix`)."""
    seen: set[str] = set()
    reusable = total = 0
    for row in sorted(rows, key=lambda r: r.sent_at):
        if not row.ok:
            continue
        key = system_prompt_key(row.session)
        shared = _whole_blocks(min(system_prompt_tokens, row.prompt_tokens), block_size)
        reusable += shared if key in seen else 0
        total += row.prompt_tokens
        seen.add(key)
    return reusable / total if total else 0.0


IDEAL_RATES: dict[str, Callable[[Sequence[StreamRow], int], float]] = {
    "multi_turn": ideal_multi_turn_rate,
    "shared_prefix": ideal_shared_prefix_rate,
    HOT_WORKLOAD: ideal_shared_prefix_rate,
}


def in_flight(rows: Sequence[StreamRow], replicas: int) -> dict[str, Any]:
    """Each replica's in-flight requests over the campaign (its ok rows, from the first send to the last end): the
    peak per replica (`max`), the time average per replica (`mean`), the time average across all `replicas`
    (`mean_all`: one that served nothing counts as idle), and the imbalance as the highest peak over `mean_all`
    (`max_over_mean`) and the busiest replica's time average over `mean_all` (`busiest_over_mean`)."""
    served = [r for r in rows if r.ok and r.replica and r.e2el_s is not None]
    if not served:
        return {"max": {}, "mean": {}, "mean_all": 0.0, "max_over_mean": 0.0, "busiest_over_mean": 0.0}
    start = min(r.sent_at for r in served)
    span = max(max(r.sent_at + (r.e2el_s or 0.0) for r in served) - start, 1e-9)
    marks: dict[str, list[tuple[float, int]]] = {}
    busy: dict[str, float] = {}
    for row in served:
        ended = row.sent_at + (row.e2el_s or 0.0)
        marks.setdefault(row.replica, []).extend([(row.sent_at, 1), (ended, -1)])
        busy[row.replica] = busy.get(row.replica, 0.0) + (row.e2el_s or 0.0)
    peak: dict[str, int] = {}
    for replica, steps in marks.items():
        now = peak[replica] = 0
        # At equal times an end (-1) sorts before a start (+1): back-to-back requests do not overlap.
        for _, step in sorted(steps):
            now += step
            peak[replica] = max(peak[replica], now)
    mean = {replica: seconds / span for replica, seconds in busy.items()}
    mean_all = sum(busy.values()) / span / max(replicas, len(busy))
    return {
        "max": peak,
        "mean": mean,
        "mean_all": mean_all,
        "max_over_mean": max(peak.values()) / mean_all,
        "busiest_over_mean": max(mean.values()) / mean_all,
    }


def engine_block_size(plan: Any) -> int:
    """The KV block size the first model's replicas run with, as they announce it."""
    from services.serve_internals import list_replica_endpoints

    model = plan.models[0]
    endpoint = asyncio.run(list_replica_endpoints(model.llm_app))[0]
    announced = httpx.get(f"{endpoint.url}/{model.llm_app}{KV_EVENTS_PATH}", timeout=30, headers=internal_headers())
    return KVEventSources.model_validate_json(announced.content).block_size


def prefix_counters(plan: Any) -> dict[str, tuple[float, float]]:
    """vLLM's prefix-cache hits and queries (tokens) per live replica of the plan's models."""
    from services.serve_internals import list_replica_endpoints

    counters: dict[str, tuple[float, float]] = {}
    for model in plan.models:
        for endpoint in asyncio.run(list_replica_endpoints(model.llm_app)):
            text = httpx.get(f"{endpoint.url}/{model.llm_app}/metrics", timeout=30).text
            found = {"hits": 0.0, "queries": 0.0}
            for kind, value in _PREFIX.findall(text):  # one series per engine
                found[kind] += float(value)
            counters[endpoint.replica_id] = (found["hits"], found["queries"])
    return counters


def hit_rate(before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]) -> float:
    """Hits / queries between two readings, over the replicas live at the second (one started since counts from 0,
    one stopped since is left out: its last counts are unknown)."""
    hits = queries = 0.0
    for replica, (now_hits, now_queries) in after.items():
        then_hits, then_queries = before.get(replica, (0.0, 0.0))
        hits, queries = hits + now_hits - then_hits, queries + now_queries - then_queries
    return hits / queries if queries else 0.0


def campaign_rows(
    plan: Any, workload: str, out: Path, tokenizer: Path, duration_s: float, seed: int, session_header: bool = True
) -> list[StreamRow]:
    """One closed-loop campaign of `USERS` users against the plan's frontend (without the session header unless
    `session_header`); its rows."""
    campaign = Campaign(
        workload=workload,
        target=plan.url,
        out=out,
        tokenizer=tokenizer,
        duration_s=duration_s,
        users=USERS,
        seed=seed,
        session_header=SESSION_HEADER_DEFAULT if session_header else "",
    )
    run(campaign)
    with (out / "rows.csv").open() as handle:
        return [StreamRow.from_csv(row) for row in csv.DictReader(handle)]


class PrefixReuse:
    """The section's campaigns and figures; `measure` runs one policy's campaigns on the plan it is given: Locust
    campaigns of `duration_s`, or, with `requests_per_user`, fixed-count runs of the same users (`loadtests/counted.py`:
    the same requests every run, however fast the replicas answer)."""

    def __init__(
        self,
        out: Path,
        tokenizer: Path,
        duration_s: float,
        replicas: int,
        seed: int,
        requests_per_user: int | None = None,
    ) -> None:
        self.out, self.tokenizer, self.duration_s, self.replicas = out, tokenizer, duration_s, replicas
        self.seed, self.requests_per_user = seed, requests_per_user
        self.reuse: dict[str, dict[str, dict[str, Any]]] = {case: {} for case in PREFIX_CASES}
        self.hot: dict[str, dict[str, Any]] = {}
        # Each campaign's rows by (case, policy); `rows`: the last campaign's.
        self.rows_by_case: dict[tuple[str, str], list[StreamRow]] = {}
        self.rows: list[StreamRow] = []

    def next_seed(self) -> int:
        """A campaign's own seed, so its prompts are new to caches that hold every earlier campaign's blocks."""
        self.seed += 1
        return self.seed

    def _campaign(self, plan: Any, case: str, policy: str) -> dict[str, Any]:
        workload, session_header = CAMPAIGN_CASES[case]
        before = prefix_counters(plan)
        started = time.monotonic()
        seed = self.next_seed()
        if self.requests_per_user is None:
            folder = self.out / f"{case}-{policy}"
            self.rows = campaign_rows(plan, workload, folder, self.tokenizer, self.duration_s, seed, session_header)
        else:
            header = SESSION_HEADER_DEFAULT if session_header else ""
            count = self.requests_per_user
            model = plan.models[0].name
            self.rows = asyncio.run(counted_rows(workload, plan.url, model, self.tokenizer, USERS, count, seed, header))
        after_s = time.monotonic()
        self.rows_by_case[case, policy] = self.rows
        after = prefix_counters(plan)
        ttfts = [r.ttft_s * 1000 for r in self.rows if r.ok and r.ttft_s is not None]
        return {
            "requests": len(self.rows),
            "ok": sum(r.ok for r in self.rows),
            "seconds": after_s - started,
            "hit_rate": hit_rate(before, after),
            "ideal_rate": IDEAL_RATES[workload](self.rows, engine_block_size(plan)),
            "ttft_p50_ms": quantile(ttfts, 0.5) if ttfts else None,
            "ttft_p90_ms": quantile(ttfts, 0.9) if ttfts else None,
            "in_flight": in_flight(self.rows, self.replicas),
        }

    def measure(self, plan: Any, policy: str, hot_session: bool) -> None:
        """`policy`'s campaigns on `plan` (deployed with it): each prefix case, then `hot_prefix` if asked."""
        for case in PREFIX_CASES:
            self.reuse[case][policy] = self._campaign(plan, case, policy)
        if hot_session:
            self.hot[policy] = self._campaign(plan, HOT_WORKLOAD, policy)

    def figures(self) -> dict[str, Any]:
        """`prefix_reuse[workload][policy]`, `hot_session[policy]`, and the multi-turn hit and ideal rates per policy
        under the suite's earlier keys."""
        multi_turn = self.reuse["multi_turn"]
        return {
            "prefix_reuse": self.reuse,
            "hot_session": self.hot,
            "prefix_cache_hit_rate": {policy: found["hit_rate"] for policy, found in multi_turn.items()},
            "prefix_cache_ideal_rate": {policy: found["ideal_rate"] for policy, found in multi_turn.items()},
        }

    def plots(self) -> list[Path]:
        """The hit rate per policy against the ideal, one plot per workload (`prefix_cache.png`: multi_turn)."""
        plots = []
        for workload, by_policy in self.reuse.items():
            rates = {policy: found["hit_rate"] for policy, found in by_policy.items()}
            ideal = max(found["ideal_rate"] for found in by_policy.values())
            # The plot function writes one fixed name: each workload's plot is drawn in a folder of its own first.
            folder = self.out / f"plot-{workload}"
            folder.mkdir(exist_ok=True)
            name = "prefix_cache.png" if workload == "multi_turn" else f"prefix_cache_{workload}.png"
            plots.append(prefix_cache_rates(rates, ideal, folder).rename(self.out / name))
            folder.rmdir()
        return plots
