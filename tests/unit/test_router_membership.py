"""One membership truth on the router side: a frontend's published set narrows what the router ranks for it."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from base.contracts import (
    MEMBERSHIP_PATH,
    PUBLICATION_TTL_S,
    PUBLISH_HEARTBEAT_S,
)
from base.route_wire import Membership, RouteRefusal
from routers.consistent_hash import ConsistentHash
from routers.core import ReplicaView
from services.router.membership import FrontendMembership
from services.router.settings import RouterSettings
from tests.support.router_service_client import (
    REPLICA_IDS,
    named_ids,
    publish,
    route,
    router,
    sample,
    unique_app,
    views,
)


def ring_over(replica_ids: Iterable[str]) -> ConsistentHash:
    ring = ConsistentHash()
    ring.on_replicas_changed(sorted(replica_ids))
    return ring


def test_a_published_set_narrows_consistent_hash_to_the_next_published_replica_on_the_ring() -> None:
    app = unique_app()
    unpublished = REPLICA_IDS[0]
    published = REPLICA_IDS[1:]
    full, narrowed = ring_over(REPLICA_IDS), ring_over(published)
    sessions = [f"session-{i}" for i in range(200)]
    moved = [s for s in sessions if full.lookup(s)[0][0] == unpublished]
    assert moved, "some session must have the unpublished replica as its natural primary"

    async def run() -> list[dict]:
        async with router(RouterSettings(target_app=app, policy="consistent_hash"), views()) as client:
            await publish(client, "fe-a", published)
            return [(await route(client, s, frontend="fe-a")).json() for s in sessions]

    replies = asyncio.run(run())
    for session, reply in zip(sessions, replies, strict=True):
        assert [reply["replica_id"], *reply["fallbacks"]] == narrowed.lookup(session)[0]
        assert unpublished not in [reply["replica_id"], *reply["fallbacks"]]
        if session not in moved:  # every other session keeps its natural primary
            assert reply["replica_id"] == full.lookup(session)[0][0]
    assert sample("sluice_router_membership_updates_total", app=app) == 1


def test_without_publications_any_frontend_gets_every_live_replica() -> None:
    async def run() -> None:
        async with router(RouterSettings(target_app=unique_app()), views()) as client:
            assert await named_ids(client, frontend="fe-never-published") == set(REPLICA_IDS)
            assert await named_ids(client) == set(REPLICA_IDS)

    asyncio.run(run())


def test_an_unnamed_or_unknown_frontend_gets_what_every_publishing_frontend_can_route_to() -> None:
    async def run() -> None:
        async with router(RouterSettings(target_app=unique_app()), views()) as client:
            await publish(client, "fe-a", REPLICA_IDS[:3])
            await publish(client, "fe-b", REPLICA_IDS[1:])
            assert await named_ids(client) == set(REPLICA_IDS[1:3])
            assert await named_ids(client, frontend="fe-unknown") == set(REPLICA_IDS[1:3])
            assert await named_ids(client, frontend="fe-a") == set(REPLICA_IDS[:3])
            assert await named_ids(client, frontend="fe-b") == set(REPLICA_IDS[1:])

    asyncio.run(run())


def test_a_published_replica_that_serve_no_longer_lists_is_never_named() -> None:
    live = tuple(views())

    async def run() -> None:
        async with router(RouterSettings(target_app=unique_app()), lambda: live) as client:
            await publish(client, "fe-a", [*REPLICA_IDS[:2], "r-never-listed"])
            assert await named_ids(client, frontend="fe-a") == set(REPLICA_IDS[:2])
            assert await named_ids(client) == set(REPLICA_IDS[:2])
            # Serve drops a replica the frontend still publishes: it is gone from the very next call.
            nonlocal live
            live = tuple(views(REPLICA_IDS[1:]))
            assert await named_ids(client, frontend="fe-a") == {REPLICA_IDS[1]}

    asyncio.run(run())


def test_an_empty_intersection_is_refused_with_503_no_replica() -> None:
    app = unique_app()

    async def run() -> None:
        async with router(RouterSettings(target_app=app, policy="consistent_hash"), views()) as client:
            await publish(client, "fe-a", ["r-not-in-serve"])
            await publish(client, "fe-b", REPLICA_IDS[:1])
            await publish(client, "fe-c", REPLICA_IDS[1:])
            for frontend in ("fe-a", None, "fe-unknown"):  # fe-a's set is not live; b and c are disjoint
                reply = await route(client, "s1", frontend=frontend)
                assert reply.status_code == 503
                assert RouteRefusal.model_validate(reply.json()).reason == "no_replica"
            assert (await route(client, "s1", frontend="fe-b")).json()["replica_id"] == REPLICA_IDS[0]

    asyncio.run(run())
    assert sample("sluice_router_refused_total", app=app, policy="consistent_hash", reason="no_replica") == 3


MALFORMED_MEMBERSHIPS = [
    b"",
    b"not json",
    b'{"frontend": "fe-a", "replica_ids": ["r1"',
    b"\xff\xfe{}",
    b"null",
    b'["fe-a", ["r1"]]',
    b'{"frontend": "fe-a"}',
    b'{"replica_ids": ["r1"]}',
    b'{"frontend": "fe-a", "replica_ids": "r1a2b3c4"}',
    b'{"frontend": "fe-a", "replica_ids": [1, 2]}',
    b'{"frontend": 7, "replica_ids": []}',
    b'{"frontend": "fe-a", "replica_ids": [], "server": "x"}',
    b"[" * 100_000,
]


def test_malformed_memberships_are_rejected_with_422_and_the_router_keeps_routing() -> None:
    app = unique_app()

    async def run() -> None:
        async with router(RouterSettings(target_app=app), views()) as client:
            await publish(client, "fe-a", REPLICA_IDS[:2])
            for body in MALFORMED_MEMBERSHIPS:
                reply = await client.post(MEMBERSHIP_PATH, content=body, headers={"content-type": "application/json"})
                assert reply.status_code == 422, body
                assert reply.headers["content-type"] == "application/json"
                assert reply.json()["detail"], body
            # The last valid publication still holds, for that frontend and for everyone else.
            assert await named_ids(client, frontend="fe-a") == set(REPLICA_IDS[:2])
            assert await named_ids(client) == set(REPLICA_IDS[:2])

    asyncio.run(run())
    assert sample("sluice_router_membership_updates_total", app=app) == 1


def test_a_republication_replaces_the_previous_set() -> None:
    app = unique_app()

    async def run() -> None:
        async with router(RouterSettings(target_app=app), views()) as client:
            await publish(client, "fe-a", REPLICA_IDS[:2])
            assert await named_ids(client, frontend="fe-a") == set(REPLICA_IDS[:2])
            await publish(client, "fe-a", REPLICA_IDS[2:])
            assert await named_ids(client, frontend="fe-a") == set(REPLICA_IDS[2:])
            await publish(client, "fe-a", REPLICA_IDS[2:])  # a heartbeat: same set, still counted
            assert await named_ids(client) == set(REPLICA_IDS[2:])

    asyncio.run(run())
    assert sample("sluice_router_membership_updates_total", app=app) == 3


def test_membership_caches_the_filtered_views_until_the_views_or_a_publication_change() -> None:
    membership = FrontendMembership()
    first = tuple(views())
    assert membership.routable(first, "fe-a") is first  # nothing published: nothing to narrow

    membership.publish(Membership(frontend="fe-a", replica_ids=REPLICA_IDS[:3]))
    narrowed = membership.routable(first, "fe-a")
    assert [v.replica_id for v in narrowed] == REPLICA_IDS[:3]
    assert membership.routable(first, "fe-a") is narrowed
    assert membership.routable(first, None) is membership.routable(first, "fe-unknown")

    # Equal content but a new tuple (a fresh poll): recomputed, so a changed set is never missed.
    second = tuple(views(REPLICA_IDS[1:]))
    assert [v.replica_id for v in membership.routable(second, "fe-a")] == REPLICA_IDS[1:3]

    # A heartbeat with the same set keeps the cached result; a new set replaces it.
    cached = membership.routable(second, "fe-a")
    membership.publish(Membership(frontend="fe-a", replica_ids=list(reversed(REPLICA_IDS[:3]))))
    assert membership.routable(second, "fe-a") is cached
    membership.publish(Membership(frontend="fe-a", replica_ids=REPLICA_IDS[3:]))
    assert [v.replica_id for v in membership.routable(second, "fe-a")] == REPLICA_IDS[3:]

    # Another frontend's publication narrows the common set, and only that.
    membership.publish(Membership(frontend="fe-b", replica_ids=REPLICA_IDS[2:]))
    assert [v.replica_id for v in membership.routable(second, None)] == REPLICA_IDS[3:]
    assert [v.replica_id for v in membership.routable(second, "fe-b")] == REPLICA_IDS[2:]
    assert [v.replica_id for v in membership.routable(second, "fe-a")] == REPLICA_IDS[3:]


def test_views_carry_the_open_requests_summed_over_the_frontends_and_only_a_changed_count_is_a_new_sample() -> None:
    membership = FrontendMembership()
    ids = REPLICA_IDS[:3]
    assert membership.publish(Membership(frontend="fe-a", replica_ids=ids, in_flight={ids[0]: 2, ids[1]: 0}))
    assert membership.publish(Membership(frontend="fe-b", replica_ids=ids, in_flight={ids[0]: 1, ids[1]: 3}))
    offered = membership.routable(tuple(views(ids)), "fe-a")
    assert [(v.in_flight, v.in_flight_sampled) for v in offered] == [(3, True), (3, True), (0, False)]
    # Counts of open requests are a new sample even when equal (the requests behind them may be new); a heartbeat
    # with nothing open and nothing changed is not.
    assert membership.publish(Membership(frontend="fe-b", replica_ids=ids, in_flight={ids[0]: 1, ids[1]: 3}))
    assert membership.publish(Membership(frontend="fe-b", replica_ids=ids, in_flight={ids[0]: 0, ids[1]: 3}))
    assert [v.in_flight for v in membership.routable(tuple(views(ids)), None)] == [2, 3, 0]
    idle = Membership(frontend="fe-c", replica_ids=ids, in_flight=dict.fromkeys(ids, 0))
    assert membership.publish(idle) and not membership.publish(idle)
    # An engine rank of a data-parallel replica has no count of its own: HAProxy counts the replica's.
    ranked = membership.routable((ReplicaView(replica_id=f"{ids[0]}:0"),), "fe-a")
    assert [(v.in_flight, v.in_flight_sampled) for v in ranked] == [(0, False)]


def test_a_frontend_silent_for_three_heartbeats_is_forgotten() -> None:
    """Review #13: a frontend that went away kept narrowing the common set and loading its replicas forever."""
    now = [0.0]
    membership = FrontendMembership(clock=lambda: now[0])
    live, gone = REPLICA_IDS[:3], REPLICA_IDS[1:4]
    membership.publish(Membership(frontend="fe-gone", replica_ids=gone, in_flight={gone[0]: 5}))
    for at in (0.0, PUBLISH_HEARTBEAT_S, 2 * PUBLISH_HEARTBEAT_S, PUBLICATION_TTL_S):
        now[0] = at
        membership.publish(Membership(frontend="fe-live", replica_ids=live, in_flight={live[0]: 1}))
    everyone = tuple(views(REPLICA_IDS))
    # Within the TTL the silent frontend still counts: the common set, and its open requests on replica 1.
    assert [(v.replica_id, v.in_flight) for v in membership.routable(everyone, None)] == [(live[1], 5), (live[2], 0)]
    now[0] = PUBLICATION_TTL_S + 0.1
    assert [(v.replica_id, v.in_flight) for v in membership.routable(everyone, None)] == [
        (live[0], 1),
        (live[1], 0),
        (live[2], 0),
    ]
    assert [v.replica_id for v in membership.routable(everyone, "fe-gone")] == live
