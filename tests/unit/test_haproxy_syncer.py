"""The HAProxy syncer's bookkeeping against an in-memory runtime API: servers added, retired, deleted, adopted, and
what it publishes to the routers."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx

from base.contracts import PUBLISH_HEARTBEAT_S
from infra.haproxy.config import REPLICA_BACKEND, ROUTER_BACKEND
from infra.haproxy.servers import replica_server_options
from tests.support.syncer_fakes import FakeRuntime, endpoint, make_syncer, settings


def test_syncer_adds_retires_and_deletes_servers_by_replica_id(tmp_path: Path) -> None:
    runtime = FakeRuntime()
    live = [endpoint("a", 1001), endpoint("b", 1002)]
    now = [0.0]
    syncer = make_syncer(tmp_path, runtime, live, [], now)

    def sync() -> object:
        return asyncio.run(syncer.sync_once())

    report = sync()
    assert report.added == ["a", "b"] and report.routable == []  # routable only once HAProxy has them UP
    assert runtime.servers[(REPLICA_BACKEND, "a")]["addr"] == "127.0.0.1:1001"
    assert runtime.servers[(REPLICA_BACKEND, "a")]["options"] == replica_server_options(settings(tmp_path))
    now[0] = 0.25
    assert sync().routable == ["a", "b"]
    # `a` leaves while it still streams; `c` arrives: `a` goes to maintenance at once and leaves the routable set.
    runtime.servers[(REPLICA_BACKEND, "a")]["scur"] = 3
    live[:] = [endpoint("b", 1002), endpoint("c", 1003)]
    now[0] = 1.0
    report = sync()
    assert report.left == ["a"] and report.added == ["c"] and report.routable == ["b"]
    assert runtime.servers[(REPLICA_BACKEND, "a")]["state"] == "maint"
    now[0] = 2.0
    assert sync().deleted == []
    # Its streams end: deleted on the next pass.
    runtime.servers[(REPLICA_BACKEND, "a")]["scur"] = 0
    now[0] = 3.0
    report = sync()
    assert report.deleted == ["a"] and (REPLICA_BACKEND, "a") not in runtime.servers
    assert report.routable == ["b", "c"]


def test_syncer_drain_grace_moved_replica_and_adoption(tmp_path: Path) -> None:
    runtime = FakeRuntime()
    live = [endpoint("a", 1001)]
    routers = [endpoint("r", 2001)]
    now = [0.0]
    syncer = make_syncer(tmp_path, runtime, live, routers, now, grace=5)
    asyncio.run(syncer.sync_once())
    assert runtime.servers[(ROUTER_BACKEND, "r")]["state"] == "ready"
    # Same id on a new port: moved in place.
    live[:] = [endpoint("a", 1009)]
    now[0] = 1.0
    assert asyncio.run(syncer.sync_once()).moved == ["a"]
    assert runtime.servers[(REPLICA_BACKEND, "a")]["addr"] == "127.0.0.1:1009"
    # A leaving replica whose streams never end is cut after the grace, then deleted.
    runtime.servers[(REPLICA_BACKEND, "a")]["scur"] = 1
    live[:] = []
    now[0] = 2.0
    assert asyncio.run(syncer.sync_once()).left == ["a"]
    now[0] = 6.5
    assert asyncio.run(syncer.sync_once()).deleted == []
    now[0] = 7.0
    assert asyncio.run(syncer.sync_once()).deleted == ["a"]
    assert runtime.commands[-2:] == ["shutdown a", "del a"]
    # A fresh syncer (e.g. after a restart) adopts what it finds instead of starting over.
    live[:] = [endpoint("b", 1002)]
    asyncio.run(syncer.sync_once())
    again = make_syncer(tmp_path, runtime, live, routers, [8.0])
    report = asyncio.run(again.sync_once())
    assert not report.changed and report.routable == ["b"]
    assert set(again.apps[0].replicas.live) == {"b"} and set(again.apps[0].routers.live) == {"r"}


def test_syncer_adds_again_a_live_replica_deleted_behind_its_back(tmp_path: Path) -> None:
    runtime = FakeRuntime()
    live = [endpoint("a", 1001), endpoint("b", 1002)]
    syncer = make_syncer(tmp_path, runtime, live, [], [0.0])
    asyncio.run(syncer.sync_once())
    del runtime.servers[(REPLICA_BACKEND, "a")]
    report = asyncio.run(syncer.sync_once())
    assert report.added == ["a"] and runtime.servers[(REPLICA_BACKEND, "a")]["addr"] == "127.0.0.1:1001"


def test_syncer_refuses_ids_that_cannot_name_a_server(tmp_path: Path) -> None:
    runtime = FakeRuntime()
    live = [endpoint("ok-1", 1001), endpoint("_retry1", 1002), endpoint("bad id", 1003)]
    report = asyncio.run(make_syncer(tmp_path, runtime, live, [], [0.0]).sync_once())
    assert report.added == ["ok-1"] and sorted(report.refused) == ["_retry1", "bad id"]


def test_the_routers_are_told_each_routable_replicas_open_requests_when_they_change(tmp_path: Path) -> None:
    posted: list[dict] = []

    def router(request: httpx.Request) -> httpx.Response:
        posted.append(json.loads(request.content))
        return httpx.Response(204)

    runtime = FakeRuntime()
    now = [0.0]
    syncer = make_syncer(
        tmp_path,
        runtime,
        [endpoint("a", 1001), endpoint("b", 1002)],
        [endpoint("r", 2001)],
        now,
        publish_transport=httpx.MockTransport(router),
    )

    def sync_at(t: float) -> None:
        now[0] = t
        asyncio.run(syncer.sync_once())

    sync_at(0.0)  # servers added: none routable yet
    sync_at(0.25)
    assert posted[-1]["replica_ids"] == ["a", "b"] and posted[-1]["in_flight"] == {"a": 0, "b": 0}
    # Nothing open, nothing changed: no publication before the heartbeat.
    sent = len(posted)
    sync_at(0.5)
    assert len(posted) == sent
    sync_at(0.25 + PUBLISH_HEARTBEAT_S)
    assert len(posted) == sent + 1
    # Open requests: counted afresh at every pass, equal or not (the requests behind the counts may be new).
    runtime.servers[(REPLICA_BACKEND, "a")]["scur"] = 3
    for step in range(1, 4):
        sync_at(0.25 + PUBLISH_HEARTBEAT_S + step * 0.25)
        assert len(posted) == sent + 1 + step and posted[-1]["in_flight"] == {"a": 3, "b": 0}


def test_what_serves_when_haproxy_starts_is_up_at_once_and_what_comes_later_waits_for_its_checks(
    tmp_path: Path,
) -> None:
    """A new HAProxy (a frontend's hand-over, or a restart) routes at once to the replicas its predecessor routed
    to; a replica that appears later is routable once its health checks pass."""
    runtime = FakeRuntime()
    replicas = [endpoint("a", 1001)]
    syncer = make_syncer(tmp_path, runtime, replicas, [], [0.0])
    asyncio.run(syncer.sync_once())
    assert "health down a" not in runtime.commands
    replicas.append(endpoint("b", 1002))
    asyncio.run(syncer.sync_once())
    assert runtime.commands.count("health down b") == 1
