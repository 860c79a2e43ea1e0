"""The frontend's protection rules in real HAProxy, against the stand-in replicas and routers (fast; the acceptance
tests with vLLM replicas and the real router are in ../test_frontend_protection.py): dripped and chunked bodies,
API key checks and what reaches a replica or a router, a broken key file, the rate limit, and clients keyed by
source address when keys are off."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from base.contracts import (
    AUTHORIZATION_HEADER,
    REASON_CLIENT_LIMIT,
    REASON_INVALID_API_KEY,
    REASON_UNKNOWN_PATH,
    REPLICA_HEADER,
    REQUEST_ID_HEADER,
    RETRY_AFTER_HEADER,
    SERVE_REASON_HEADER,
)
from base.waiting import wait_until
from infra.api_keys import ApiKeySource, key_hash_line
from infra.haproxy.apps import AppRoute
from infra.haproxy.protection import ClientLimits, FrontendProtection
from routers.kv_aware import KV_INDEX_PATH
from tests.integration.standin_plane.plane import Env, Plane, start_plane, stop_plane
from tests.integration.standin_plane.standins import APP, CHAT_PATH, first_event
from tests.support.frontend_contract import assert_frontend_error, assert_refused
from tests.support.frontend_metrics import refusal_counts, request_errors
from tests.support.raw_http import partial_request, request_head

pytestmark = pytest.mark.integration

REQUEST_TIMEOUT_S = 1.5
MAX_BODY_BYTES = 64 * 1024
KEY_A, KEY_B, KEY_RATE, KEY_NEW = "sk-team-a", "sk-team-b", "sk-rate", "sk-new"
RATE_LIMIT, WINDOW_S = 8, 5


def _write_keys(path: Path, *keys: str) -> None:
    path.write_text("# team keys\n" + "".join(key_hash_line(key, f"caller {i}") + "\n" for i, key in enumerate(keys)))


@pytest.fixture(scope="module")
def key_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("keys") / "team-keys.txt"
    _write_keys(path, KEY_A, KEY_B, KEY_RATE)
    return path


@pytest.fixture(scope="module")
def keyed(env: Env, key_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Plane]:
    protection = FrontendProtection(
        request_timeout_s=REQUEST_TIMEOUT_S,
        max_body_bytes=MAX_BODY_BYTES,
        api_keys=ApiKeySource(file=key_file),
        client_limits=ClientLimits(max_concurrent_requests=2, max_requests_per_window=RATE_LIMIT, window_s=WINDOW_S),
    )
    yield from _plane(env, tmp_path_factory.mktemp("keyed"), protection)


@pytest.fixture(scope="module")
def by_address(env: Env, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Plane]:
    protection = FrontendProtection(client_limits=ClientLimits(max_concurrent_requests=2))
    yield from _plane(env, tmp_path_factory.mktemp("by-address"), protection)


def _plane(env: Env, workdir: Path, protection: FrontendProtection) -> Iterator[Plane]:
    app = AppRoute(name=APP)
    routers = [env.router_a.endpoint, env.router_b.endpoint]
    plane = start_plane(env.loop, workdir, app, [env.r1.endpoint, env.r2.endpoint], routers, protection=protection)
    try:
        yield plane
    finally:
        stop_plane(plane)


def _bearer(key: str) -> dict[str, str]:
    return {AUTHORIZATION_HEADER: f"Bearer {key}"}


def _chat(client: httpx.Client, key: str | None, **params: object) -> httpx.Response:
    headers = _bearer(key) if key else {}
    return client.post(CHAT_PATH, json={"messages": [], **params}, headers=headers)


def test_a_dripped_body_gets_408_at_the_timeout_and_is_never_routed(keyed: Plane, env: Env) -> None:
    calls, errors = len(env.behavior.calls), request_errors(keyed.haproxy.settings.prometheus_port)
    head = request_head(CHAT_PATH, 100, f"Authorization: Bearer {KEY_A}")
    # One byte every 0.2 s: the connection is never idle, yet the body is not whole in time.
    response = asyncio.run(
        partial_request(
            keyed.haproxy.settings.port, head, b"{", REQUEST_TIMEOUT_S + 3, drip=b" " * 40, drip_every_s=0.2
        )
    )
    assert_frontend_error(response.status, response.headers, response.body, 408)
    assert response.headers[REQUEST_ID_HEADER]
    assert REQUEST_TIMEOUT_S - 0.1 <= response.elapsed_s <= REQUEST_TIMEOUT_S + 1
    assert len(env.behavior.calls) == calls
    assert request_errors(keyed.haproxy.settings.prometheus_port) == errors + 1


def test_a_chunked_body_over_the_maximum_gets_413(keyed: Plane, env: Env) -> None:
    calls = len(env.behavior.calls)
    chunks = (b"x" * 16384 for _ in range(MAX_BODY_BYTES // 16384 + 2))
    with httpx.Client(base_url=keyed.url, timeout=10) as client:
        response = client.post(CHAT_PATH, content=chunks, headers=_bearer(KEY_A))
        assert_refused(response, 413)
        assert response.headers[REQUEST_ID_HEADER]
        # Just under the maximum, chunked too: routed and served whole.
        body = b'{"messages": [], "pad": "' + b"x" * (MAX_BODY_BYTES - 100) + b'"}'
        served = client.post(CHAT_PATH, content=iter([body[:30000], body[30000:]]), headers=_bearer(KEY_A))
        assert served.status_code == 200 and first_event(served)["body_len"] == len(body)
    assert len(env.behavior.calls) == calls + 1


def test_keys_are_checked_before_routing_and_never_forwarded(keyed: Plane, env: Env) -> None:
    calls, refused = len(env.behavior.calls), refusal_counts(keyed.haproxy.settings.prometheus_port)
    with httpx.Client(base_url=keyed.url, timeout=10) as client:
        for headers in (
            {},
            _bearer("sk-not-a-key"),
            {AUTHORIZATION_HEADER: f"Basic {KEY_A}"},
            {AUTHORIZATION_HEADER: KEY_A},
        ):
            response = client.post(CHAT_PATH, json={"messages": []}, headers=headers)
            assert_refused(response, 401)
            assert response.headers["www-authenticate"] == "Bearer"
            assert response.headers[REQUEST_ID_HEADER]
        assert_refused(client.get("/v1/models"), 401)
        assert len(env.behavior.calls) == calls
        assert (
            refusal_counts(keyed.haproxy.settings.prometheus_port)[REASON_INVALID_API_KEY]
            - refused[REASON_INVALID_API_KEY]
            == 5
        )
        served = _chat(client, KEY_B)
        assert served.status_code == 200
        seen = dict(first_event(served)["headers"])
        assert AUTHORIZATION_HEADER not in seen
        assert client.get("/v1/models", headers=_bearer(KEY_B)).status_code == 200
    (_, route_call) = env.behavior.calls[-1]
    assert route_call.header(AUTHORIZATION_HEADER) is None


def test_a_key_file_that_cannot_be_read_keeps_the_last_good_list(keyed: Plane, key_file: Path) -> None:
    good = key_file.read_text()
    applied = keyed.key_watcher.applied
    with httpx.Client(base_url=keyed.url, timeout=10) as client:
        try:
            key_file.write_text(good + "sk-a-plain-key-by-mistake\n")
            time.sleep(1.0)  # five watcher passes
            assert keyed.key_watcher.applied == applied
            assert _chat(client, KEY_A).status_code == 200
            _write_keys(key_file, KEY_A, KEY_B, KEY_RATE, KEY_NEW)
            wait_until(5, lambda: _chat(client, KEY_NEW).status_code == 200, "the new key to be accepted", poll_s=0.05)
        finally:
            key_file.write_text(good)
        wait_until(5, lambda: _chat(client, KEY_NEW).status_code == 401, "the new key to be revoked again", poll_s=0.05)


def test_over_the_request_rate_the_client_is_told_when_to_retry(keyed: Plane) -> None:
    with httpx.Client(base_url=keyed.url, timeout=10) as client:
        statuses = [client.get("/v1/models", headers=_bearer(KEY_RATE)).status_code for _ in range(RATE_LIMIT)]
        assert statuses == [200] * RATE_LIMIT
        before = refusal_counts(keyed.haproxy.settings.prometheus_port)[REASON_CLIENT_LIMIT]
        refused = client.get("/v1/models", headers=_bearer(KEY_RATE))
        assert_refused(refused, 429)
        assert refused.headers[RETRY_AFTER_HEADER] == str(WINDOW_S)
        assert refusal_counts(keyed.haproxy.settings.prometheus_port)[REASON_CLIENT_LIMIT] == before + 1
        # Another key of the same stack is not affected.
        assert client.get("/v1/models", headers=_bearer(KEY_A)).status_code == 200


def _streams_from(url: str, source: str, count: int) -> list[int]:
    """`count` concurrent one-second streams from source address `source`; their statuses."""
    transport = httpx.HTTPTransport(local_address=source)
    with httpx.Client(base_url=url, timeout=10, transport=transport) as client:

        def one(_: int) -> int:
            response = client.post(CHAT_PATH, json={"events": 5, "delay_s": 0.2})
            response.read()
            return response.status_code

        with concurrent.futures.ThreadPoolExecutor(count) as pool:
            return list(pool.map(one, range(count)))


def test_without_keys_each_source_address_has_its_own_limit(by_address: Plane) -> None:
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        busy = pool.submit(_streams_from, by_address.url, "127.0.0.2", 4)
        other = pool.submit(_streams_from, by_address.url, "127.0.0.3", 2)
        assert sorted(busy.result()) == [200, 200, 429, 429]
        assert other.result() == [200, 200]


def test_a_broken_chunked_body_gets_haproxys_400_and_is_never_routed(keyed: Plane, env: Env) -> None:
    """The connection layer refuses it before any rule runs: HAProxy's built-in page, no reason (docs/data-plane.md)."""
    calls = len(env.behavior.calls)
    head = (
        f"POST {CHAT_PATH} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY_A}\r\n"
        "Transfer-Encoding: chunked\r\n\r\n"
    ).encode()
    response = asyncio.run(partial_request(keyed.haproxy.settings.port, head, b"zz\r\nnot hex\r\n", 5))
    # HAProxy's 400 at the broken chunk, not the request timeout's 408: it refused before waiting for more body.
    assert response.status == 400
    assert len(env.behavior.calls) == calls


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/internal/kv_index"),
        ("GET", KV_INDEX_PATH),
        ("POST", "/internal/route"),
        ("POST", "/tokenize"),
        ("GET", "/metrics"),
        ("GET", "/v1"),
    ],
)
def test_a_path_outside_the_public_api_is_404_and_reaches_no_router_or_replica(
    by_address: Plane, env: Env, method: str, path: str
) -> None:
    calls, refused = len(env.behavior.calls), refusal_counts(by_address.haproxy.settings.prometheus_port)
    with httpx.Client(base_url=by_address.url, timeout=10) as client:
        response = client.request(method, path, json={"prompt": "hi"} if method == "POST" else None)
        assert response.status_code == 404 and response.headers[SERVE_REASON_HEADER] == REASON_UNKNOWN_PATH
        assert REPLICA_HEADER not in response.headers and response.json()["error"]["code"] == 404
        assert client.get("/v1/models").status_code == 200
    assert len(env.behavior.calls) == calls
    counted = refusal_counts(by_address.haproxy.settings.prometheus_port)
    assert counted[REASON_UNKNOWN_PATH] - refused.get(REASON_UNKNOWN_PATH, 0) == 1
