"""`sluice load routing --spec FILE`: the routing-semantics suite. It deploys the stack of FILE (the embedded default
unless given) in the variants it needs, drives the scale changes itself, and reports: consistent-hash affinity (in its
prefix-reuse multi-turn campaign), the remap fraction when scaling 2 -> 3 -> 2 (ideal 1/3), header-less uniformity
under round robin, prefix reuse per policy on the same 3 replicas (`prefix_reuse.py`: hit rate against the ideal,
TTFT, in-flight balance, and a hot session), bodies over the forwarding buffer, and `num_fallback_replicas` 2 versus 0
while a replica is killed.

Writes `routing.json` and `report.html` (with the prefix-cache plots) into the output folder.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import yaml

from base.contracts import REPLICA_HEADER
from loadtests.metrics import summarize
from loadtests.report import write_report
from loadtests.sse_timing import StreamRow
from routers.consistent_hash import NAME as CONSISTENT_HASH
from routers.kv_aware import NAME as KV_AWARE
from routers.round_robin import NAME as ROUND_ROBIN
from sluice.bench.prefix_reuse import PrefixReuse, small_cache
from sluice.bench.stack_variants import deploy_variant, kill_one_replica

PROBES = 600
REMAP_SESSIONS = 300
PROBE_CONCURRENCY = 8
FALLBACK_REQUESTS = 400
OVER_BUFFER_BYTES = 1024
# Consistent hash last: the remap back to 2 replicas starts from its ring on the same 3 replicas.
PREFIX_POLICIES = (ROUND_ROBIN, KV_AWARE, CONSISTENT_HASH)
HOT_SESSION_POLICIES = (KV_AWARE, CONSISTENT_HASH)


async def _probe(url: str, model: str, sessions: list[str | None]) -> list[str]:
    """The replica that served one 1-token completion per entry (a session id, or None for no header)."""
    semaphore = asyncio.Semaphore(PROBE_CONCURRENCY)
    body = {"model": model, "prompt": "ka lo", "max_tokens": 1}

    async with httpx.AsyncClient(timeout=60) as client:

        async def one(session: str | None) -> str:
            async with semaphore:
                headers = {"x-session-id": session} if session else {}
                response = await client.post(f"{url}/v1/completions", json=body, headers=headers)
                response.raise_for_status()
                return response.headers[REPLICA_HEADER]

        return await asyncio.gather(*(one(s) for s in sessions))


async def _outcomes(url: str, model: str, requests: list[tuple[str, str]]) -> list[tuple[int, float, str]]:
    """(status, latency s, replica) of one 1-token completion per (session, prompt); status 0: no response."""
    semaphore = asyncio.Semaphore(PROBE_CONCURRENCY)

    async with httpx.AsyncClient(timeout=60) as client:

        async def one(session: str, prompt: str) -> tuple[int, float, str]:
            async with semaphore:
                started = time.perf_counter()
                body = {"model": model, "prompt": prompt, "max_tokens": 1}
                try:
                    response = await client.post(f"{url}/v1/completions", json=body, headers={"x-session-id": session})
                except httpx.HTTPError:  # the connection failed or was cut: a rejection as the client sees it
                    return 0, time.perf_counter() - started, ""
                return response.status_code, time.perf_counter() - started, response.headers.get(REPLICA_HEADER, "")

        return await asyncio.gather(*(one(s, p) for s, p in requests))


def fallback_run(plan: Any, model: str) -> dict[str, Any]:
    """Requests of 16 sessions while one replica is killed 1 s in: rejections and p99 latency."""
    requests = [(f"fallback-{i % 16}", "ka lo") for i in range(FALLBACK_REQUESTS)]
    box: dict[str, list[tuple[int, float, str]]] = {}
    runner = threading.Thread(target=lambda: box.setdefault("out", asyncio.run(_outcomes(plan.url, model, requests))))
    runner.start()
    time.sleep(1.0)
    killed = kill_one_replica(plan)
    runner.join(timeout=300)
    outcomes = box["out"]
    latencies = sorted(latency for _, latency, _ in outcomes)
    return {
        "requests": len(outcomes),
        "rejections": sum(status >= 500 or status == 0 for status, _, _ in outcomes),
        "p99_ms": 1000 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
        "killed": killed,
    }


def affinity(rows: list[StreamRow]) -> float:
    """Requests on their session's most used replica / requests, over sessions with at least two requests."""
    by_session: dict[str, Counter[str]] = {}
    for row in rows:
        if row.ok:
            by_session.setdefault(row.session, Counter())[row.replica] += 1
    several = [counts for counts in by_session.values() if sum(counts.values()) >= 2]
    total = sum(sum(c.values()) for c in several)
    return sum(max(c.values()) for c in several) / total if total else 0.0


def cv(counts: list[int]) -> float:
    return statistics.pstdev(counts) / statistics.fmean(counts) if counts and sum(counts) else 0.0


def routing_suite(
    spec_path: Path,
    out: Path,
    tokenizer: Path,
    duration_s: float,
    hot_session_policies: tuple[str, ...] = HOT_SESSION_POLICIES,
    requests_per_user: int | None = None,
    wait_for_delete: bool = True,
) -> dict[str, Any]:
    """Run the suite on the connected Ray cluster; returns (and writes) its figures. `hot_session_policies`: the
    policies whose hot-session campaign runs (the test asserts kv_aware's alone); `requests_per_user`: prefix-reuse
    campaigns of that many requests per user instead of Locust campaigns of `duration_s`; `wait_for_delete` False:
    the stack's deletions at the end only issued, as a test's teardown does."""
    data = yaml.safe_load(spec_path.read_text())
    # kv_aware reads the prompt and scores by the replicas' KV events: both on under every policy, so a policy switch
    # keeps the engine settings (a spec that sets either keeps its value).
    data.setdefault("routing", {}).setdefault("forward_body", True)
    data["routing"].setdefault("kv_events", True)
    for spec_model in data["models"]:
        spec_model["engine"] = small_cache(spec_model.get("engine", {}))
    out.mkdir(parents=True, exist_ok=True)
    model = data["models"][0]["name"]
    figures: dict[str, Any] = {}
    # A seed per suite run, so no campaign finds an earlier run's prompts in replicas that outlived it.
    seed = time.time_ns() % 2**31
    reuse = PrefixReuse(out, tokenizer, duration_s, replicas=3, seed=seed, requests_per_user=requests_per_user)
    plan = deploy_variant(data, CONSISTENT_HASH, 2)
    try:
        sessions = [f"remap-{i}" for i in range(REMAP_SESSIONS)]
        on_two = asyncio.run(_probe(plan.url, model, sessions))
        plan = deploy_variant(data, CONSISTENT_HASH, 3)
        time.sleep(1)
        on_three = asyncio.run(_probe(plan.url, model, sessions))
        figures["remap_out_2_to_3"] = sum(a != b for a, b in zip(on_two, on_three, strict=True)) / len(sessions)
        # Every policy on 3 replicas with the same engine settings (KV events and body forwarding on for all).
        for policy in PREFIX_POLICIES:
            plan = deploy_variant(data, policy, 3)
            if policy == ROUND_ROBIN:
                served = asyncio.run(_probe(plan.url, model, [None] * PROBES))
                figures["headerless_cv"] = cv(list(Counter(served).values()))
                figures["headerless_per_replica"] = dict(Counter(served))
            reuse.measure(plan, policy, hot_session=policy in hot_session_policies)
        figures.update(reuse.figures())
        # Consistent hash's affinity: its multi-turn campaign's sessions, each on one replica (no scale change).
        figures["affinity"] = affinity(reuse.rows_by_case["multi_turn", CONSISTENT_HASH])
        rows = reuse.rows
        on_three = asyncio.run(_probe(plan.url, model, sessions))  # the ring the scale-in starts from
        plan = deploy_variant(data, CONSISTENT_HASH, 2)
        time.sleep(1)
        back = asyncio.run(_probe(plan.url, model, sessions))
        figures["remap_in_3_to_2"] = sum(a != b for a, b in zip(on_three, back, strict=True)) / len(sessions)
        # Bodies over the forwarding buffer: routed by their session all the same (the router sees a cut body).
        plan = deploy_variant(data, CONSISTENT_HASH, 2, forward_body=True, body_buffer_bytes=OVER_BUFFER_BYTES)
        long_prompt = " ka lo mi" * (OVER_BUFFER_BYTES // 5)  # ~1.8 KB, within the model's context
        outcomes = asyncio.run(_outcomes(plan.url, model, [(f"big-{i % 20}", long_prompt) for i in range(100)]))
        by_session: dict[str, set[str]] = {}
        for (status, _, replica), i in zip(outcomes, range(100), strict=True):
            if status == 200:
                by_session.setdefault(f"big-{i % 20}", set()).add(replica)
        figures["over_buffer"] = {
            "requests": len(outcomes),
            "ok": sum(status == 200 for status, _, _ in outcomes),
            "sessions_on_one_replica": sum(len(r) == 1 for r in by_session.values()) / max(len(by_session), 1),
        }
        # num_fallback_replicas 2 (the default) versus 0, each while a replica is killed.
        figures["fallbacks"] = {"2": fallback_run(plan, model)}
        plan = deploy_variant(data, CONSISTENT_HASH, 2, policy_kwargs={"num_fallback_replicas": 0})
        figures["fallbacks"]["0"] = fallback_run(plan, model)
    finally:
        from sluice.deploy.apply import delete_plan

        delete_plan(plan, wait=wait_for_delete)
    (out / "routing.json").write_text(json.dumps(figures, indent=2))
    write_report("sluice load routing", summarize(rows), rows, out, extra_plots=reuse.plots())
    return figures
