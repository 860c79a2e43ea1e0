"""The retained legacy ingress in front of the session's LLM app: a Python Serve replica relaying each request
through a streaming DeploymentHandle call to the LLM replica's `stream()`. Same answers as the replica's own
port, marked `x-serve-path: legacy`; bad input answered as vLLM answers it; a client that leaves aborts the
engine request; `sluice replay --compare` finds the direct path (HAProxy + router) and the legacy path identical;
with capacity_queue, every token the handle's adapter takes is released once, whether the client stays or leaves."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import ray
from ray import serve

from base.contracts import CHOSEN_REPLICA_HEADER, LEGACY_PATH, REPLICA_HEADER, SERVE_PATH_HEADER
from base.waiting import WaitTimeout, wait_until
from routers.ledger_actor import LEDGER_NAMESPACE, ledger_actor_name
from services.internal_credential import internal_headers
from services.legacy.ingress import LegacyIngressSettings, legacy_ingress_application
from services.replica.llm_config import ReplicaDeploymentConfig
from services.serve_internals import list_replica_endpoints, wait_for_endpoints
from sluice.deploy.apply import delete_apps
from tests.support.llm_cluster import LLMCluster, deploy_llm_app, direct_stack
from tests.support.sse import astream_lines, chunks, data_lines, stream_lines

pytestmark = pytest.mark.integration

APP = "legacy-test"
PREFIX = f"/{APP}"
GREEDY = {"messages": [{"role": "user", "content": "ka lo mi"}], "max_tokens": 16, "temperature": 0, "stream": True}
_IN_FLIGHT = re.compile(r"^vllm:num_requests_(?:running|waiting)\{[^}]*\} (\S+)$", re.M)


@pytest.fixture(scope="module")
def legacy_url(llm_cluster: LLMCluster) -> Iterator[str]:
    settings = LegacyIngressSettings(target_app=llm_cluster.app, target_deployment=llm_cluster.config.deployment.name)
    serve.run(legacy_ingress_application(settings), name=APP, route_prefix=PREFIX, blocking=False)
    try:
        [endpoint] = wait_for_endpoints(APP, 1, timeout_s=120)
        yield f"{endpoint.url}{PREFIX}"
    finally:
        serve.delete(APP, _blocking=False)


def _text(response: httpx.Response) -> str:
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks(data_lines(response)) if c["choices"])


def test_the_legacy_path_streams_the_replicas_own_answer(legacy_url: str, llm_cluster: LLMCluster) -> None:
    with httpx.Client(timeout=60, headers=internal_headers()) as client:
        with client.stream("POST", f"{legacy_url}/v1/chat/completions", json=GREEDY) as response:
            assert response.status_code == 200
            assert response.headers[SERVE_PATH_HEADER] == LEGACY_PATH
            assert response.headers[CHOSEN_REPLICA_HEADER] == response.headers[REPLICA_HEADER]
            legacy = _text(response)
        replica = next(e for e in llm_cluster.endpoints if e.replica_id == response.headers[REPLICA_HEADER])
        with client.stream("POST", f"{replica.url}/v1/chat/completions", json=GREEDY) as direct:
            assert direct.status_code == 200
            assert legacy == _text(direct) != ""


def test_bad_input_gets_vllms_own_error_through_the_legacy_path(legacy_url: str) -> None:
    url = f"{legacy_url}/v1/chat/completions"
    response = httpx.post(url, content=b"{not json", timeout=30, headers=internal_headers())
    assert response.status_code == 400 and response.json()["error"]["code"] == 400
    assert response.headers[SERVE_PATH_HEADER] == LEGACY_PATH


def _in_flight(llm_cluster: LLMCluster) -> float:
    endpoints = asyncio.run(list_replica_endpoints(llm_cluster.app))
    return sum(float(v) for e in endpoints for v in _IN_FLIGHT.findall(httpx.get(f"{e.url}/metrics").text))


def test_a_client_that_leaves_aborts_the_engine_request(legacy_url: str, llm_cluster: LLMCluster) -> None:
    body = {**GREEDY, "max_tokens": 1000, "ignore_eos": True}
    url = f"{legacy_url}/v1/chat/completions"
    with httpx.stream("POST", url, json=body, timeout=60, headers=internal_headers()) as response:
        lines = stream_lines(response)
        for _ in range(5):
            next(lines)
        assert _in_flight(llm_cluster) >= 1
    left = time.monotonic()
    while _in_flight(llm_cluster) > 0:
        assert time.monotonic() - left < 1.0, "the engine still runs the request 1 s after the client left"
        time.sleep(0.02)


def test_replay_compare_finds_the_direct_and_the_legacy_path_identical(
    legacy_url: str, llm_cluster: LLMCluster, tmp_path: Path
) -> None:
    lines = []
    for i in range(50):
        words = " ".join(["ka", "lo", "mi", "tessa", "ren"][: 1 + i % 5])
        if i % 2:
            path, body = "/v1/completions", {"prompt": f"{words} {i}", "max_tokens": 8, "temperature": 0}
        else:
            messages = [{"role": "user", "content": f"{words} {i}"}]
            path, body = "/v1/chat/completions", {"messages": messages, "max_tokens": 8, "temperature": 0}
        body["stream"] = i % 3 != 0
        # Recorded inside the cluster: the legacy app's own port asks for the internal credential.
        headers = {"x-session-id": f"user-{i % 7}", **internal_headers()}
        lines.append(json.dumps({"at_s": i * 0.02, "path": path, "headers": headers, "body": body}))
    recording = tmp_path / "recording.jsonl"
    recording.write_text("\n".join(lines) + "\n")
    with direct_stack(llm_cluster) as stack:
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "sluice.cli.main",
                "replay",
                str(recording),
                "--target",
                stack.url,
                "--compare",
                legacy_url,
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
    summary = json.loads(result.stdout)
    assert result.returncode == 0, summary
    assert summary == {"requests": 50, "statuses": [200], "unanswered": 0, "identical": 50, "differences": []}


CQ_APP = "legacy-cq-llm"
CQ_LEGACY_APP = "legacy-cq"


@pytest.fixture(scope="module")
def capacity_queue_legacy(ray_cluster: None, tiny_model_dir: Path) -> Iterator[tuple[str, str]]:
    """An LLM app whose handle calls take capacity tokens (capacity_queue), and a legacy ingress in front of it:
    (the legacy URL, the ledger actor's name)."""
    deployment = ReplicaDeploymentConfig(
        name="CQReplica", num_replicas=1, capacity_ledger=True, handle_policy="capacity_queue"
    )
    deploy_llm_app(CQ_APP, tiny_model_dir, deployment, route_prefix=f"/{CQ_APP}")
    settings = LegacyIngressSettings(target_app=CQ_APP, target_deployment=deployment.name)
    serve.run(
        legacy_ingress_application(settings), name=CQ_LEGACY_APP, route_prefix=f"/{CQ_LEGACY_APP}", blocking=False
    )
    try:
        wait_for_endpoints(CQ_APP, 1, timeout_s=300)
        [endpoint] = wait_for_endpoints(CQ_LEGACY_APP, 1, timeout_s=120)
        yield f"{endpoint.url}/{CQ_LEGACY_APP}", ledger_actor_name(CQ_APP, deployment.name)
    finally:
        delete_apps([CQ_APP, CQ_LEGACY_APP], frontend_first=False, wait=False)


def test_capacity_tokens_of_the_legacy_path_are_released_once_even_when_clients_leave(
    capacity_queue_legacy: tuple[str, str],
) -> None:
    url, ledger_name = capacity_queue_legacy
    ledger = ray.get_actor(ledger_name, namespace=LEDGER_NAMESPACE)

    async def one(client: httpx.AsyncClient, i: int) -> None:
        body = {**GREEDY, "max_tokens": 24, "ignore_eos": True}
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            # The handle path's choice (the capacity_queue adapter's) is the replica that served.
            assert response.headers[CHOSEN_REPLICA_HEADER] == response.headers[REPLICA_HEADER]
            lines = astream_lines(response)
            if i % 4 == 0:  # 50 of the 200 leave after their first chunk
                await anext(line async for line in lines if line.startswith("data: "))
                return
            assert [line async for line in lines if line.startswith("data: ")][-1] == "data: [DONE]"

    async def run() -> None:
        limit = asyncio.Semaphore(16)
        async with httpx.AsyncClient(timeout=60, headers=internal_headers()) as client:

            async def bounded(i: int) -> None:
                async with limit:
                    await one(client, i)

            await asyncio.gather(*(bounded(i) for i in range(200)))

    asyncio.run(run())
    with contextlib.suppress(WaitTimeout):
        wait_until(10, lambda: not ray.get(ledger.snapshot.remote(), timeout=10)["outstanding"], "release", poll_s=0.1)
    snapshot = ray.get(ledger.snapshot.remote(), timeout=10)
    assert snapshot["outstanding"] == 0 and all(r["in_flight"] == 0 for r in snapshot["replicas"].values())
    assert snapshot["granted"] == snapshot["released"] >= 200, snapshot
    assert snapshot["double_releases"] == snapshot["unknown_releases"] == snapshot["reaped"] == 0, snapshot
