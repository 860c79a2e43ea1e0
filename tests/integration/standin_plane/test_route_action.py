"""The HAProxy route action for real: HAProxy + the Lua action + the syncer, against stand-in replicas and
fault-injecting stand-in routers served by uvicorn in this process (all on 127.0.0.1): pinning, faults,
fail-open, request ids, internal headers, body forwarding, and the route call's overhead.

The stand-ins exist only for the data-plane fault tests; the end-to-end path with vLLM replicas and the real
router service is tested in ../direct_path/. The plane is started once for the module (conftest.py).
"""

from __future__ import annotations

import json
import re
import statistics
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from base.contracts import (
    APP_HEADER,
    BODY_TOTAL_UNKNOWN,
    BODY_TRUNCATED_HEADER,
    CAPACITY_TOKEN_HEADER,
    DATA_PARALLEL_RANK_HEADER,
    INTERNAL_CREDENTIAL_HEADER,
    INTERNAL_HEADER_PREFIXES,
    PREFILL_REPLICA_HEADER,
    PREFILL_URL_HEADER,
    RANKED_HEADER,
    REASON_NO_REPLICA,
    REASON_REPLICA_TIMEOUT,
    REASON_ROUTER_NON_200,
    REASON_ROUTER_UNREACHABLE,
    REASON_UNKNOWN_REPLICA_ID,
    REASON_UNPARSEABLE_REPLICA_ID,
    REPLICA_HEADER,
    REQUEST_ID_HEADER,
    ROUTE_BUDGET_HEADER,
    ROUTE_PATH,
    SERVE_FALLBACK_HEADER,
    SERVE_REASON_HEADER,
    SESSION_HEADER_DEFAULT,
    STAGING_TIMEOUT_HEADER,
)
from base.quantiles import quantile
from infra.haproxy.apps import AppRoute
from tests.integration.standin_plane.plane import Env, Plane, start_plane, stop_plane
from tests.integration.standin_plane.standins import (
    APP,
    BODY_BUFFER_BYTES,
    CHAT_PATH,
    LOOPBACK,
    OPEN_ROUTER_PREFIX,
    PLANE_CREDENTIAL,
    ROUTE_TIMEOUT_S,
    Recorded,
    assert_fail_closed,
    assert_pinned,
    first_event,
)
from tests.support.sse import data_payloads, stream_lines

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def open_plane(env: Env, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Plane]:
    """A second HAProxy for a fail-open app without body forwarding, over the same stand-ins."""
    plane = start_plane(
        env.loop,
        tmp_path_factory.mktemp("haproxy-open"),
        AppRoute(name="llm-open", fail_open=True, router_route_prefix=OPEN_ROUTER_PREFIX),
        [env.r1.endpoint, env.r2.endpoint],
        [env.router_a.endpoint, env.router_b.endpoint],
    )
    try:
        yield plane
    finally:
        stop_plane(plane)


def test_post_is_pinned_to_the_router_choice(env: Env, client: httpx.Client) -> None:
    served = Counter()
    for _ in range(60):
        response = client.post(CHAT_PATH, json={"events": 2})
        served[assert_pinned(response, env.behavior)] += 1
        assert len(data_payloads(response.text)) == 4
    assert served.keys() == {"r1", "r2"}
    # Both routers took part (round-robin over the UP ones).
    assert {name for name, _ in env.behavior.calls[-60:]} == {"router-a", "router-b"}


def test_sse_events_stream_through_haproxy(env: Env, client: httpx.Client) -> None:
    arrivals = []
    with client.stream("POST", CHAT_PATH, json={"events": 5, "delay_s": 0.2}) as response:
        assert response.status_code == 200
        start = time.perf_counter()
        for line in stream_lines(response):
            if line.startswith("data: "):
                arrivals.append(time.perf_counter() - start)
    assert len(arrivals) == 7
    # Each event arrives when the replica sends it (~0.2 s apart), not batched at the end of the stream.
    assert arrivals[0] < 0.15, arrivals
    gaps = [b - a for a, b in zip(arrivals[:5], arrivals[1:6], strict=True)]
    assert all(gap > 0.12 for gap in gaps), arrivals


def test_get_is_load_balanced_without_the_router(env: Env, client: httpx.Client) -> None:
    calls = len(env.behavior.calls)
    served = Counter()
    for _ in range(20):
        response = client.get("/v1/models")
        assert response.status_code == 200
        assert response.json()["data"][0]["owned_by"] == response.headers[REPLICA_HEADER]
        served[response.headers[REPLICA_HEADER]] += 1
    assert len(env.behavior.calls) == calls, "a GET asked the router"
    assert served.keys() == {"r1", "r2"}


@pytest.mark.parametrize(
    ("mode", "reason"),
    [
        ("http_500", REASON_ROUTER_NON_200),
        ("bad_reason", REASON_ROUTER_NON_200),
        ("no_replica", REASON_NO_REPLICA),
        ("garbage", REASON_UNPARSEABLE_REPLICA_ID),
        ("missing_id", REASON_UNPARSEABLE_REPLICA_ID),
        ("unknown", REASON_UNKNOWN_REPLICA_ID),
    ],
)
def test_router_faults_fail_closed(env: Env, client: httpx.Client, mode: str, reason: str) -> None:
    env.behavior.mode = mode
    posts = [r.posts() for r in env.replicas]
    calls = len(env.behavior.calls)
    response = client.post(CHAT_PATH, json={"events": 1})
    assert_fail_closed(response, reason)
    assert len(env.behavior.calls) == calls + 1
    assert [r.posts() for r in env.replicas] == posts, "a replica received a request the router did not place"


def test_stalled_router_fails_within_the_route_timeout(env: Env, client: httpx.Client) -> None:
    env.behavior.mode = "stall"
    posts = [r.posts() for r in env.replicas]
    start = time.monotonic()
    response = client.post(CHAT_PATH, json={"events": 1})
    elapsed = time.monotonic() - start
    assert_fail_closed(response, REASON_ROUTER_UNREACHABLE)
    assert ROUTE_TIMEOUT_S * 0.9 <= elapsed < ROUTE_TIMEOUT_S + 0.5, elapsed
    assert [r.posts() for r in env.replicas] == posts


def test_fail_open_app_load_balances_and_says_why(env: Env, open_plane: Plane) -> None:
    with httpx.Client(base_url=open_plane.url, timeout=10) as client:
        for mode, reason in (("unknown", REASON_UNKNOWN_REPLICA_ID), ("http_500", REASON_ROUTER_NON_200)):
            env.behavior.mode = mode
            response = client.post(CHAT_PATH, json={"events": 1})
            assert response.status_code == 200
            assert response.headers[SERVE_FALLBACK_HEADER] == reason
            assert response.headers[REPLICA_HEADER] in {"r1", "r2"}
            assert SERVE_REASON_HEADER not in response.headers
        env.behavior.mode = "choose"
        response = client.post(CHAT_PATH, json={"events": 1, "pad": "x" * 100})
        assert_pinned(response, env.behavior)
        assert SERVE_FALLBACK_HEADER not in response.headers
        # No body forwarding for this app: the router got an empty body.
        _, call = env.behavior.calls[-1]
        assert call.body == b"" and call.header("content-length") == "0"
        assert call.header(APP_HEADER) == "llm-open" and call.path == OPEN_ROUTER_PREFIX + ROUTE_PATH


def test_client_cannot_pin_a_replica_or_forge_internal_headers(env: Env, client: httpx.Client) -> None:
    env.behavior.replica_ids = ["r1"]
    env.behavior.capacity_token = "tok-from-router"
    forged = {
        REPLICA_HEADER: "r2",
        CAPACITY_TOKEN_HEADER.upper(): "forged-token",
        APP_HEADER: "evil",
        SERVE_REASON_HEADER: "fake",
        "X-Serve-Fallback": "fake",
        RANKED_HEADER: "1/0|1=r2",
        INTERNAL_CREDENTIAL_HEADER: "forged-credential",
    }
    for _ in range(4):
        response = client.post(CHAT_PATH, json={"events": 1}, headers=forged)
        assert assert_pinned(response, env.behavior) == "r1"
        received = Recorded("POST", CHAT_PATH, [tuple(h) for h in first_event(response)["headers"]], b"")
        assert received.header(CAPACITY_TOKEN_HEADER) == "tok-from-router"
        # The frontend's own ranked list goes along (a retry needs it), never the client's.
        assert received.header(RANKED_HEADER) == "1/0|"  # app 1 (the only one), rank 0, nothing left
        # The plane's internal credential, once, in place of the client's.
        assert [v for k, v in received.headers if k == INTERNAL_CREDENTIAL_HEADER] == [PLANE_CREDENTIAL]
        kept = (CAPACITY_TOKEN_HEADER, RANKED_HEADER, INTERNAL_CREDENTIAL_HEADER)
        leaked = [k for k, _ in received.headers if k.startswith(INTERNAL_HEADER_PREFIXES) and k not in kept]
        assert not leaked
        _, call = env.behavior.calls[-1]
        assert call.header(INTERNAL_CREDENTIAL_HEADER) == PLANE_CREDENTIAL  # the route call carries it too
        assert call.header(APP_HEADER) == APP
        assert call.header(CAPACITY_TOKEN_HEADER) is None and call.header(REPLICA_HEADER) is None
    # Without a token from the router, the replica gets none at all (the client's is gone too).
    env.behavior.capacity_token = None
    response = client.post(CHAT_PATH, json={"events": 1}, headers=forged)
    received = Recorded("POST", CHAT_PATH, [tuple(h) for h in first_event(response)["headers"]], b"")
    assert received.header(CAPACITY_TOKEN_HEADER) is None


def test_the_router_prefill_choice_reaches_the_pinned_replica_and_only_it(env: Env, client: httpx.Client) -> None:
    env.behavior.replica_ids = ["r1"]
    forged = {PREFILL_REPLICA_HEADER: "evil", PREFILL_URL_HEADER: "http://10.0.0.1:80"}
    try:
        env.behavior.prefill = ("p7", "http://127.0.0.1:30007/tiny-prefill")
        response = client.post(CHAT_PATH, json={"events": 1}, headers=forged)
        assert assert_pinned(response, env.behavior) == "r1"
        received = Recorded("POST", CHAT_PATH, [tuple(h) for h in first_event(response)["headers"]], b"")
        assert received.header(PREFILL_REPLICA_HEADER) == "p7"
        assert received.header(PREFILL_URL_HEADER) == "http://127.0.0.1:30007/tiny-prefill"
        # A router that names no prefill replica: the client's forged choice is gone too.
        env.behavior.prefill = None
        response = client.post(CHAT_PATH, json={"events": 1}, headers=forged)
        received = Recorded("POST", CHAT_PATH, [tuple(h) for h in first_event(response)["headers"]], b"")
        assert received.header(PREFILL_REPLICA_HEADER) is None and received.header(PREFILL_URL_HEADER) is None
        # A prefill URL that is not one (anything could follow into a header) fails closed.
        for bad in (("p7", "file:///etc/passwd"), ("p 7", "http://127.0.0.1:1"), ("p7", "http://h:1\r\nx: y")):
            env.behavior.prefill = bad
            assert_fail_closed(client.post(CHAT_PATH, json={"events": 1}), REASON_UNPARSEABLE_REPLICA_ID)
    finally:
        env.behavior.prefill = None


def test_an_engine_rank_the_router_chose_reaches_its_replica_as_vllms_header(env: Env, client: httpx.Client) -> None:
    try:
        env.behavior.ranked = ["r2:1", "r1:0"]
        response = client.post(CHAT_PATH, json={"events": 1}, headers={DATA_PARALLEL_RANK_HEADER: "7"})
        assert response.status_code == 200 and response.headers[REPLICA_HEADER] == "r2"
        received = Recorded("POST", CHAT_PATH, [tuple(h) for h in first_event(response)["headers"]], b"")
        assert received.header(DATA_PARALLEL_RANK_HEADER) == "1"
        # A plain replica id: no rank goes along, not even the client's.
        env.behavior.ranked = ["r1"]
        response = client.post(CHAT_PATH, json={"events": 1}, headers={DATA_PARALLEL_RANK_HEADER: "7"})
        received = Recorded("POST", CHAT_PATH, [tuple(h) for h in first_event(response)["headers"]], b"")
        assert response.headers[REPLICA_HEADER] == "r1" and received.header(DATA_PARALLEL_RANK_HEADER) is None
    finally:
        env.behavior.ranked = None


UUID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")


def test_the_route_call_says_how_long_haproxy_still_waits_for_it(env: Env, client: httpx.Client) -> None:
    client.post(CHAT_PATH, json={"events": 1})
    _, call = env.behavior.calls[-1]
    assert 0 < int(call.header(ROUTE_BUDGET_HEADER)) <= ROUTE_TIMEOUT_S * 1000, call.headers
    # A client's own value never reaches the router.
    client.post(CHAT_PATH, json={"events": 1}, headers={ROUTE_BUDGET_HEADER: "999999"})
    _, call = env.behavior.calls[-1]
    assert int(call.header(ROUTE_BUDGET_HEADER)) <= ROUTE_TIMEOUT_S * 1000, call.headers


def test_request_id_generated_forwarded_and_echoed(env: Env, client: httpx.Client) -> None:
    response = client.post(CHAT_PATH, json={"events": 1})
    request_id = response.headers[REQUEST_ID_HEADER]
    assert UUID.match(request_id)
    _, call = env.behavior.calls[-1]
    assert call.header(REQUEST_ID_HEADER) == request_id
    assert dict(map(tuple, first_event(response)["headers"]))[REQUEST_ID_HEADER] == request_id
    # A client's id is kept end to end.
    response = client.post(CHAT_PATH, json={"events": 1}, headers={"X-Request-Id": "client-id-42"})
    assert response.headers[REQUEST_ID_HEADER] == "client-id-42"
    assert env.behavior.calls[-1][1].header(REQUEST_ID_HEADER) == "client-id-42"
    assert dict(map(tuple, first_event(response)["headers"]))[REQUEST_ID_HEADER] == "client-id-42"
    assert client.get("/v1/models", headers={"x-request-id": "get-7"}).headers[REQUEST_ID_HEADER] == "get-7"
    # HAProxy's own 503 carries it too, given or generated.
    env.behavior.mode = "unknown"
    response = client.post(CHAT_PATH, json={}, headers={"x-request-id": "client-id-43"})
    assert response.status_code == 503 and response.headers[REQUEST_ID_HEADER] == "client-id-43"
    response = client.post(CHAT_PATH, json={})
    assert response.status_code == 503 and UUID.match(response.headers[REQUEST_ID_HEADER])
    assert env.behavior.calls[-1][1].header(REQUEST_ID_HEADER) == response.headers[REQUEST_ID_HEADER]


def _routed_call(env: Env, client: httpx.Client, content: Any, headers: dict[str, str]) -> tuple[Any, httpx.Response]:
    """POST `content` as a chat request; the route call it made (the response is pinned to the chosen replica)."""
    response = client.post(CHAT_PATH, content=content, headers=headers)
    assert_pinned(response, env.behavior)
    _, call = env.behavior.calls[-1]
    return call, response


def test_body_forwarding_and_truncation(env: Env, client: httpx.Client) -> None:
    session = {SESSION_HEADER_DEFAULT: "session-9"}
    small = json.dumps({"events": 1, "pad": "x" * 100}).encode()
    call, _ = _routed_call(env, client, small, {"content-type": "application/json", **session})
    assert call.method == "POST" and call.path == ROUTE_PATH
    assert call.header("host") == f"{LOOPBACK}:{env.router_a.port}" or call.header("host") == (
        f"{LOOPBACK}:{env.router_b.port}"
    )
    assert call.body == small and call.header(BODY_TRUNCATED_HEADER) is None
    assert call.header(SESSION_HEADER_DEFAULT) == "session-9" and call.header("content-type") == "application/json"
    # Larger than the whole request buffer: routed on the head of the body, forwarded in full to the replica.
    big = json.dumps({"events": 1, "pad": "y" * 100_000}).encode()
    call, response = _routed_call(env, client, big, session)
    assert call.header(BODY_TRUNCATED_HEADER) == f"{BODY_BUFFER_BYTES}/{len(big)}"
    assert call.body == big[:BODY_BUFFER_BYTES]
    assert first_event(response)["body_len"] == len(big)
    # The same body chunked (no Content-Length): cut alike, its total unknown to the router.
    call, response = _routed_call(env, client, iter([big[:50_000], big[50_000:]]), session)
    assert call.header(BODY_TRUNCATED_HEADER) == f"{BODY_BUFFER_BYTES}/{BODY_TOTAL_UNKNOWN}"
    assert call.body == big[:BODY_BUFFER_BYTES]
    assert first_event(response)["body_len"] == len(big)
    # A chunked body within the buffer reaches the router whole, uncut.
    call, _ = _routed_call(env, client, iter([small[:50], small[50:]]), session)
    assert call.body == small and call.header(BODY_TRUNCATED_HEADER) is None


def test_a_staging_request_that_asks_for_it_times_out_with_a_504(env: Env, client: httpx.Client) -> None:
    """The staging frontend's short server timeout (`sluice check`'s timeout cleanup): only for a request that asks."""
    slow = {"events": 1, "headers_delay_s": 2.0}
    response = client.post(CHAT_PATH, json=slow, headers={STAGING_TIMEOUT_HEADER: "1"})
    assert response.status_code == 504 and response.headers[SERVE_REASON_HEADER] == REASON_REPLICA_TIMEOUT
    assert response.json()["error"]["code"] == 504
    response = client.post(CHAT_PATH, json=slow)
    assert_pinned(response, env.behavior)


def test_route_call_overhead(env: Env, capsys: pytest.CaptureFixture[str]) -> None:
    """Latency of a small POST through HAProxy + Lua + a stub router, against the same POST sent directly to
    the replica and a GET through HAProxy alone (no route call). Reported, with a loose bound."""
    env.behavior.replica_ids = ["r1"]
    n = 500

    def timed(client: httpx.Client, method: str, path: str) -> list[float]:
        samples = []
        for i in range(n + 50):
            start = time.perf_counter()
            response = client.request(method, path, json={"events": 0} if method == "POST" else None)
            elapsed = time.perf_counter() - start
            assert response.status_code == 200
            if i >= 50:
                samples.append(elapsed * 1000)
        return samples

    with httpx.Client(base_url=env.r1.url) as direct, httpx.Client(base_url=env.plane.url) as proxied:
        results = {
            "direct POST": timed(direct, "POST", CHAT_PATH),
            "HAProxy GET (no route)": timed(proxied, "GET", "/v1/models"),
            "direct GET": timed(direct, "GET", "/v1/models"),
            "HAProxy+Lua+router POST": timed(proxied, "POST", CHAT_PATH),
        }
    with capsys.disabled():
        print(f"\nroute-call overhead over {n} sequential requests (ms):")
        for name, samples in results.items():
            print(f"  {name:26s} p50 {quantile(samples, 0.5):6.2f}  p99 {quantile(samples, 0.99):6.2f}")
        overhead = statistics.median(results["HAProxy+Lua+router POST"]) - statistics.median(results["direct POST"])
        print(f"  p50 overhead of the routed path: {overhead:.2f} ms")
    assert overhead < 20, overhead


def _minor_page_faults(pid: int) -> int:
    """Minor page faults of process `pid` so far (/proc/<pid>/stat, field 10)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[7])


def test_the_worker_reuses_its_request_buffers_instead_of_mapping_them_per_request(
    env: Env, client: httpx.Client
) -> None:
    """HAProxy's buffers are megabytes (`tune.bufsize`): with glibc's default settings each request maps fresh ones
    and faults their pages in (about 9 faults per request); with `MALLOC_TUNABLES` they are reused."""
    worker, requests = env.plane.haproxy.worker_pid, 300
    assert worker is not None
    for _ in range(50):
        assert client.post(CHAT_PATH, json={"events": 0}).status_code == 200
    before = _minor_page_faults(worker)
    for _ in range(requests):
        assert client.post(CHAT_PATH, json={"events": 0}).status_code == 200
    assert (_minor_page_faults(worker) - before) / requests < 1
