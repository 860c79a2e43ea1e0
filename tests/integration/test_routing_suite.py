"""The routing-semantics suite against the KV-aware team stack (its own name and ports): real vLLM replicas of the
tiny model with KV events on, the suite deploying the variants and driving the scale changes. The prefix-reuse
campaigns are fixed-count runs (`loadtests/counted.py`: 9 users, `REQUESTS_PER_USER` requests each), not timed
Locust runs: the hit rates come from vLLM's counters and the rows either way, and a count sends every policy the same
number of conversations however fast the replicas answer (`sluice load routing` keeps Locust campaigns of
`--duration`). Timings are compared between policies on the same replicas, never against absolute limits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from routers.consistent_hash import NAME as CONSISTENT_HASH
from routers.kv_aware import NAME as KV_AWARE
from routers.round_robin import NAME as ROUND_ROBIN
from sluice.bench.routing_suite import routing_suite
from tests.support.frontend_contract import register_frontend
from tests.support.ports import free_port

pytestmark = pytest.mark.integration

TEAMS = Path(__file__).resolve().parents[2] / "topologies" / "teams"
# 6 conversations of 4 turns per user, 54 a campaign (7-12 s each here). Fewer requests weigh the first misses
# more: at 16, kv_aware's hot-session share of the ideal measured 0.93-0.96 alone but 0.895 once in a full run
# (against 0.9), and at 12 its header-less share 0.88 once.
REQUESTS_PER_USER = 24
# kv_aware's hit rate against each campaign's ideal (every prefix found where it was last computed). Measured shares:
# 0.90-0.98 (0.898 in the multi-turn campaign of a CI run, 0.895 in the shared-prefix one of another), round robin's
# 0.39-0.67: 0.8 tells a kv_aware that keeps its prefixes from one that lost them, with room for the evictions chance
# brings when a replica's small cache briefly holds a fourth conversation.
KV_AWARE_SHARE_OF_IDEAL = 0.8
# How far under consistent hashing kv_aware's multi-turn hit rate may fall in one run (the test says why).
KV_AWARE_BAND_UNDER_HASH = 0.06


def test_the_routing_suite_measures_affinity_remapping_uniformity_prefix_reuse_buffers_and_fallbacks(
    ray_cluster: None, tiny_model_dir: Path, tmp_path: Path
) -> None:
    data = yaml.safe_load((TEAMS / "kv-aware-cpu.yaml").read_text())
    port = free_port()
    data["name"] = "routing-suite"
    data["frontend"].update(port=port, metrics_port=free_port())
    spec = tmp_path / "stack.yaml"
    spec.write_text(yaml.safe_dump(data))
    register_frontend(port)
    # kv_aware's hot session is asserted; consistent hash's, for comparison, is `sluice load routing`'s.
    tokenizer = tiny_model_dir / "tokenizer.json"
    campaigns = {"hot_session_policies": (KV_AWARE,), "requests_per_user": REQUESTS_PER_USER}
    figures = routing_suite(spec, tmp_path / "out", tokenizer, 15, wait_for_delete=False, **campaigns)
    print(json.dumps(figures, indent=2))
    assert figures["affinity"] >= 0.99
    assert 0.2 <= figures["remap_out_2_to_3"] <= 0.45
    assert sum(figures["headerless_per_replica"].values()) >= 600 and figures["headerless_cv"] <= 0.15
    assert figures["over_buffer"]["ok"] == figures["over_buffer"]["requests"] == 100
    assert figures["over_buffer"]["sessions_on_one_replica"] == 1.0
    assert {n: run["requests"] for n, run in figures["fallbacks"].items()} == {"2": 400, "0": 400}
    out = tmp_path / "out"
    assert (out / "prefix_cache.png").stat().st_size > 0 and (out / "prefix_cache_shared_prefix.png").stat().st_size
    assert (out / "report.html").exists()

    # Prefix reuse, every policy on 3 replicas with the same engine settings.
    reuse = figures["prefix_reuse"]
    for by_policy in reuse.values():
        assert set(by_policy) == {ROUND_ROBIN, CONSISTENT_HASH, KV_AWARE}
        assert all(
            found["ok"] == found["requests"] > 0 and 0 < found["ideal_rate"] <= 1 for found in by_policy.values()
        )
    multi_turn = {policy: found["hit_rate"] for policy, found in reuse["multi_turn"].items()}
    assert multi_turn == figures["prefix_cache_hit_rate"]
    # Each replica's cache holds about three conversations (`small_cache`), 9 users keep 9 going. A turn finds its
    # prefix where the previous turn ran: both sticky policies reach most of the ideal, round robin under half; kv_aware
    # places each new conversation on the least loaded replica, a hash wherever it falls, so consistent hash's
    # replicas sometimes hold a fourth and evict (measured share of the ideal: kv_aware 0.98 / 0.94 / 0.97, consistent
    # hash 0.86 / 0.89 / 0.84). How often a hash overfills a replica is chance: a CI run measured consistent hash at
    # 0.95 of the ideal, 0.005 above kv_aware's 0.94, and another consistent hash 0.491 against kv_aware's 0.461
    # (0.030 below), so one run asserts kv_aware within a 0.06 band of it, not above: the band tells a kv_aware that
    # lost its conversations (it falls to round robin's 0.2-0.25) from chance. Without the session header only
    # kv_aware keeps a conversation together.
    ideal = reuse["multi_turn"][KV_AWARE]["ideal_rate"]
    assert multi_turn[KV_AWARE] >= KV_AWARE_SHARE_OF_IDEAL * ideal, reuse["multi_turn"]
    assert multi_turn[KV_AWARE] >= multi_turn[CONSISTENT_HASH] - KV_AWARE_BAND_UNDER_HASH, multi_turn
    assert multi_turn[CONSISTENT_HASH] >= multi_turn[ROUND_ROBIN] + 0.1, multi_turn
    headerless = {policy: found["hit_rate"] for policy, found in reuse["multi_turn_headerless"].items()}
    headerless_ideal = reuse["multi_turn_headerless"][KV_AWARE]["ideal_rate"]
    assert headerless[KV_AWARE] >= KV_AWARE_SHARE_OF_IDEAL * headerless_ideal, headerless
    assert headerless[KV_AWARE] >= max(headerless[CONSISTENT_HASH], headerless[ROUND_ROBIN]) + 0.1, headerless
    # Four system prompts, about three per cache, no session header: round robin and consistent hash bring every
    # prompt to every replica and evict; kv_aware keeps each on its replica (measured: hit rate 0.54 / 0.54 / 0.56
    # round robin and 0.83 / 0.84 / 0.84 kv_aware of 0.86; TTFT p90 278 / 205 / 205 ms and 115 / 136 / 113 ms). The
    # margin over the others is 0.1: a CI machine measured kv_aware 0.77 against round robin's 0.58.
    shared = reuse["shared_prefix"]
    assert shared[KV_AWARE]["hit_rate"] >= KV_AWARE_SHARE_OF_IDEAL * shared[KV_AWARE]["ideal_rate"], shared
    assert (
        shared[KV_AWARE]["hit_rate"] >= max(shared[ROUND_ROBIN]["hit_rate"], shared[CONSISTENT_HASH]["hit_rate"]) + 0.1
    ), shared
    # The hot session: kv_aware spreads the load within the saturation bound and keeps its prefix hits (measured:
    # busiest replica 1.06 / 1.10 / 1.08x the mean, hit rate 0.84 / 0.85 / 0.84 of 0.86; consistent hash 2.56 /
    # 1.83 / 1.31x, 0.71 / 0.86 / 0.86).
    hot = figures["hot_session"]
    assert hot[KV_AWARE]["in_flight"]["busiest_over_mean"] <= 1.5, hot
    assert hot[KV_AWARE]["hit_rate"] >= KV_AWARE_SHARE_OF_IDEAL * hot[KV_AWARE]["ideal_rate"], hot
