"""`sluice bench replica`: startup time, memory and streaming speed of the tiny-model replicas."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import psutil

from base.quantiles import quantile
from base.tiny_model import SERVED_MODEL_NAME
from loadtests.stream_probe import probe
from services.internal_credential import internal_headers

BENCH_APP = "bench"


def replica_memory_mib(app: str) -> list[tuple[float, float]]:
    """(RSS, unique set size) in MiB per replica, its vLLM engine child processes included."""
    sizes = []
    for process in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(process.info["cmdline"] or [])
        if not cmdline.startswith(f"ray::ServeReplica:{app}:"):
            continue
        tree = [process, *process.children(recursive=True)]
        infos = [p.memory_full_info() for p in tree]
        sizes.append((sum(i.rss for i in infos) / 2**20, sum(i.uss for i in infos) / 2**20))
    return sizes


def run_replica_bench(model: Path, replicas: int = 2) -> None:
    from services.serve_internals import wait_for_endpoints
    from sluice.bench.stack_harness import DirectStreamSpec, deploy_llm
    from sluice.deploy.local_cluster import start_local_cluster, stop_local_cluster

    started = time.monotonic()
    start_local_cluster()
    ray_ready = time.monotonic() - started
    try:
        spec = DirectStreamSpec(app=BENCH_APP, model=str(model), replicas=replicas, max_ongoing_requests=64)
        deploy_started = time.monotonic()
        config = deploy_llm(spec)
        endpoints = wait_for_endpoints(BENCH_APP, replicas)
        deploy_s = time.monotonic() - deploy_started
        urls = [e.url for e in endpoints]
        name = config.engine.served_model_name
        internal = internal_headers()
        asyncio.run(probe(urls[:1], name, streams=2, max_tokens=16, extra_headers=internal))
        print(f"ray+serve start: {ray_ready:.1f} s; deploy-to-ready of {replicas} replicas: {deploy_s:.1f} s")
        for rss, uss in replica_memory_mib(BENCH_APP):
            print(f"replica memory: RSS {rss:.0f} MiB, unique {uss:.0f} MiB (replica + engine process)")
        print(f"{'case':<34}{'TTFT p50 ms':>12}{'TTFT max ms':>12}{'tok/s/stream':>14}{'tok/s total':>12}")
        cases = [
            ("1 stream x128, one replica", urls[:1], 1),
            ("16 streams x128, one replica", urls[:1], 16),
            (f"16 streams x128, {replicas} replicas", urls, 16),
        ]
        for label, targets, streams in cases:
            report = asyncio.run(probe(targets, name, streams=streams, max_tokens=128, extra_headers=internal))
            print(
                f"{label:<34}{report.ttft_p50_ms:>12.1f}{report.ttft_max_ms:>12.1f}"
                f"{report.per_stream_tokens_per_s:>14.0f}{report.aggregate_tokens_per_s:>12.0f}"
            )
    finally:
        stop_local_cluster()


def _ttft_ms(url: str, model: str, samples: int) -> list[float]:
    internal = internal_headers()
    return [
        asyncio.run(probe([url], model, streams=1, max_tokens=8, extra_headers=internal)).ttft_p50_ms
        for _ in range(samples)
    ]


def _route_call_ms(url: str, samples: int) -> list[float]:
    import httpx

    timings = []
    with httpx.Client(headers=internal_headers()) as client:
        for i in range(samples):
            started = time.perf_counter()
            client.post(url, headers={"x-session-id": f"s{i}"}).raise_for_status()
            timings.append((time.perf_counter() - started) * 1e3)
    return timings


def _percentiles(values: list[float]) -> str:
    return f"p50 {quantile(values, 0.5):.2f} ms, p99 {quantile(values, 0.99):.2f} ms"


def run_direct_bench(model: Path, samples: int = 200) -> None:
    """TTFT through HAProxy + router versus the replica's own port, and the route call alone."""
    from base.contracts import ROUTE_PATH
    from routers.consistent_hash import NAME as CONSISTENT_HASH
    from services.serve_internals import list_replica_endpoints
    from sluice.bench.stack_harness import DirectStreamSpec, DirectStreamStack
    from sluice.deploy.local_cluster import start_local_cluster, stop_local_cluster

    start_local_cluster()
    spec = DirectStreamSpec(
        app=BENCH_APP, model=str(model), policy=CONSISTENT_HASH, haproxy_port=28000, prometheus_port=28404
    )
    stack = DirectStreamStack(spec)
    try:
        stack.start()
        replica = asyncio.run(list_replica_endpoints(spec.app))[0]
        router = asyncio.run(list_replica_endpoints(spec.router_app))[0]
        name = SERVED_MODEL_NAME
        _ttft_ms(stack.url, name, 10)
        direct = _ttft_ms(replica.url, name, samples)
        routed = _ttft_ms(stack.url, name, samples)
        route = _route_call_ms(f"{router.url}{spec.router_route_prefix}{ROUTE_PATH}", 1000)
        print(f"TTFT direct to a replica port: {_percentiles(direct)}")
        print(f"TTFT through HAProxy + router: {_percentiles(routed)}")
        print(f"route call alone (router, keep-alive): {_percentiles(route)}")
    finally:
        stack.stop(delete_apps=False)
        stop_local_cluster()
