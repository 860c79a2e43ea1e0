"""The router service's HTTP contract with real policies over a static replica set (no Ray cluster)."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from pydantic import ValidationError

from base.contracts import (
    BODY_TOTAL_UNKNOWN,
    BODY_TRUNCATED_HEADER,
    REASON_NO_PREFILL_REPLICA,
    REQUEST_ID_HEADER,
    ROUTE_BUDGET_HEADER,
)
from base.route_wire import Membership, RouteRefusal, RouteReply, endpoint_id, replica_of
from infra.observability.targets import METRICS_PATH
from routers.capacity_ledger import CapacityLedger
from routers.capacity_queue import LocalLedgerClient
from routers.core import ReplicaView, RouteRequest
from routers.registry import build_stateless_policy
from services.router.http_app import build_router_app
from services.router.live_replicas import LiveReplicas
from services.router.membership import FrontendMembership
from services.router.prefill_side import PrefillChooser
from services.router.route_request import fields_from_body, route_request_from
from services.router.settings import PrefillTarget, RouterSettings, build_policy
from services.serve_internals import ReplicaEndpoint
from tests.support.router_service_client import REPLICA_IDS, route, router, sample, unique_app, views


def test_settings_are_validated_with_clear_errors() -> None:
    with pytest.raises(ValidationError, match="invalid consistent_hash kwargs: load_factor"):
        RouterSettings(target_app="llm", policy="consistent_hash", policy_kwargs={"load_factor": 0.5})
    with pytest.raises(ValidationError, match="unknown routing policy 'fastest'"):
        RouterSettings(target_app="llm", policy="fastest")
    with pytest.raises(ValidationError, match="invalid round_robin kwargs: seed"):
        RouterSettings(target_app="llm", policy_kwargs={"seed": 1})
    with pytest.raises(ValidationError):
        RouterSettings(target_app="llm", session_header="x session")
    settings = RouterSettings(target_app="llm", session_header="X-Team-Session")
    assert (settings.session_header, settings.policy, settings.target_deployment) == (
        "x-team-session",
        "round_robin",
        "LLMReplica",
    )


def test_route_reply_follows_the_contract() -> None:
    async def run() -> None:
        async with router(RouterSettings(target_app=unique_app()), views()) as client:
            replies = [await route(client) for _ in range(len(REPLICA_IDS))]
        for reply in replies:
            assert reply.status_code == 200
            assert reply.headers["content-type"] == "application/json"
            body = reply.json()
            assert set(body) == {"replica_id", "fallbacks", "capacity_token"}
            parsed = RouteReply.model_validate(body)
            assert parsed.capacity_token is None
            assert parsed.replica_id in REPLICA_IDS
            assert len(parsed.fallbacks) == 2 and parsed.replica_id not in parsed.fallbacks
        # Round robin cycles through the sorted ids.
        assert [r.json()["replica_id"] for r in replies] == sorted(REPLICA_IDS)

    asyncio.run(run())


def test_consistent_hash_routers_agree_on_every_session() -> None:
    settings = RouterSettings(target_app=unique_app(), policy="consistent_hash")

    async def run() -> None:
        # Two router replicas, each with its own policy, told the same set in a different order.
        async with router(settings, views()) as one, router(settings, views(list(reversed(REPLICA_IDS)))) as two:
            sessions = [f"session-{i}" for i in range(200)]
            first = [(await route(one, s)).json() for s in sessions]
            second = [(await route(two, s)).json() for s in sessions]
            again = [(await route(one, s)).json() for s in sessions]
        assert first == second == again
        assert {reply["replica_id"] for reply in first} == set(REPLICA_IDS)

    asyncio.run(run())


def test_an_empty_replica_set_is_refused_with_503_and_a_reason() -> None:
    app = unique_app()

    async def run() -> None:
        async with router(RouterSettings(target_app=app, policy="consistent_hash"), []) as client:
            reply = await route(client, "s1")
        assert reply.status_code == 503
        assert RouteRefusal.model_validate(reply.json()).reason == "no_replica"

    asyncio.run(run())
    assert sample("sluice_router_refused_total", app=app, policy="consistent_hash", reason="no_replica") == 1


def test_capacity_queue_replies_with_a_token_then_times_out_with_503() -> None:
    app = unique_app()
    settings = RouterSettings(
        target_app=app, target_capacity=1, policy="capacity_queue", policy_kwargs={"max_wait_s": 0.2, "seed": 0}
    )
    ledger = CapacityLedger(seed=0)

    async def run() -> tuple[httpx.Response, httpx.Response]:
        async with router(
            settings, views(REPLICA_IDS[:1], capacity=settings.target_capacity), LocalLedgerClient(ledger)
        ) as client:
            return await route(client), await route(client)

    granted, refused = asyncio.run(run())
    assert granted.status_code == 200
    reply = RouteReply.model_validate(granted.json())
    assert reply.replica_id == REPLICA_IDS[0] and reply.capacity_token
    assert ledger.snapshot()["outstanding"] == 1
    assert ledger.release(reply.capacity_token) is True
    assert refused.status_code == 503
    assert refused.json() == {"reason": "capacity_timeout"}
    assert sample("sluice_router_refused_total", app=app, policy="capacity_queue", reason="capacity_timeout") == 1


def test_a_capacity_wait_ends_within_haproxys_route_budget_with_its_own_reason() -> None:
    """HAProxy's HTTP route call says how long it still waits: a queued request gets capacity_timeout within that,
    not HAProxy's router_unreachable at its deadline, whatever max_wait_s allows."""
    app = unique_app()
    settings = RouterSettings(
        target_app=app, target_capacity=1, policy="capacity_queue", policy_kwargs={"max_wait_s": 30.0, "seed": 0}
    )

    async def run() -> tuple[httpx.Response, float]:
        async with router(
            settings, views(REPLICA_IDS[:1], capacity=settings.target_capacity), LocalLedgerClient(CapacityLedger())
        ) as client:
            assert (await route(client)).status_code == 200  # the only slot, held
            started = time.monotonic()
            refused = await route(client, **{ROUTE_BUDGET_HEADER: "300"})
            return refused, time.monotonic() - started

    refused, took_s = asyncio.run(run())
    assert refused.status_code == 503 and refused.json() == {"reason": "capacity_timeout"}
    assert took_s < 10.0, took_s  # 0.2 s expected; max_wait_s would have taken 30


@pytest.mark.parametrize(
    ("value", "budget_s"), [("2500", 2.4), ("50", 0.0), ("0", 0.0), (None, None), ("soon", None), ("-5", None)]
)
def test_the_route_budget_is_haproxys_time_left_less_the_answers_way_back(value: str | None, budget_s) -> None:
    headers = {REQUEST_ID_HEADER: "r"} | ({} if value is None else {ROUTE_BUDGET_HEADER: value})
    assert route_request_from(headers, b"", "x-team-session").wait_budget_s == pytest.approx(budget_s)


BAD_BODIES = [
    b'{"model": "sluice-tiny", "messages": [{"role": "user", "content": "cut her',
    b'{"model": "sluice-tiny"',
    b'{"model": "sluice-\\',
    b"\xff\xfe\x00{garbage",
    b"[" * 100_000,
    b"{" * 100_000,
    b"not json at all",
    b'{"model": 5, "stream": true}',
    b'["model", "x"]',
    b"null",
]


def test_truncated_or_invalid_bodies_never_fail_and_truncation_is_counted() -> None:
    app = unique_app()

    async def run() -> list[httpx.Response]:
        async with router(RouterSettings(target_app=app), views()) as client:
            replies = [await route(client, body=body) for body in BAD_BODIES]
            cut = {BODY_TRUNCATED_HEADER: "16384/70000"}
            replies += [await route(client, body=body, **cut) for body in BAD_BODIES]
            replies.append(await route(client, body=BAD_BODIES[0], **{BODY_TRUNCATED_HEADER: "garbled"}))
            chunked = {BODY_TRUNCATED_HEADER: f"16384/{BODY_TOTAL_UNKNOWN}"}
            replies.append(await route(client, body=BAD_BODIES[0], **chunked))
            replies.append(await route(client, body=b'{"model": "m"}', **{BODY_TRUNCATED_HEADER: "14/14"}))
            return replies

    replies = asyncio.run(run())
    assert [r.status_code for r in replies] == [200] * len(replies)
    assert sample("sluice_router_truncated_bodies_total", app=app) == len(BAD_BODIES) + 2


@pytest.mark.parametrize(
    "body,truncated,model",
    [
        (b'{"messages": [], "model": "sluice-tiny"}', False, "sluice-tiny"),
        (b'{"model": "sluice-tiny", "messages": [{"role": "us', True, "sluice-tiny"),
        (b'{"model" : "team\\/a\\"b", "messa', True, 'team/a"b'),
        (b'{"model": "sluice-tiny", "messages": [{"role": "us', False, "sluice-tiny"),
        (b'{"model": "sluice-\\', True, None),
        (b'{"model": "\\u00', True, None),
        (b'{"model": 5}', False, None),
        (b'{"model": ""}', False, None),
        (b'["model"]', False, None),
        (b"[" * 100_000, False, None),
        (b"", False, None),
        (b"\xff\xfe", True, None),
    ],
)
def test_model_is_read_from_json_else_from_the_prefix(body: bytes, truncated: bool, model: str | None) -> None:
    assert fields_from_body(body, truncated)["model"] == model


@pytest.mark.parametrize(
    "body,truncated,user",
    [
        (b'{"model": "m", "user": "alice", "prompt": "hi"}', False, "alice"),
        (b'{"user": "alice", "model": "m", "prompt": [1, 2, 3', True, "alice"),
        (b'{"model": "m", "prompt": [1, 2, 3', True, None),  # the user field is past the cut
        (b'{"model": "m", "user": 7}', False, None),
        (b'{"model": "m", "user": "al', True, None),
        (b'{"model": "m", "messages": [{"content": "\\"user\\": \\"eve\\""}]}', False, None),
    ],
)
def test_user_is_read_from_json_else_from_the_prefix(body: bytes, truncated: bool, user: str | None) -> None:
    assert fields_from_body(body, truncated)["user"] == user


def test_the_route_request_carries_headers_and_body() -> None:
    body = b'{"model": "sluice-tiny", "user": "u-1", "mess'
    headers = {REQUEST_ID_HEADER: "req-1", "x-team-session": "s-9", BODY_TRUNCATED_HEADER: "45/900"}
    assert route_request_from(headers, body, "x-team-session") == RouteRequest(
        request_id="req-1", session_id="s-9", model="sluice-tiny", user="u-1", body_prefix=body, body_truncated=True
    )
    # A chunked body cut at the buffer (its total unknown) is read the same way: its fields from the prefix.
    chunked = route_request_from({BODY_TRUNCATED_HEADER: f"45/{BODY_TOTAL_UNKNOWN}"}, body, "x-team-session")
    assert chunked.body_truncated and chunked.user == "u-1" and chunked.model == "sluice-tiny"
    fresh = route_request_from({"x-team-session": ""}, b"", "x-team-session")
    assert fresh.session_id is None and len(fresh.request_id) == 32 and fresh.model is None


def test_metrics_expose_route_refusal_truncation_and_decision_counters() -> None:
    app = unique_app()
    settings = RouterSettings(target_app=app, policy="consistent_hash")

    async def run() -> str:
        async with router(settings, views()) as client:
            await route(client, "s1")
            await route(client, None, b'{"model": "x"', **{BODY_TRUNCATED_HEADER: "13/40"})
            metrics = await client.get(METRICS_PATH)
        assert metrics.status_code == 200
        async with router(settings, []) as empty:
            await route(empty, "s1")
        return metrics.text

    text = asyncio.run(run())
    assert f'sluice_router_routed_total{{app="{app}",policy="consistent_hash"}} 2.0' in text
    assert f'sluice_router_truncated_bodies_total{{app="{app}"}} 1.0' in text
    assert 'sluice_router_decisions_total{policy="consistent_hash",reason="primary"}' in text
    assert 'sluice_router_decisions_total{policy="consistent_hash",reason="no_session_header"}' in text
    assert "sluice_router_refused_total" in text
    assert sample("sluice_router_refused_total", app=app, policy="consistent_hash", reason="no_replica") == 1


def test_decisions_are_forgotten_after_forget_after_s() -> None:
    policy = build_policy(RouterSettings(target_app="llm", policy="power_of_two", forget_after_s=2.0))
    assert policy.tracker.forget_after_s == 2.0


def endpoint(replica_id: str, port: int) -> ReplicaEndpoint:
    return ReplicaEndpoint(replica_id=replica_id, deployment="LLMReplica", host="127.0.0.1", port=port)


def test_live_replicas_wait_for_a_non_empty_set_and_keep_the_last_one_on_errors() -> None:
    answers: list[list[ReplicaEndpoint] | Exception] = [
        [],
        RuntimeError("controller restarting"),
        [endpoint("a", 30000)],
        RuntimeError("controller restarting"),
        [endpoint("a", 30000), endpoint("b", 30001)],
    ]
    calls = 0

    async def source() -> list[ReplicaEndpoint]:
        nonlocal calls
        answer = answers[min(calls, len(answers) - 1)]
        calls += 1
        if isinstance(answer, Exception):
            raise answer
        return answer

    async def run() -> None:
        live = LiveReplicas(source, capacity=8, refresh_interval_s=0.01)
        await asyncio.wait_for(live.start(), 2.0)
        try:
            assert calls == 3
            assert live.views() == (ReplicaView(replica_id="a", endpoint="http://127.0.0.1:30000", capacity=8),)
            while calls < 4:
                await asyncio.sleep(0.01)
            assert [v.replica_id for v in live.views()] == ["a"]
            while calls < 6:
                await asyncio.sleep(0.01)
            assert [v.replica_id for v in live.views()] == ["a", "b"]
        finally:
            live.stop()

    asyncio.run(run())


def test_a_prefill_decode_router_names_a_prefill_replica_with_its_own_policy() -> None:
    app = unique_app()
    settings = RouterSettings(
        target_app=app,
        policy="consistent_hash",
        prefill=PrefillTarget(app=f"{app}-prefill", route_prefix="/tiny-prefill", policy="round_robin"),
    )
    prefill_ids = ["p1", "p2"]
    prefill_views: list[ReplicaView] = views(prefill_ids)

    async def run() -> list[RouteReply]:
        assert settings.prefill is not None
        chooser = PrefillChooser(build_stateless_policy("round_robin", {}), lambda: prefill_views, "/tiny-prefill")
        app_under_test = build_router_app(settings, build_policy(settings), lambda: views(), chooser)
        transport = httpx.ASGITransport(app=app_under_test)
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
            replies = [RouteReply.model_validate((await route(client, "session-1")).json()) for _ in range(4)]
            prefill_views.clear()
            refused = await route(client, "session-1")
            optional = PrefillChooser(build_stateless_policy("round_robin", {}), lambda: [], "/p", required=False)
            lenient = build_router_app(settings, build_policy(settings), lambda: views(), optional)
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=lenient), base_url="http://r") as other:
                unpaired = await route(other, "session-1")
        assert refused.status_code == 503
        assert RouteRefusal.model_validate(refused.json()).reason == REASON_NO_PREFILL_REPLICA
        # Decode replicas that may prefill locally are routed to anyway, with no prefill replica named.
        assert unpaired.status_code == 200 and set(unpaired.json()) == {"replica_id", "fallbacks", "capacity_token"}
        return replies

    replies = asyncio.run(run())
    # Decode: consistent hash keeps the session on one replica; prefill: round robin over the prefill replicas.
    assert len({r.replica_id for r in replies}) == 1
    assert [r.prefill_replica_id for r in replies] == ["p1", "p2", "p1", "p2"]
    assert [r.prefill_url for r in replies[:2]] == [
        "http://127.0.0.1:30000/tiny-prefill",
        "http://127.0.0.1:30001/tiny-prefill",
    ]


def test_the_prefill_side_takes_no_capacity_tokens() -> None:
    with pytest.raises(ValidationError, match="takes no capacity tokens"):
        PrefillTarget(app="p", policy="capacity_queue")


def test_a_data_parallel_replica_is_one_view_per_engine_rank_and_goes_with_its_replica() -> None:
    async def source() -> list[ReplicaEndpoint]:
        return [endpoint("a", 30000), endpoint("b", 30001)]

    async def run() -> tuple[ReplicaView, ...]:
        live = LiveReplicas(source, capacity=8, refresh_interval_s=60, ranks=2)
        await live.start()
        live.stop()
        return live.views()

    views_by_rank = asyncio.run(run())
    assert [(v.replica_id, v.endpoint, v.capacity) for v in views_by_rank] == [
        ("a:0", "http://127.0.0.1:30000", 4),
        ("a:1", "http://127.0.0.1:30000", 4),
        ("b:0", "http://127.0.0.1:30001", 4),
        ("b:1", "http://127.0.0.1:30001", 4),
    ]
    assert [replica_of(v.replica_id) for v in views_by_rank] == ["a", "a", "b", "b"]
    assert replica_of("r1a2b3c4") == "r1a2b3c4" and endpoint_id("b", 1) == "b:1" and endpoint_id("b", None) == "b"
    # A frontend that can route to replica b is offered both of b's ranks, and nothing of a.
    membership = FrontendMembership()
    membership.publish(Membership(frontend="f1", replica_ids=["b"]))
    assert [v.replica_id for v in membership.routable(views_by_rank, "f1")] == ["b:0", "b:1"]
