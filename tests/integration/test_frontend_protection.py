"""The frontend protects the replicas, end to end: real HAProxy, real routers, real vLLM replicas.

The module's own LLM app has one replica whose vLLM runs with `--api-key REPLICA_KEY`: vLLM itself answers 401 to
any request that does not carry that key, so a request it serves proves the key reached it, and its own 401 proves
that no key did. Three frontends stand in front of the replicas:
- `guarded`: the one-replica app, keys off, a 3 s request timeout and small size limits;
- `keyed_replica`: the one-replica app, team keys on (the team key is the replica's key);
- `team`: the session's two-replica app, team keys on, at most 4 requests in flight per client.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest
from ray import serve

from base.contracts import (
    AUTHORIZATION_HEADER,
    REASON_BODY_TOO_LARGE,
    REASON_HEADERS_TOO_LARGE,
    REASON_URL_TOO_LONG,
    REPLICA_HEADER,
    RETRY_AFTER_HEADER,
    SERVE_REASON_HEADER,
)
from infra.api_keys import ApiKeySource, key_hash_line
from infra.haproxy.protection import ClientLimits, FrontendProtection
from services.replica.llm_config import ReplicaDeploymentConfig
from services.serve_internals import list_replica_endpoints, wait_for_endpoints
from sluice.bench.stack_harness import DirectStreamStack
from tests.support.frontend_contract import assert_frontend_error, assert_refused
from tests.support.frontend_metrics import refusal_counts, request_errors
from tests.support.llm_cluster import LLMCluster, deploy_llm_app, direct_stack
from tests.support.raw_http import partial_request, request_head
from tests.support.sse import chunks, data_payloads
from tests.support.vllm_metrics import engine_requests

pytestmark = pytest.mark.integration

REPLICA_KEY = "sk-replica-only"
KEY_A, KEY_B, KEY_C = "sk-client-a", "sk-client-b", "sk-client-c"
REQUEST_TIMEOUT_S = 3.0
MAX_BODY_BYTES, MAX_HEADER_BYTES, MAX_URL_BYTES = 64 * 1024, 4096, 2048
ATTACKERS = 200
# The session's app holds "/": the module's app serves under its own prefix, on its replica's port too; clients of
# its frontend send the public path, HAProxy adds the prefix.
PREFIX = "/protected"
CHAT_PATH = "/v1/chat/completions"
CHAT = {"model": "sluice-tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


@pytest.fixture(scope="module")
def keyed_app(llm_cluster: LLMCluster, tiny_model_dir: Path) -> Iterator[LLMCluster]:
    name = "protected-llm"
    deployment = ReplicaDeploymentConfig(name="ProtectedReplica", num_replicas=1)
    config = deploy_llm_app(name, tiny_model_dir, deployment, route_prefix=PREFIX, extra_args={"api_key": REPLICA_KEY})
    yield LLMCluster(app=name, config=config, endpoints=wait_for_endpoints(name, 1, timeout_s=300))
    serve.delete(name, _blocking=False)


@pytest.fixture(scope="module")
def guarded(keyed_app: LLMCluster) -> Iterator[DirectStreamStack]:
    protection = FrontendProtection(
        request_timeout_s=REQUEST_TIMEOUT_S,
        max_body_bytes=MAX_BODY_BYTES,
        max_header_bytes=MAX_HEADER_BYTES,
        max_url_bytes=MAX_URL_BYTES,
    )
    with direct_stack(
        keyed_app, router_name="protected-router", replicas=1, protection=protection, replica_route_prefix=PREFIX
    ) as started:
        yield started


@pytest.fixture(scope="module")
def key_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("keys") / "team-keys.txt"
    path.write_text("".join(key_hash_line(key, label) + "\n" for key, label in [(KEY_A, "a"), (KEY_B, "b")]))
    return path


@pytest.fixture(scope="module")
def keyed_replica(keyed_app: LLMCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DirectStreamStack]:
    path = tmp_path_factory.mktemp("replica-key") / "keys.txt"
    path.write_text(key_hash_line(REPLICA_KEY) + "\n")
    protection = FrontendProtection(api_keys=ApiKeySource(file=path))
    with direct_stack(
        keyed_app, router_name="protected-keyed-router", replicas=1, protection=protection, replica_route_prefix=PREFIX
    ) as started:
        yield started


@pytest.fixture(scope="module")
def team(llm_cluster: LLMCluster, key_file: Path) -> Iterator[DirectStreamStack]:
    protection = FrontendProtection(
        api_keys=ApiKeySource(file=key_file), client_limits=ClientLimits(max_concurrent_requests=4)
    )
    with direct_stack(llm_cluster, router_name="team-router", protection=protection) as started:
        yield started


def route_calls(stack: DirectStreamStack) -> float:
    """Route calls the stack's routers answered (routed or refused), over every router replica."""
    total = 0.0
    for router in asyncio.run(list_replica_endpoints(stack.spec.router_app)):
        text = httpx.get(f"{router.url}{stack.spec.router_route_prefix}/metrics").text
        pattern = r'^sluice_router_(?:routed|refused)_total\{app="' + re.escape(stack.spec.app) + r'"[^}]*\} (\S+)$'
        total += sum(float(v) for v in re.findall(pattern, text, re.M))
    return total


def _bearer(key: str) -> dict[str, str]:
    return {AUTHORIZATION_HEADER: f"Bearer {key}"}


def test_200_partial_bodies_cannot_take_the_replica_down(guarded: DirectStreamStack, keyed_app) -> None:
    engine_before, routes_before = engine_requests(keyed_app.app, PREFIX), route_calls(guarded)
    errors_before = request_errors(guarded.spec.prometheus_port)
    port = guarded.spec.haproxy_port
    head = request_head(CHAT_PATH, 1000, f"Authorization: Bearer {REPLICA_KEY}")
    worker = psutil.Process(guarded.haproxy.worker_pid)
    rss_before = worker.memory_info().rss

    async def attack_and_serve() -> tuple[list, float, httpx.Response]:
        # Every tenth attacker drips a byte every half second: never idle, never whole.
        attackers = [
            asyncio.create_task(
                partial_request(port, head, b'{"mod', REQUEST_TIMEOUT_S + 5, drip=b" " * 20 if i % 10 == 0 else b"")
            )
            for i in range(ATTACKERS)
        ]
        await asyncio.sleep(0.5)
        async with httpx.AsyncClient(timeout=10) as client:
            started = time.monotonic()
            served = await client.post(f"{guarded.url}{CHAT_PATH}", json=CHAT, headers=_bearer(REPLICA_KEY))
            served_in = time.monotonic() - started
        return await asyncio.gather(*attackers), served_in, served

    attacked, served_in, served = asyncio.run(attack_and_serve())
    assert served.status_code == 200, served.text
    assert served.headers[REPLICA_HEADER] == keyed_app.endpoints[0].replica_id
    assert served_in < 2.0
    for response in attacked:
        assert_frontend_error(response.status, response.headers, response.body, 408)
        assert response.elapsed_s <= REQUEST_TIMEOUT_S + 1
    # Only the well-formed request reached a router and the engine.
    assert route_calls(guarded) - routes_before == 1
    assert engine_requests(keyed_app.app, PREFIX) - engine_before == 1
    assert request_errors(guarded.spec.prometheus_port) - errors_before == ATTACKERS
    print(f"HAProxy worker RSS {rss_before / 2**20:.0f} MiB -> {worker.memory_info().rss / 2**20:.0f} MiB")


def test_oversized_requests_reach_neither_router_nor_replica(guarded: DirectStreamStack, keyed_app) -> None:
    engine_before, routes_before = engine_requests(keyed_app.app, PREFIX), route_calls(guarded)
    url = f"{guarded.url}{CHAT_PATH}"
    with httpx.Client(timeout=10, headers=_bearer(REPLICA_KEY)) as client:
        big = {**CHAT, "messages": [{"role": "user", "content": "x" * (MAX_BODY_BYTES + 1)}]}
        assert_refused(client.post(url, json=big), 413)
        chunked = (b"x" * 8192 for _ in range(MAX_BODY_BYTES // 8192 + 2))
        assert_refused(client.post(url, content=chunked), 413)
        assert_refused(client.post(url, json=CHAT, headers={"x-padding": "p" * (MAX_HEADER_BYTES + 1)}), 431)
        assert_refused(client.post(f"{url}?pad={'p' * MAX_URL_BYTES}", json=CHAT), 414)
        assert route_calls(guarded) == routes_before
        assert engine_requests(keyed_app.app, PREFIX) == engine_before
        refused = refusal_counts(guarded.spec.prometheus_port)
        assert [refused[r] for r in (REASON_BODY_TOO_LARGE, REASON_HEADERS_TOO_LARGE, REASON_URL_TOO_LONG)] == [2, 1, 1]
        # Inside the limits the same stack serves.
        ok = client.post(url, json=CHAT, headers={"x-padding": "p" * (MAX_HEADER_BYTES // 2)})
        assert ok.status_code == 200 and ok.headers[REPLICA_HEADER]


def test_a_client_over_its_concurrency_limit_does_not_slow_the_others(team: DirectStreamStack) -> None:
    stream = {"model": "sluice-tiny", "prompt": "ka lo", "max_tokens": 200, "ignore_eos": True, "stream": True}

    async def one(client: httpx.AsyncClient, key: str) -> tuple[int, dict[str, str], str | None]:
        async with client.stream("POST", "/v1/completions", json=stream, headers=_bearer(key)) as response:
            body = await response.aread()
            finish = None
            if response.status_code == 200:
                finish = chunks(data_payloads(body.decode()))[-1]["choices"][0]["finish_reason"]
            else:
                assert_frontend_error(response.status_code, response.headers, body, 429)
            return response.status_code, dict(response.headers), finish

    async def burst() -> tuple[list, list]:
        async with httpx.AsyncClient(base_url=team.url, timeout=60) as client:
            a = [one(client, KEY_A) for _ in range(10)]
            b = [one(client, KEY_B) for _ in range(4)]
            results = await asyncio.gather(*a, *b)
            return results[:10], results[10:]

    a, b = asyncio.run(burst())
    assert sorted(status for status, _, _ in a) == [200] * 4 + [429] * 6
    for status, headers, finish in a:
        if status == 429:
            assert headers[RETRY_AFTER_HEADER] == "1" and headers[SERVE_REASON_HEADER] == "client_limit"
        else:
            assert finish == "length"
    assert [(status, finish) for status, _, finish in b] == [(200, "length")] * 4


def test_without_a_valid_key_nothing_is_routed(team: DirectStreamStack) -> None:
    routes_before = route_calls(team)
    with httpx.Client(base_url=team.url, timeout=10) as client:
        for headers in ({}, _bearer(KEY_C), {AUTHORIZATION_HEADER: f"Basic {KEY_A}"}):
            response = client.post("/v1/chat/completions", json=CHAT, headers=headers)
            assert_refused(response, 401)
            assert response.headers["www-authenticate"] == "Bearer"
        assert route_calls(team) == routes_before
        served = client.post("/v1/chat/completions", json=CHAT, headers=_bearer(KEY_A))
        assert served.status_code == 200 and served.json()["choices"][0]["message"]["role"] == "assistant"
    assert route_calls(team) == routes_before + 1


def test_the_replica_never_sees_the_key(guarded: DirectStreamStack, keyed_replica: DirectStreamStack) -> None:
    with httpx.Client(timeout=10) as client:
        # Without frontend keys the client's Authorization header goes through: vLLM accepts its own key.
        passed = client.post(f"{guarded.url}{CHAT_PATH}", json=CHAT, headers=_bearer(REPLICA_KEY))
        assert passed.status_code == 200
        # With frontend keys the same key is valid at the frontend, removed there, and vLLM sees none.
        stripped = client.post(f"{keyed_replica.url}{CHAT_PATH}", json=CHAT, headers=_bearer(REPLICA_KEY))
        assert stripped.status_code == 401 and stripped.headers[REPLICA_HEADER]
        assert SERVE_REASON_HEADER not in stripped.headers  # vLLM's own 401, not the frontend's


def test_rotating_the_key_file_revokes_a_key_without_a_reload(team: DirectStreamStack, key_file: Path) -> None:
    haproxy = team.haproxy
    assert haproxy is not None and haproxy.runtime is not None
    master, worker = haproxy.pid, haproxy.worker_pid
    uptime = int(haproxy.runtime.show_info()["Uptime_sec"])
    with httpx.Client(base_url=team.url, timeout=10) as client:
        assert client.post("/v1/chat/completions", json=CHAT, headers=_bearer(KEY_B)).status_code == 200
        key_file.write_text(key_hash_line(KEY_A, "a") + "\n" + key_hash_line(KEY_C, "c, replaces b") + "\n")
        rotated = time.monotonic()
        while client.post("/v1/chat/completions", json=CHAT, headers=_bearer(KEY_B)).status_code != 401:
            assert time.monotonic() - rotated < 5, "the old key still works 5 s after the rotation"
            time.sleep(0.2)
        assert_refused(client.post("/v1/chat/completions", json=CHAT, headers=_bearer(KEY_B)), 401)
        assert client.post("/v1/chat/completions", json=CHAT, headers=_bearer(KEY_C)).status_code == 200
        assert client.post("/v1/chat/completions", json=CHAT, headers=_bearer(KEY_A)).status_code == 200
    info = haproxy.runtime.show_info()
    assert (haproxy.pid, int(info["Pid"])) == (master, worker)
    assert int(info["Uptime_sec"]) >= uptime
