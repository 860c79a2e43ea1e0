"""The HAProxy data plane for real: HAProxy + the Lua route action + the syncer, against stand-in replicas and
fault-injecting stand-in routers served by uvicorn in this process (all on 127.0.0.1).

The stand-ins exist only for the data-plane fault tests; the end-to-end path with vLLM replicas and the real
router service is tested elsewhere. Everything is started once for the module and stopped at its end.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import statistics
import time
from collections import Counter
from collections.abc import Iterator

import httpx
import pytest

from infra.haproxy_config import REPLICA_BACKEND, ROUTER_BACKEND, AppRoute
from sluice.contracts import (
    APP_HEADER,
    BODY_TRUNCATED_HEADER,
    CAPACITY_TOKEN_HEADER,
    INTERNAL_HEADER_PREFIXES,
    REASON_NO_REPLICA,
    REASON_ROUTER_NON_200,
    REASON_ROUTER_UNREACHABLE,
    REASON_UNKNOWN_REPLICA_ID,
    REASON_UNPARSEABLE_REPLICA_ID,
    REPLICA_HEADER,
    REQUEST_ID_HEADER,
    ROUTE_PATH,
    SERVE_FALLBACK_HEADER,
    SERVE_REASON_HEADER,
    SESSION_HEADER_DEFAULT,
)
from tests.integration.dataplane_standins import (
    APP,
    BODY_BUFFER_BYTES,
    CHAT_PATH,
    LOOPBACK,
    OPEN_ROUTER_PREFIX,
    ROUTE_TIMEOUT_S,
    Env,
    LoopThread,
    Plane,
    Recorded,
    ReplicaStandIn,
    RouterBehavior,
    RouterStandIn,
    StandIn,
    _make_event,
    _reset_event,
    assert_fail_closed,
    assert_pinned,
    data_payloads,
    first_event,
    percentile,
    start_plane,
    stop_plane,
    stream_one,
    wait_until,
)

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    loop = LoopThread()
    behavior = RouterBehavior(replica_ids=["r1", "r2"])
    behavior.release = loop.run(_make_event())
    r1, r2 = ReplicaStandIn("r1"), ReplicaStandIn("r2")
    router_a, router_b = RouterStandIn("router-a", behavior), RouterStandIn("router-b", behavior)
    started: list[StandIn] = []
    plane = None
    try:
        for stand_in in (r1, r2, router_a, router_b):
            loop.run(stand_in.start())
            started.append(stand_in)
        app = AppRoute(name=APP, forward_body=True, body_buffer_bytes=BODY_BUFFER_BYTES)
        plane = start_plane(
            loop,
            tmp_path_factory.mktemp("haproxy"),
            app,
            [r1.endpoint, r2.endpoint],
            [router_a.endpoint, router_b.endpoint],
        )
        yield Env(loop, behavior, r1, r2, router_a, router_b, plane)
    finally:
        loop.loop.call_soon_threadsafe(behavior.release.set)
        if plane is not None:
            stop_plane(plane)
        for stand_in in started:
            loop.run(stand_in.stop())
        loop.close()


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


@pytest.fixture(autouse=True)
def reset_behavior(env: Env) -> Iterator[None]:
    env.behavior.mode = "choose"
    env.behavior.replica_ids = ["r1", "r2"]
    env.behavior.capacity_token = None
    yield
    env.loop.loop.call_soon_threadsafe(env.behavior.release.set)
    env.loop.run(_reset_event(env.behavior))


@pytest.fixture
def client(env: Env) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=env.plane.url, timeout=10) as c:
        yield c


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
        for line in response.iter_lines():
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


def test_no_router_in_the_pool(env: Env, client: httpx.Client) -> None:
    plane = env.plane
    saved = list(plane.routers)
    plane.routers.clear()
    try:
        wait_until(lambda: not plane.syncer.routers.active and not plane.syncer.routers.draining(), what="no router")
        start = time.monotonic()
        response = client.post(CHAT_PATH, json={"events": 1})
        assert_fail_closed(response, REASON_ROUTER_UNREACHABLE)
        assert time.monotonic() - start < 0.2
        assert client.get("/v1/models").status_code == 200, "GETs do not need a router"
    finally:
        plane.routers[:] = saved
        plane.wait_synced()
    assert_pinned(client.post(CHAT_PATH, json={}), env.behavior)


def test_replica_that_fails_its_health_check_is_not_pinned(env: Env, client: httpx.Client) -> None:
    plane, r2 = env.plane, env.r2
    slot = plane.syncer.replicas.slot_of("r2")
    assert slot is not None
    r2.healthy = False
    try:
        wait_until(lambda: plane.status(plane.syncer.replicas, slot).startswith("DOWN"), what="r2 DOWN")
        env.behavior.replica_ids = ["r2"]
        posts = r2.posts()
        assert_fail_closed(client.post(CHAT_PATH, json={}), REASON_UNKNOWN_REPLICA_ID)
        assert {client.get("/v1/models").headers[REPLICA_HEADER] for _ in range(6)} == {"r1"}
        assert r2.posts() == posts
    finally:
        r2.healthy = True
        plane.wait_synced()
    assert assert_pinned(client.post(CHAT_PATH, json={}), env.behavior) == "r2"


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


def test_killed_router_does_not_fail_requests(env: Env, client: httpx.Client) -> None:
    plane, killed = env.plane, env.router_b
    slot = plane.syncer.routers.slot_of(killed.name)
    assert slot is not None
    failures = []
    try:
        for i in range(60):
            if i == 10:
                env.loop.run(killed.stop())
            response = client.post(CHAT_PATH, json={"events": 1})
            if response.status_code != 200:
                failures.append((i, response.status_code, response.headers.get(SERVE_REASON_HEADER)))
            else:
                assert_pinned(response, env.behavior)
        assert not failures
        # HAProxy's health check takes the dead router out; requests never waited on it.
        wait_until(lambda: plane.status(plane.syncer.routers, slot).startswith("DOWN"), what="router DOWN")
        calls = len(env.behavior.calls)
        for _ in range(10):
            assert_pinned(client.post(CHAT_PATH, json={}), env.behavior)
        assert {name for name, _ in env.behavior.calls[calls:]} == {"router-a"}
    finally:
        env.loop.run(killed.start())  # same port again
        plane.wait_synced()


def test_client_cannot_pin_a_replica_or_forge_internal_headers(env: Env, client: httpx.Client) -> None:
    env.behavior.replica_ids = ["r1"]
    env.behavior.capacity_token = "tok-from-router"
    forged = {
        REPLICA_HEADER: "r2",
        CAPACITY_TOKEN_HEADER.upper(): "forged-token",
        APP_HEADER: "evil",
        SERVE_REASON_HEADER: "fake",
        "X-Serve-Fallback": "fake",
    }
    for _ in range(4):
        response = client.post(CHAT_PATH, json={"events": 1}, headers=forged)
        assert assert_pinned(response, env.behavior) == "r1"
        received = Recorded("POST", CHAT_PATH, [tuple(h) for h in first_event(response)["headers"]], b"")
        assert received.header(CAPACITY_TOKEN_HEADER) == "tok-from-router"
        leaked = [
            k for k, _ in received.headers if k.startswith(INTERNAL_HEADER_PREFIXES) and k != CAPACITY_TOKEN_HEADER
        ]
        assert not leaked
        _, call = env.behavior.calls[-1]
        assert call.header(APP_HEADER) == APP
        assert call.header(CAPACITY_TOKEN_HEADER) is None and call.header(REPLICA_HEADER) is None
    # Without a token from the router, the replica gets none at all (the client's is gone too).
    env.behavior.capacity_token = None
    response = client.post(CHAT_PATH, json={"events": 1}, headers=forged)
    received = Recorded("POST", CHAT_PATH, [tuple(h) for h in first_event(response)["headers"]], b"")
    assert received.header(CAPACITY_TOKEN_HEADER) is None


UUID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")


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


def test_body_forwarding_and_truncation(env: Env, client: httpx.Client) -> None:
    session = {SESSION_HEADER_DEFAULT: "session-9"}
    small = json.dumps({"events": 1, "pad": "x" * 100}).encode()
    response = client.post(CHAT_PATH, content=small, headers={"content-type": "application/json", **session})
    assert_pinned(response, env.behavior)
    _, call = env.behavior.calls[-1]
    assert call.method == "POST" and call.path == ROUTE_PATH
    assert call.header("host") == f"{LOOPBACK}:{env.router_a.port}" or call.header("host") == (
        f"{LOOPBACK}:{env.router_b.port}"
    )
    assert call.body == small and call.header(BODY_TRUNCATED_HEADER) is None
    assert call.header(SESSION_HEADER_DEFAULT) == "session-9" and call.header("content-type") == "application/json"
    # Larger than the whole request buffer: routed on the head of the body, forwarded in full to the replica.
    big = json.dumps({"events": 1, "pad": "y" * 100_000}).encode()
    response = client.post(CHAT_PATH, content=big, headers=session)
    assert_pinned(response, env.behavior)
    _, call = env.behavior.calls[-1]
    assert call.header(BODY_TRUNCATED_HEADER) == f"{BODY_BUFFER_BYTES}/{len(big)}"
    assert call.body == big[:BODY_BUFFER_BYTES]
    assert first_event(response)["body_len"] == len(big)


def test_syncer_adds_and_drains_replicas_under_streams_without_reload(env: Env) -> None:
    plane, r1 = env.plane, env.r1
    runtime, pool = plane.runtime, plane.syncer.replicas
    info_before = runtime.show_info()
    master_pid = plane.haproxy.pid
    started = time.monotonic()
    r3 = ReplicaStandIn("r3")
    env.loop.run(r3.start())
    try:
        r1_slot = pool.slot_of("r1")
        assert r1_slot is not None
        events = 25
        with concurrent.futures.ThreadPoolExecutor(6) as streams:
            posts = r1.posts() + env.r2.posts()
            futures = [streams.submit(stream_one, plane.url, {"events": events, "delay_s": 0.08}) for _ in range(6)]
            wait_until(lambda: r1.posts() + env.r2.posts() == posts + 6, what="every stream started")
            assert runtime.show_stat()[(REPLICA_BACKEND, r1_slot)].scur >= 2
            # r1 leaves and r3 arrives while the streams run.
            r1_posts = r1.posts()
            plane.replicas[:] = [env.r2.endpoint, r3.endpoint]
            wait_until(lambda: pool.slot_of("r3") is not None, what="r3 slot")
            wait_until(lambda: r1_slot in pool.draining(), what="r1 draining")
            assert pool.slot_of("r3") != r1_slot
            assert "r1" not in runtime.show_map(plane.haproxy.settings.map_path)
            stat = runtime.show_stat()[(REPLICA_BACKEND, r1_slot)]
            assert stat.status.startswith("DRAIN") and stat.scur >= 2, stat
            plane.wait_synced()
            env.behavior.replica_ids = ["r2", "r3"]
            results = [f.result(timeout=30) for f in futures]
        for _headers, payloads in results:
            assert len(payloads) == events + 2 and payloads[-1] == "[DONE]", "a stream was cut"
            assert [json.loads(p)["i"] for p in payloads[1:-1]] == list(range(events))
        assert "r1" in {headers[REPLICA_HEADER] for headers, _ in results}
        # Streams done: r1's slot leaves DRAIN for maintenance and is free again.
        wait_until(lambda: pool.slots[r1_slot].free, what="r1 slot freed")
        assert plane.status(pool, r1_slot) == "MAINT"
        # The new replica takes traffic; the removed one gets nothing new.
        with httpx.Client(base_url=plane.url, timeout=10) as client:
            served = Counter(assert_pinned(client.post(CHAT_PATH, json={}), env.behavior) for _ in range(20))
        assert served.keys() == {"r2", "r3"}
        assert r1.posts() == r1_posts
        # Same HAProxy all along: no reload (a new worker) and no restart.
        info_after = runtime.show_info()
        assert info_after["Pid"] == info_before["Pid"] and info_after["Process_num"] == info_before["Process_num"]
        assert int(info_after["Uptime_sec"]) >= int(info_before["Uptime_sec"]) + int(time.monotonic() - started) - 1
        assert plane.haproxy.pid == master_pid and plane.haproxy.process.poll() is None
        assert plane.haproxy.settings.log_path.read_text().count("Loading success") == 1
    finally:
        env.behavior.replica_ids = ["r1", "r2"]
        plane.replicas[:] = [env.r1.endpoint, env.r2.endpoint]
        plane.wait_synced()
        env.loop.run(r3.stop())


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
            print(f"  {name:26s} p50 {statistics.median(samples):6.2f}  p99 {percentile(samples, 0.99):6.2f}")
        overhead = statistics.median(results["HAProxy+Lua+router POST"]) - statistics.median(results["direct POST"])
        print(f"  p50 overhead of the routed path: {overhead:.2f} ms")
    assert overhead < 20, overhead


def test_runtime_api_reports_clear_errors(env: Env) -> None:
    from infra.runtime_api import RuntimeAPIError

    runtime = env.plane.runtime
    with pytest.raises(RuntimeAPIError, match="No such"):
        runtime.set_server_state(REPLICA_BACKEND, "replica99", "ready")
    with pytest.raises(RuntimeAPIError):
        runtime.set_server_addr(ROUTER_BACKEND, "nope", LOOPBACK, 1)
    with pytest.raises(RuntimeAPIError, match="Unknown map"):
        runtime.add_map("/nonexistent.map", "a", "b")
    info = runtime.show_info()
    assert int(info["Pid"]) == env.plane.haproxy.worker_pid and os.getpid() != int(info["Pid"])
    metrics = httpx.get(f"http://{LOOPBACK}:{env.plane.haproxy.settings.prometheus_port}/metrics", timeout=5)
    assert metrics.status_code == 200 and "haproxy_process_" in metrics.text
