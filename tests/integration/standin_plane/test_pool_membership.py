"""HAProxy's server pools follow their sources, for real: the syncer adds, retires and deletes servers through
the runtime API without a reload, and the route action copes with an empty, dead or unhealthy pool. Against
stand-in replicas and routers (conftest.py); the plane is started once for the module.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import time
from collections import Counter

import httpx
import pytest

from base.contracts import (
    REASON_REPLICA_UNAVAILABLE,
    REASON_ROUTER_UNREACHABLE,
    REPLICA_HEADER,
    SERVE_REASON_HEADER,
)
from base.waiting import wait_until
from infra.haproxy.config import REPLICA_BACKEND, ROUTER_BACKEND
from tests.integration.standin_plane.plane import Env
from tests.integration.standin_plane.standins import (
    CHAT_PATH,
    LOOPBACK,
    ReplicaStandIn,
    assert_fail_closed,
    assert_pinned,
    stream_one,
)

pytestmark = pytest.mark.integration


def test_no_router_in_the_pool(env: Env, client: httpx.Client) -> None:
    plane = env.plane
    saved = list(plane.routers)
    plane.routers.clear()
    try:
        wait_until(5.0, lambda: not plane.syncer.apps[0].routers.members, "no router", poll_s=0.05)
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
    r2.healthy = False
    try:
        wait_until(
            5.0, lambda: plane.status(plane.syncer.apps[0].replicas, "r2").startswith("DOWN"), "r2 DOWN", poll_s=0.05
        )
        # The syncer stops publishing r2 to the routers.
        wait_until(5.0, lambda: plane.published(env.behavior) == ["r1"], "r2 unpublished", poll_s=0.05)
        env.behavior.replica_ids = ["r2"]
        posts = r2.posts()
        assert_fail_closed(client.post(CHAT_PATH, json={}), REASON_REPLICA_UNAVAILABLE)
        assert {client.get("/v1/models").headers[REPLICA_HEADER] for _ in range(6)} == {"r1"}
        assert r2.posts() == posts
    finally:
        r2.healthy = True
        plane.wait_synced()
    assert assert_pinned(client.post(CHAT_PATH, json={}), env.behavior) == "r2"


def test_killed_router_does_not_fail_requests(env: Env, client: httpx.Client) -> None:
    plane, killed = env.plane, env.router_b
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
        wait_until(
            5.0,
            lambda: plane.status(plane.syncer.apps[0].routers, killed.name).startswith("DOWN"),
            "router DOWN",
            poll_s=0.05,
        )
        calls = len(env.behavior.calls)
        for _ in range(10):
            assert_pinned(client.post(CHAT_PATH, json={}), env.behavior)
        assert {name for name, _ in env.behavior.calls[calls:]} == {"router-a"}
    finally:
        env.loop.run(killed.start())  # same port again
        plane.wait_synced()


def test_syncer_adds_and_retires_replicas_under_streams_without_reload(env: Env) -> None:
    plane, r1 = env.plane, env.r1
    runtime, pool = plane.runtime, plane.syncer.apps[0].replicas
    info_before = runtime.show_info()
    master_pid = plane.haproxy.pid
    started = time.monotonic()
    r3 = ReplicaStandIn("r3")
    env.loop.run(r3.start())
    try:
        events = 25
        with concurrent.futures.ThreadPoolExecutor(6) as streams:
            posts = r1.posts() + env.r2.posts()
            futures = [streams.submit(stream_one, plane.url, {"events": events, "delay_s": 0.08}) for _ in range(6)]
            wait_until(5.0, lambda: r1.posts() + env.r2.posts() == posts + 6, "every stream started", poll_s=0.05)
            assert runtime.show_stat()[(REPLICA_BACKEND, "r1")].scur >= 2
            # r1 leaves and r3 arrives while the streams run.
            r1_posts = r1.posts()
            plane.replicas[:] = [env.r2.endpoint, r3.endpoint]
            wait_until(5.0, lambda: "r3" in pool.live, "r3 added", poll_s=0.05)
            wait_until(5.0, lambda: "r1" in pool.leaving(), "r1 leaving", poll_s=0.05)
            # In maintenance: nothing new is pinned to it, its streams go on.
            stat = runtime.show_stat()[(REPLICA_BACKEND, "r1")]
            assert stat.status.startswith("MAINT") and stat.scur >= 2, stat
            wait_until(5.0, lambda: plane.published(env.behavior) == ["r2", "r3"], "r3 UP, r1 gone", poll_s=0.05)
            env.behavior.replica_ids = ["r2", "r3"]
            results = [f.result(timeout=30) for f in futures]
        for _headers, payloads in results:
            assert len(payloads) == events + 2 and payloads[-1] == "[DONE]", "a stream was cut"
            assert [json.loads(p)["i"] for p in payloads[1:-1]] == list(range(events))
        assert "r1" in {headers[REPLICA_HEADER] for headers, _ in results}
        # Streams done: r1's server is deleted.
        wait_until(5.0, lambda: "r1" not in pool.members, "r1 deleted", poll_s=0.05)
        assert (REPLICA_BACKEND, "r1") not in runtime.show_stat()
        # The new replica takes traffic; the removed one gets nothing new, even when a router still names it.
        with httpx.Client(base_url=plane.url, timeout=10) as client:
            served = Counter(assert_pinned(client.post(CHAT_PATH, json={}), env.behavior) for _ in range(20))
            env.behavior.ranked = ["r1", "r3"]
            late = client.post(CHAT_PATH, json={})
        assert served.keys() == {"r2", "r3"}
        assert late.status_code == 200 and late.headers[REPLICA_HEADER] == "r3", late.headers
        assert r1.posts() == r1_posts
        # Same HAProxy all along: no reload (a new worker) and no restart.
        info_after = runtime.show_info()
        assert info_after["Pid"] == info_before["Pid"] and info_after["Process_num"] == info_before["Process_num"]
        assert int(info_after["Uptime_sec"]) >= int(info_before["Uptime_sec"]) + int(time.monotonic() - started) - 1
        assert plane.haproxy.pid == master_pid and plane.haproxy.process.poll() is None
        assert plane.haproxy.settings.log_path.read_text().count("Loading success") == 1
    finally:
        env.behavior.replica_ids = ["r1", "r2"]
        env.behavior.ranked = None
        plane.replicas[:] = [env.r1.endpoint, env.r2.endpoint]
        plane.wait_synced()
        env.loop.run(r3.stop())


def test_runtime_api_reports_clear_errors(env: Env) -> None:
    from infra.haproxy.runtime_api import RuntimeAPIError

    runtime = env.plane.runtime
    with pytest.raises(RuntimeAPIError, match="No such"):
        runtime.set_server_state(REPLICA_BACKEND, "replica99", "ready")
    with pytest.raises(RuntimeAPIError):
        runtime.set_server_addr(ROUTER_BACKEND, "nope", LOOPBACK, 1)
    with pytest.raises(RuntimeAPIError, match="No such"):
        runtime.del_server(REPLICA_BACKEND, "no-such-replica")
    info = runtime.show_info()
    assert int(info["Pid"]) == env.plane.haproxy.worker_pid and os.getpid() != int(info["Pid"])
    metrics = httpx.get(f"http://{LOOPBACK}:{env.plane.haproxy.settings.prometheus_port}/metrics", timeout=5)
    assert metrics.status_code == 200 and "haproxy_process_" in metrics.text
