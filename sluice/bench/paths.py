"""`sluice bench paths`: the same streams over every path to the same replicas, side by side, in one run.

Paths: the replicas' own ports (the limit), HAProxy alone, sluice's direct path, the legacy ingress, Serve's proxy and
Ray's own HAProxy direct streaming (the peer); the tiny model at 1/16/64 streams, then a zero-compute stand-in. Each
figure is the median of `REPETITIONS` interleaved rounds (each a burst); `direct` against HAProxy alone is the median
ratio of `PROXY_PAIRS` back-to-back pairs of steady rounds. Details: `sluice/bench/README.md`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import yaml

from base.contracts import ZERO_COMPUTE_STAND_IN
from base.quantiles import quantile
from base.tiny_model import SERVED_MODEL_NAME
from loadtests.stream_probe import StreamResult, one_stream
from routers.consistent_hash import NAME as CONSISTENT_HASH
from routers.round_robin import NAME as ROUND_ROBIN
from services.internal_credential import internal_headers
from sluice.bench.goals import PROXY_CASES, breakdown, judge, verdict_lines
from sluice.bench.overhead import DEFAULT_VARIANT, passthrough_haproxy, rates_table, route_call_rates, variant_label
from sluice.bench.summary import (
    PROXY_LIMIT_PATH,
    Pairs,
    Rounds,
    chart,
    paired_ratios,
    proxy_table,
    summarize,
    table,
)
from topologies import EMBEDDED_SPEC

if TYPE_CHECKING:
    from builders.plan import StackPlan

REPETITIONS = 3
# Pairs of steady rounds, HAProxy alone and `direct` back to back (which one first alternates), per case of
# `PROXY_CASES`: the ratio is taken within each pair, where the two paths share the machine's state. The goals' margins
# are 10 % and 3 %; a burst's TTFT p50 is quantized by the engine's steps (which step the median request catches), so
# its ratio spanned 0.4-3.3 and the median of 24 pairs of bursts swung 0.84-1.21. Steady rounds cut the spread of
# a pair's TTFT ratio (log sd 0.27 -> 0.12 at 16 streams, 0.39 -> 0.26 at 64; tokens/s about 0.1 both ways).
PROXY_PAIRS = 24
# In a steady round every stream sends this many requests back to back; the first wave is not timed.
STEADY_REQUESTS_PER_STREAM = 4
# From `SPREAD_FROM_STREAMS` streams, request k of stream i asks for the case's max_tokens times factor (i + k) mod 5
# (mean 1): there streams of one length end together and their next requests arrive as a burst again, every wave
# (log sd of a pair's TTFT ratio at 64 streams 0.27-0.35 in two runs of 12 pairs), and spread lengths spread the
# arrivals (0.17-0.18 in the same runs). At 16 streams one length is the steadier (0.095 against 0.17, 14 pairs).
STEADY_LENGTH_FACTORS = (0.5, 1.5, 0.75, 1.25, 1.0)
SPREAD_FROM_STREAMS = 64
# A one-stream round runs this many streams one after another: a percentile of one TTFT says nothing.
SINGLE_STREAM_SAMPLES = 8
# Workload -> (label, concurrent streams, max_tokens) cases.
TINY_MODEL = "tiny_model"
ZERO_COMPUTE = "zero_compute_engine_stand_in"
CASES = {
    TINY_MODEL: [("1", 1, 64), ("16", 16, 64), ("64", 64, 64)],
    ZERO_COMPUTE: [("64x16", 64, 16), ("64x256", 64, 256)],
}
TEAM_FILE = EMBEDDED_SPEC
# Router variants the route decision is measured on after the stack's own: (policy, router replicas, table decisions).
VARIANTS = (
    (CONSISTENT_HASH, 1, True),
    (ROUND_ROBIN, 1, False),
    (CONSISTENT_HASH, 1, False),
    (CONSISTENT_HASH, 2, False),
)


def _client_headers() -> dict[str, str]:
    """Every path's requests: unencoded, and with the internal credential the ports past the frontend ask for (the
    frontend strips and sets its own; Ray's peer ignores it)."""
    return {"accept-encoding": "identity", **internal_headers()}


async def _round(urls: list[str], streams: int, max_tokens: int) -> dict[str, float]:
    """`streams` concurrent streams over `urls` (round-robin; one stream: `SINGLE_STREAM_SAMPLES` in a row): the
    figures of one round."""
    limits = httpx.Limits(max_connections=streams)
    async with httpx.AsyncClient(timeout=300, limits=limits, headers=_client_headers()) as client:
        started = time.perf_counter()
        if streams == 1:
            results = [
                await one_stream(client, urls[i % len(urls)], SERVED_MODEL_NAME, max_tokens)
                for i in range(SINGLE_STREAM_SAMPLES)
            ]
        else:
            results = await asyncio.gather(
                *(one_stream(client, urls[i % len(urls)], SERVED_MODEL_NAME, max_tokens) for i in range(streams))
            )
        wall = time.perf_counter() - started
    return round_figures(results, results, wall)


def steady_lengths(stream: int, streams: int, max_tokens: int) -> list[int]:
    """The max_tokens of each request of stream `stream` of `streams` in a steady round (`STEADY_LENGTH_FACTORS`)."""
    factors = STEADY_LENGTH_FACTORS if streams >= SPREAD_FROM_STREAMS else (1.0,)
    return [round(max_tokens * factors[(stream + k) % len(factors)]) for k in range(STEADY_REQUESTS_PER_STREAM)]


async def _steady_round(urls: list[str], streams: int, max_tokens: int) -> dict[str, float]:
    """`streams` concurrent streams over `urls`, each sending `STEADY_REQUESTS_PER_STREAM` requests back to back
    (`steady_lengths`): the figures of one round, its latencies over every request but each stream's first (the
    synchronized wave)."""

    async def stream(client: httpx.AsyncClient, index: int) -> list[StreamResult]:
        url = urls[index % len(urls)]
        return [await one_stream(client, url, SERVED_MODEL_NAME, n) for n in steady_lengths(index, streams, max_tokens)]

    limits = httpx.Limits(max_connections=streams)
    async with httpx.AsyncClient(timeout=300, limits=limits, headers=_client_headers()) as client:
        started = time.perf_counter()
        per_stream = await asyncio.gather(*(stream(client, i) for i in range(streams)))
        wall = time.perf_counter() - started
    return steady_figures(per_stream, wall)


def steady_figures(per_stream: list[list[StreamResult]], wall: float) -> dict[str, float]:
    """A steady round's figures: tokens/s over every request, latencies without each stream's first request."""
    every = [result for stream in per_stream for result in stream]
    return round_figures(every, [result for stream in per_stream for result in stream[1:]], wall)


def round_figures(results: list[StreamResult], timed: list[StreamResult], wall: float) -> dict[str, float]:
    """A round's figures: tokens/s over every result of `results`, latencies over `timed`."""
    ttfts = [r.ttft_s * 1000 for r in timed]
    gaps = [g * 1000 for r in timed for g in r.token_gaps_s] or [0.0]
    return {
        "tokens_per_s": sum(r.completion_tokens for r in results) / wall,
        "ttft_p50_ms": quantile(ttfts, 0.5),
        "ttft_p99_ms": quantile(ttfts, 0.99),
        "itl_p50_ms": quantile(gaps, 0.5),
        "itl_p99_ms": quantile(gaps, 0.99),
        "headers_p50_ms": quantile([r.headers_s * 1000 for r in timed], 0.5),
    }


def interleaved(urls: dict[str, list[str]], cases: list[tuple[str, int, int]]) -> Rounds:
    """Every case over every path, path after path, `REPETITIONS` times (after one warm-up round per path)."""
    for path_urls in urls.values():
        asyncio.run(_round(path_urls, 2, 8))
    rounds: Rounds = {path: {label: [] for label, _, _ in cases} for path in urls}
    for _ in range(REPETITIONS):
        for label, streams, max_tokens in cases:
            for path, path_urls in urls.items():
                rounds[path][label].append(asyncio.run(_round(path_urls, streams, max_tokens)))
    return rounds


def paired(limit: list[str], direct: list[str], cases: list[tuple[str, int, int]]) -> Pairs:
    """`PROXY_PAIRS` pairs of steady rounds per case: HAProxy alone and `direct` back to back, the order
    alternating."""
    pairs: Pairs = {label: [] for label, _, _ in cases}
    for i in range(PROXY_PAIRS):
        for label, streams, max_tokens in cases:
            order = [(PROXY_LIMIT_PATH, limit), ("direct", direct)]
            measured = {
                path: asyncio.run(_steady_round(urls, streams, max_tokens))
                for path, urls in (order if i % 2 == 0 else order[::-1])
            }
            pairs[label].append((measured[PROXY_LIMIT_PATH], measured["direct"]))
    return pairs


def _deploy_stack(
    folder: Path, name: str, stand_in: str | None = None
) -> tuple[Any, dict[str, list[str]], dict[str, Any]]:
    """The embedded default with its legacy ingress retained, on free ports; each path's base URLs, and the spec."""
    from base.runtime import DEFAULT_SERVE_PROXY_PORT, LOOPBACK, free_port
    from builders.plan import build_plan
    from builders.specs import parse_spec
    from services.serve_internals import list_replica_endpoints
    from sluice.deploy.apply import apply_plan, ensure_models

    data = yaml.safe_load(TEAM_FILE.read_text())
    data["name"] = name
    data["frontend"].update(port=free_port(LOOPBACK), metrics_port=free_port(LOOPBACK))
    data["ingress"] = {"mode": "both", "canary_weight": 100}
    # sluice's cheapest direct path for the embedded default's round_robin: ranked from the router's table.
    data["routing"]["table_decisions"] = True
    for model in data["models"]:
        model["max_ongoing_requests"] = 128
    spec = parse_spec(data)
    plan = build_plan(spec)
    model = plan.models[0]
    if stand_in is not None:
        apps = [
            app.model_copy(update={"args": {**app.args, "engine_stand_in": stand_in}})
            if app.name == model.llm_app
            else app
            for app in plan.apps
        ]
        plan = plan.model_copy(update={"apps": apps})
    ensure_models(spec)
    (folder / f"{name}.yaml").write_text(yaml.safe_dump(data))
    if not apply_plan(spec, plan):
        raise RuntimeError(f"the bench stack {name} did not come up")
    replicas = asyncio.run(list_replica_endpoints(model.llm_app))
    legacy = asyncio.run(list_replica_endpoints(model.legacy_app))
    urls = {
        "replica_port": [f"{e.url}/{model.llm_app}" for e in replicas],
        "direct": [plan.url],
        "legacy": [f"{e.url}/{model.legacy_app}" for e in legacy],
        "serve_proxy": [f"http://{LOOPBACK}:{DEFAULT_SERVE_PROXY_PORT}/{model.llm_app}"],
    }
    return plan, urls, data


def _delete_stack(plan: StackPlan) -> None:
    from ray import serve

    for app in reversed(plan.apps):
        serve.delete(app.name)


@contextlib.contextmanager
def _peer(with_peer: bool) -> Iterator[tuple[Any, str]]:
    """Ray's own direct streaming on the tiny model, or None and why not."""
    from base.runtime import cache_dir, default_model_dir
    from sluice.bench.netns import in_private_netns
    from sluice.bench.ray_peer import running_ray_peer

    if not with_peer:
        yield None, "not run (--no-peer)"
    elif not in_private_netns():
        yield None, "not run: not in a private network namespace (Ray's HAProxy binds all interfaces)"
    else:
        # A short workdir: Ray's socket paths under it must stay within the OS limit.
        with running_ray_peer(default_model_dir(), cache_dir() / "ray-peer") as peer:
            yield peer, "measured (in-process executor, like sluice's replicas)"


def _measure(out: Path, name: str, stand_in: str | None, peer: Any) -> tuple[Rounds, Pairs, Any, dict[str, Any]]:
    plan, urls, data = _deploy_stack(out, name, stand_in)
    cases = CASES[TINY_MODEL if stand_in is None else ZERO_COMPUTE]
    proxy_cases = [case for case in cases if case[0] in PROXY_CASES["tiny" if stand_in is None else "zero"]]
    with passthrough_haproxy(out, urls["replica_port"]) as haproxy_url:
        ordered = {"replica_port": urls.pop("replica_port"), PROXY_LIMIT_PATH: [haproxy_url], **urls}
        if peer is not None:
            ordered["ray_replica_port"] = peer.replica_urls
            ordered["ray_peer"] = [peer.url]
        rounds = interleaved(ordered, cases)
        pairs = paired(ordered[PROXY_LIMIT_PATH], ordered["direct"], proxy_cases)
    return rounds, pairs, plan, data


def _route_call_variants(plan: Any, data: dict[str, Any]) -> dict[str, Any]:
    """The route decision at fixed rates on the stack's own router (round_robin, one replica, table decisions), then
    on each of `VARIANTS` (a policy or frontend switch leaves the LLM replicas)."""
    from ray import serve

    from sluice.bench.stack_variants import deploy_variant

    model = plan.models[0]
    handle = serve.get_app_handle(plan.frontend_app)
    variants = {DEFAULT_VARIANT: route_call_rates(plan.url, handle, model.router_app)}
    for policy, routers, tables in VARIANTS:
        data["frontend"]["routers"] = routers
        variant = deploy_variant(data, policy, data["models"][0]["replicas"], table_decisions=tables)
        variants[variant_label(policy, routers, tables)] = route_call_rates(variant.url, handle, model.router_app)
    return variants


def run_paths_bench(out: Path, with_peer: bool = True) -> dict[str, Any]:
    from sluice.deploy.local_cluster import start_local_cluster, stop_local_cluster

    out.mkdir(parents=True, exist_ok=True)
    start_local_cluster(log_to_driver=False)
    try:
        with _peer(with_peer) as (peer, peer_note):
            tiny_rounds, tiny_pairs, plan, data = _measure(out, "bench-paths", None, peer)
        rates = _route_call_variants(plan, data)
        _delete_stack(plan)
        zero_rounds, zero_pairs, _, _ = _measure(out, "bench-zero", ZERO_COMPUTE_STAND_IN, None)
    finally:
        stop_local_cluster()
    measured_at = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    workloads = {TINY_MODEL: summarize(tiny_rounds), ZERO_COMPUTE: summarize(zero_rounds)}
    proxy = {TINY_MODEL: paired_ratios(tiny_pairs), ZERO_COMPUTE: paired_ratios(zero_pairs)}
    verdicts = judge(
        workloads[TINY_MODEL], workloads[ZERO_COMPUTE], rates, {"tiny": proxy[TINY_MODEL], "zero": proxy[ZERO_COMPUTE]}
    )
    payload = {
        "measured_at": measured_at,
        "repetitions": REPETITIONS,
        "proxy_pairs": PROXY_PAIRS,
        "cases": {
            w: [{"label": c[0], "streams": c[1], "max_tokens": c[2]} for c in cases] for w, cases in CASES.items()
        },
        "ray_peer": peer_note,
        "workloads": workloads,
        "direct_vs_haproxy_only": proxy,
        "route_call_rates": rates,
        "breakdown": dict(breakdown(workloads[TINY_MODEL], rates)),
        "goals": [{"goal": g, "measured": m, "met": met} for g, m, met in verdicts],
    }
    (out / "paths.json").write_text(json.dumps(payload, indent=2))
    for workload, summary in workloads.items():
        chart(summary, out / f"paths-{workload}.png", f"{workload.replace('_', ' ')}, {measured_at}")
        print(f"\n{workload}: median of {REPETITIONS} interleaved rounds (x ratio to replica_port), {measured_at}:")
        print(table(summary))
        print(f"\n{workload}: direct against HAProxy alone (the limit a proxy can reach), {PROXY_PAIRS} steady pairs:")
        print(proxy_table(summary, proxy[workload]))
    print(f"\nray_peer: {peer_note}; ray_replica_port: the peer's replicas' own ports")
    print(
        "\nroute decision as HAProxy's Lua action times it (`tables`: ranked from the router's table; else the route"
        " call, SPOE to the route agents), open-loop POSTs at fixed rates:"
    )
    print(rates_table(rates))
    print("\nthe direct path's TTFT, part by part:")
    print("\n".join(f"  {part:<52}{value}" for part, value in payload["breakdown"].items()))
    print("\ngoals:")
    print(verdict_lines(verdicts))
    print(f"written: {out / 'paths.json'}, {out}/paths-*.png")
    return payload
