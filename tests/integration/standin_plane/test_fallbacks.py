"""The router's ranked list, for real: HAProxy pins a request to the first ranked replica it can route to, hands a
refused connection to the next one at once, never to a replica the router did not rank, and every 5xx it makes
itself says why. Against stand-in replicas and fault-injecting stand-in routers (conftest.py); the many-replica
test runs its own plane of lightweight stand-ins.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from base.contracts import (
    FALLBACK_ABSENT,
    FALLBACK_DOWN,
    FALLBACK_RANK_HEADER,
    FALLBACK_REFUSED,
    REASON_REPLICA_ERROR,
    REASON_REPLICA_FAILED,
    REASON_REPLICA_UNAVAILABLE,
    REASON_UNKNOWN_REPLICA_ID,
    REPLICA_HEADER,
    SERVE_REASON_HEADER,
)
from base.waiting import wait_until
from infra.haproxy.apps import AppRoute
from infra.haproxy.config import REPLICA_BACKEND
from tests.integration.standin_plane.plane import Env, Plane, fallback_counts, start_plane, stop_plane
from tests.integration.standin_plane.standins import CHAT_PATH, TinyReplica, assert_fail_closed, first_event
from tests.support.frontend_contract import check_frontend_response, checked

pytestmark = pytest.mark.integration

# What "served at once" allows: a health check (10 s on the quiet plane) or a connect timeout takes seconds.
FALLBACK_AT_ONCE_S = 1.0


def served(response: httpx.Response) -> tuple[str, str | None]:
    assert response.status_code == 200, (response.status_code, response.headers, response.text[:300])
    assert first_event(response)["replica"] == response.headers[REPLICA_HEADER]
    return response.headers[REPLICA_HEADER], response.headers.get(FALLBACK_RANK_HEADER)


def test_an_absent_primary_is_passed_over_for_the_first_ranked_fallback(env: Env, client: httpx.Client) -> None:
    before = fallback_counts(env.plane)
    env.behavior.ranked = ["ghost", "r2", "r1"]
    assert served(client.post(CHAT_PATH, json={})) == ("r2", "1")
    env.behavior.ranked = ["ghost", "ghost-2", "r1"]
    assert served(client.post(CHAT_PATH, json={})) == ("r1", "2")
    # A primary the frontend can route to is served as such: no rank header.
    env.behavior.ranked = ["r1", "r2"]
    assert served(client.post(CHAT_PATH, json={})) == ("r1", None)
    after = fallback_counts(env.plane)
    assert after[FALLBACK_ABSENT] == before[FALLBACK_ABSENT] + 2
    assert after[FALLBACK_DOWN] == before[FALLBACK_DOWN] and after[FALLBACK_REFUSED] == before[FALLBACK_REFUSED]


def test_no_usable_ranked_replica_fails_closed_with_the_primarys_reason(env: Env, client: httpx.Client) -> None:
    posts = [r.posts() for r in env.replicas]
    env.behavior.ranked = ["ghost"]
    assert_fail_closed(client.post(CHAT_PATH, json={}), REASON_UNKNOWN_REPLICA_ID)
    env.behavior.ranked = ["ghost", "ghost-2", "ghost-3"]
    assert_fail_closed(client.post(CHAT_PATH, json={}), REASON_UNKNOWN_REPLICA_ID)
    env.r2.healthy = False
    try:
        wait_until(
            5.0,
            lambda: env.plane.status(env.plane.syncer.apps[0].replicas, "r2").startswith("DOWN"),
            "r2 DOWN",
            poll_s=0.05,
        )
        env.behavior.ranked = ["r2", "ghost"]
        assert_fail_closed(client.post(CHAT_PATH, json={}), REASON_REPLICA_UNAVAILABLE)
        # A DOWN primary with a usable fallback: the fallback serves, counted as `down`.
        before = fallback_counts(env.plane)[FALLBACK_DOWN]
        env.behavior.ranked = ["r2", "r1"]
        assert served(client.post(CHAT_PATH, json={})) == ("r1", "1")
        assert fallback_counts(env.plane)[FALLBACK_DOWN] == before + 1
    finally:
        env.r2.healthy = True
        env.plane.wait_synced()
    # Not one of these reached a replica that was not ranked, nor the unusable primary.
    assert env.r2.posts() == posts[1]
    assert env.r1.posts() == posts[0] + 1


@contextmanager
def tiny_plane(
    env: Env, workdir: Path, name: str, count: int, check_inter_s: float
) -> Iterator[tuple[Plane, list[TinyReplica]]]:
    """`count` lightweight replicas behind a plane of their own (router: the env's stand-in router a)."""
    replicas = [TinyReplica(f"{name}-{i:03d}") for i in range(count)]
    plane = None
    try:
        for replica in replicas:
            env.loop.run(replica.start())
        endpoints = [r.endpoint for r in replicas]
        plane = start_plane(
            env.loop, workdir, AppRoute(name=name), endpoints, [env.router_a.endpoint], check_inter_s, 30.0
        )
        yield plane, replicas
    finally:
        if plane is not None:
            stop_plane(plane)
        for replica in replicas:
            env.loop.run(replica.stop())


@pytest.fixture
def quiet_plane(env: Env, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Plane, list[TinyReplica]]]:
    """Three replicas behind a plane whose health checks run only every 10 s once they are UP, so only a
    connection can tell HAProxy that one died."""
    with tiny_plane(env, tmp_path_factory.mktemp("haproxy-quiet"), "quiet", 3, check_inter_s=10.0) as started:
        yield started


def served_by(response: httpx.Response) -> tuple[str, str | None]:
    assert response.status_code == 200, (response.status_code, response.headers, response.text[:300])
    assert response.text == response.headers[REPLICA_HEADER]
    return response.headers[REPLICA_HEADER], response.headers.get(FALLBACK_RANK_HEADER)


def test_a_stopped_primary_still_in_the_frontend_is_served_by_the_fallback_at_once(
    env: Env, quiet_plane: tuple[Plane, list[TinyReplica]]
) -> None:
    plane, (first, second, third) = quiet_plane
    pool = plane.syncer.apps[0].replicas
    before = fallback_counts(plane)
    env.behavior.ranked = [first.name, second.name, third.name]
    with httpx.Client(base_url=plane.url, timeout=10) as client:
        assert served_by(client.post(CHAT_PATH, content=b"{}")) == (first.name, None)
        env.loop.run(first.stop())  # its server stays UP in HAProxy until a check or a connection says otherwise
        assert plane.status(pool, first.name).startswith("UP")
        start = time.monotonic()
        response = client.post(CHAT_PATH, content=b"{}")
        elapsed = time.monotonic() - start
        assert served_by(response) == (second.name, "1")
        # Milliseconds here; the bound leaves a loaded machine ten times the 0.1 s once asserted.
        assert elapsed < FALLBACK_AT_ONCE_S, elapsed
        # The refused connection marked it DOWN at once, and the routers stop being told about it.
        assert plane.status(pool, first.name).startswith("DOWN")
        wait_until(
            1.0, lambda: plane.published(env.behavior) == [second.name, third.name], "DOWN one unpublished", poll_s=0.05
        )
        # The next request skips it without trying; a refused fallback passes to the next rank.
        assert served_by(client.post(CHAT_PATH, content=b"{}")) == (second.name, "1")
        env.loop.run(second.stop())
        assert served_by(client.post(CHAT_PATH, content=b"{}")) == (third.name, "2")
    after = fallback_counts(plane)
    assert after[FALLBACK_REFUSED] == before[FALLBACK_REFUSED] + 1
    assert after[FALLBACK_DOWN] == before[FALLBACK_DOWN] + 2


def test_a_refused_fallback_passes_to_the_next_rank_and_then_fails_closed(env: Env, client: httpx.Client) -> None:
    a, b = TinyReplica("tiny-a"), TinyReplica("tiny-b")
    for replica in (a, b):
        env.loop.run(replica.start())
    env.plane.replicas += [a.endpoint, b.endpoint]
    try:
        env.plane.wait_synced()
        for replica in (a, b):
            env.loop.run(replica.stop())
        env.behavior.ranked = ["tiny-a", "tiny-b", "r1"]
        response = client.get("/v1/models")  # GETs are never routed by the router, and do not count
        assert response.status_code == 200
        response = client.post(CHAT_PATH, json={})
        assert response.status_code == 200 and response.headers[REPLICA_HEADER] == "r1", response.headers
        assert response.headers[FALLBACK_RANK_HEADER] == "2"
        # Every ranked replica refuses: a 503 that says so, and still no unranked replica.
        for replica in (a, b):
            env.loop.run(replica.start())
        env.plane.wait_synced()
        for replica in (a, b):
            env.loop.run(replica.stop())
        posts = [r.posts() for r in env.replicas]
        env.behavior.ranked = ["tiny-a", "tiny-b"]
        assert_fail_closed(client.post(CHAT_PATH, json={}), REASON_REPLICA_UNAVAILABLE)
        assert [r.posts() for r in env.replicas] == posts
    finally:
        env.plane.replicas[:] = [env.r1.endpoint, env.r2.endpoint]
        env.plane.wait_synced(15)


def test_every_5xx_haproxy_makes_itself_carries_a_reason(env: Env, client: httpx.Client) -> None:
    closer = TinyReplica("closer")
    env.loop.run(closer.start())
    env.plane.replicas.append(closer.endpoint)
    try:
        env.plane.wait_synced()
        closer.close_without_answer = True
        env.behavior.ranked = ["closer", "r1"]
        # The replica took the request and died before answering: no retry (it may have acted on it).
        response = client.post(CHAT_PATH, json={})
        assert response.status_code == 502
        assert response.headers[SERVE_REASON_HEADER] == REASON_REPLICA_FAILED
        assert response.json()["error"]["code"] == 502 and REASON_REPLICA_FAILED in response.json()["error"]["message"]
    finally:
        env.plane.replicas[:] = [env.r1.endpoint, env.r2.endpoint]
        env.plane.wait_synced(15)
        env.loop.run(closer.stop())


def test_a_request_a_replica_dropped_on_a_kept_alive_connection_is_closed_and_never_resent(
    env: Env, client: httpx.Client
) -> None:
    closer = TinyReplica("closer")
    env.loop.run(closer.start())
    env.plane.replicas.append(closer.endpoint)
    try:
        env.plane.wait_synced()
        env.behavior.ranked = ["closer", "r1"]
        response = client.post(CHAT_PATH, json={})
        assert response.status_code == 200 and response.headers[REPLICA_HEADER] == "closer"
        closer.close_without_answer = True
        posts = [r.posts() for r in env.replicas]
        # HAProxy closes a kept-alive client connection without a status (RFC 9112 9.3.1: the client may retry)
        # rather than a 502, and does not resend a request the replica may have acted on.
        with pytest.raises(httpx.RemoteProtocolError):
            client.post(CHAT_PATH, json={})
        assert [r.posts() for r in env.replicas] == posts
    finally:
        env.plane.replicas[:] = [env.r1.endpoint, env.r2.endpoint]
        env.plane.wait_synced(15)
        env.loop.run(closer.stop())


def test_a_replicas_own_5xx_gets_a_reason_too(env: Env, client: httpx.Client) -> None:
    env.behavior.ranked = ["r1"]
    response = client.post(CHAT_PATH, json={"status": 500})
    assert response.status_code == 500
    assert response.headers[SERVE_REASON_HEADER] == REASON_REPLICA_ERROR


REPLICAS = 200


def test_two_hundred_replicas_are_each_routable_and_scale_without_a_reload(
    env: Env, tmp_path_factory: pytest.TempPathFactory
) -> None:
    workdir = tmp_path_factory.mktemp("haproxy-many")
    with tiny_plane(env, workdir, "many", REPLICAS, check_inter_s=5.0) as (plane, replicas):
        info = plane.runtime.show_info()

        def each_is_routable(names: list[str]) -> None:
            with httpx.Client(base_url=plane.url, timeout=10) as client:
                for name in names:
                    env.behavior.ranked = [name]
                    response = client.post(CHAT_PATH, content=b"{}")
                    assert response.status_code == 200 and response.headers[REPLICA_HEADER] == name

        each_is_routable([r.name for r in replicas])
        plane.replicas[:] = [r.endpoint for r in replicas[:50]]
        plane.wait_synced(30)
        servers = {name for backend, name in plane.runtime.show_stat() if backend == REPLICA_BACKEND}
        assert {r.name for r in replicas[:50]} <= servers and not servers & {r.name for r in replicas[50:]}
        each_is_routable([r.name for r in replicas[:50]])
        plane.replicas[:] = [r.endpoint for r in replicas]
        plane.wait_synced(30)
        each_is_routable([r.name for r in replicas])
        after = plane.runtime.show_info()
        assert after["Pid"] == info["Pid"] and int(after["Uptime_sec"]) >= int(info["Uptime_sec"])
        assert plane.haproxy.settings.log_path.read_text().count("Loading success") == 1


def test_the_suite_checks_every_frontend_response_for_the_error_contract(env: Env, client: httpx.Client) -> None:
    before = checked["responses"]
    env.behavior.ranked = ["r1"]
    client.post(CHAT_PATH, json={})
    client.get("/v1/models")
    assert checked["responses"] == before + 2, "the suite's hook did not see the frontend's responses"
    request = httpx.Request("POST", f"{env.plane.url}{CHAT_PATH}")
    with pytest.raises(AssertionError, match=SERVE_REASON_HEADER):
        check_frontend_response(httpx.Response(502, request=request))
    check_frontend_response(httpx.Response(502, headers={SERVE_REASON_HEADER: "x"}, request=request))
    check_frontend_response(httpx.Response(502, request=httpx.Request("GET", "http://127.0.0.1:1/")))
