"""Replica lifecycle: a stopping replica drains its streams within its grace period and aborts what outlasts it.
(A replaced replica's new port: direct_path/test_failover.py, which replaces one of the session's replicas.)"""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest
from ray import serve

from base.waiting import wait_until
from services.internal_credential import internal_headers
from services.replica.llm_config import MIN_DRAIN_GRACE_S, ReplicaDeploymentConfig
from services.serve_internals import list_replica_endpoints, wait_for_endpoints
from tests.support.llm_cluster import LLMCluster, deploy_llm_app
from tests.support.sse import astream_lines, chunks, stream_lines

pytestmark = pytest.mark.integration

APP = "lifecycle"
PREFIX = "/lifecycle"
DRAIN_GRACE_S = 30.0


# 192 concurrent streams of 1,000 tokens keep one tiny-model replica busy well past the grace period on 2 cores
# (48 were seen to finish within the 10 s once vLLM's CPU attention ran on AMX). The engine runs them all at once.
ABORT_STREAMS = 192
ABORT_APP, ABORT_PREFIX = "lifecycle-abort", "/abort"


@pytest.fixture(scope="module")
def lifecycle_app(llm_cluster: LLMCluster, tiny_model_dir):
    """The drain test's replica, and the abort test's beside it: two engine starts at once take about one's time on
    2 cores (each mostly waits on its own imports)."""
    deploy_llm_app(
        APP,
        tiny_model_dir,
        ReplicaDeploymentConfig(name="LifecycleReplica", num_replicas=1, drain_grace_s=DRAIN_GRACE_S),
        route_prefix=PREFIX,
    )
    deploy_llm_app(
        ABORT_APP,
        tiny_model_dir,
        ReplicaDeploymentConfig(
            name="AbortReplica", num_replicas=1, max_ongoing_requests=ABORT_STREAMS, drain_grace_s=MIN_DRAIN_GRACE_S
        ),
        route_prefix=ABORT_PREFIX,
        max_num_seqs=ABORT_STREAMS,
    )
    yield wait_for_endpoints(APP, 1, timeout_s=300)[0]
    for app in (APP, ABORT_APP):
        if asyncio.run(list_replica_endpoints(app)):
            serve.delete(app, _blocking=False)


def _healthz(url: str) -> int:
    try:
        return httpx.get(f"{url}/-/healthz", timeout=2).status_code
    except httpx.TransportError:
        return 0


def test_stopping_a_replica_lets_its_stream_finish(lifecycle_app) -> None:
    endpoint = asyncio.run(list_replica_endpoints(APP))[0]
    max_tokens = 1000
    body = {"model": "sluice-tiny", "prompt": "drain", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    result: dict = {}
    internal = internal_headers()

    def stream() -> None:
        url = f"{endpoint.url}{PREFIX}/v1/completions"
        with httpx.stream("POST", url, json=body, timeout=60, headers=internal) as response:
            lines = stream_lines(response)
            first = next(lines)
            result["started"] = time.monotonic()
            started.set()
            payloads = [first[len("data: ") :]] + [line[len("data: ") :] for line in lines if line.startswith("data: ")]
            result["parsed"] = chunks(payloads)
            result["finished"] = time.monotonic()

    started = threading.Event()
    reader = threading.Thread(target=stream)
    reader.start()
    assert started.wait(60)
    serve.delete(APP, _blocking=False)
    while _healthz(endpoint.url) == 200:
        assert reader.is_alive(), "the stream ended before the replica began to drain: nothing was tested"
        time.sleep(0.05)
    draining_seen = time.monotonic()
    reader.join(DRAIN_GRACE_S + 10)
    assert not reader.is_alive()
    parsed = result["parsed"]
    assert parsed[-1]["choices"][0]["finish_reason"] == "length"
    text = "".join(c["choices"][0]["text"] for c in parsed)
    assert text, "the stream must carry tokens to its end"
    assert draining_seen < result["finished"], "the replica must drain while the stream runs"
    assert result["finished"] - result["started"] < DRAIN_GRACE_S
    wait_until(60, lambda: not asyncio.run(list_replica_endpoints(APP)), "the stopped replica unlisted", poll_s=0.5)


async def _stream_until_cut(client: httpx.AsyncClient, url: str, body: dict, first: asyncio.Event) -> list[str]:
    payloads: list[str] = []
    try:
        async with client.stream("POST", url, json=body) as response:
            async for line in astream_lines(response):
                if line.startswith("data: "):
                    payloads.append(line[len("data: ") :])
                    first.set()
    except httpx.TransportError:
        pass
    return payloads


async def _cut_streams(url: str, app: str, streams: int, max_tokens: int) -> tuple[list[list[str]], float]:
    body = {"model": "sluice-tiny", "prompt": "cut", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    started = [asyncio.Event() for _ in range(streams)]
    limits = httpx.Limits(max_connections=streams)
    async with httpx.AsyncClient(timeout=120, limits=limits, headers=internal_headers()) as client:
        tasks = [asyncio.create_task(_stream_until_cut(client, url, body, event)) for event in started]
        await asyncio.wait_for(asyncio.gather(*(event.wait() for event in started)), 60)
        await asyncio.to_thread(serve.delete, app, False)
        deleted = time.monotonic()
        results = await asyncio.gather(*tasks)
    return results, time.monotonic() - deleted


def test_streams_outlasting_the_grace_period_are_aborted(lifecycle_app) -> None:
    grace_s = MIN_DRAIN_GRACE_S
    endpoint = wait_for_endpoints(ABORT_APP, 1, timeout_s=300)[0]
    url = f"{endpoint.url}{ABORT_PREFIX}/v1/completions"
    results, cut_after = asyncio.run(_cut_streams(url, ABORT_APP, ABORT_STREAMS, 1000))
    finished = [r for r in results if r and r[-1] == "[DONE]"]
    assert not finished, f"{len(finished)} streams finished; none should outlast the grace period"
    assert all(r for r in results), "every stream was running when the replica began to drain"
    assert grace_s - 1 < cut_after < grace_s + 10
