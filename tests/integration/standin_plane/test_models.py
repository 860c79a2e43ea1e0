"""Several models behind one frontend, on stand-ins: the request's model picks its app (router pool, replica backend,
route prefix), and a model the frontend cannot tell is refused before any route call, never guessed."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from base.contracts import (
    APP_HEADER,
    FALLBACK_RANK_HEADER,
    MODEL_HEADER,
    MODELS_PATH,
    REASON_MODEL_BEYOND_BUFFER,
    REASON_MODEL_MISSING,
    REASON_MODEL_NOT_FOUND,
    REASON_UNKNOWN_REPLICA_ID,
    REPLICA_HEADER,
    REQUEST_ID_HEADER,
    ROUTE_PATH,
    SERVE_REASON_HEADER,
)
from base.waiting import wait_until
from infra.haproxy.apps import AppRoute
from infra.haproxy.config import HAProxySettings, replica_backend
from infra.haproxy.process import HAProxyProcess
from services.frontend.haproxy_syncer import AppSources, HAProxySyncer
from services.serve_internals import ReplicaEndpoint
from tests.integration.standin_plane.standins import (
    CHAT_PATH,
    LOOPBACK,
    OPEN_ROUTER_PREFIX,
    LoopThread,
    ReplicaStandIn,
    RouterBehavior,
    RouterStandIn,
    assert_fail_closed,
    first_event,
)
from tests.support.frontend_contract import register_frontend
from tests.support.frontend_metrics import refusal_counts
from tests.support.ports import free_port

CHAT, CODE = "team/chat-model", "code:v2"
LOOKUP_BYTES = 2048


@dataclass
class Served:
    """One model's stand-ins: its replicas, its router and what the router is told to answer."""

    app: AppRoute
    replicas: list[ReplicaStandIn]
    router: RouterStandIn
    behavior: RouterBehavior

    def endpoints(self) -> list[ReplicaEndpoint]:
        return [replica.endpoint for replica in self.replicas]


def served(app: AppRoute, replicas: list[str]) -> Served:
    behavior = RouterBehavior()
    return Served(
        app, [ReplicaStandIn(name) for name in replicas], RouterStandIn(f"{app.name}-router", behavior), behavior
    )


@dataclass
class TwoModels:
    loop: LoopThread
    chat: Served
    code: Served
    haproxy: HAProxyProcess
    syncer: HAProxySyncer

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.haproxy.settings.port}"

    def posts(self) -> int:
        return sum(replica.posts() for served in (self.chat, self.code) for replica in served.replicas)

    def route_calls(self) -> int:
        return len(self.chat.behavior.calls) + len(self.code.behavior.calls)


def _routable(syncer: HAProxySyncer, haproxy: HAProxyProcess) -> bool:
    """Every app's replicas published to its routers, and its routers UP in HAProxy (a new server starts DOWN)."""
    stats = haproxy.runtime.show_stat()
    return all(
        0 < app.published_replicas() == len(app.replicas.members)
        and all((stat := stats.get((app.routers.backend, name))) is not None and stat.up for name in app.routers.live)
        for app in syncer.apps
    )


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TwoModels]:
    loop = LoopThread()
    chat = served(AppRoute(name="chat-llm", model=CHAT, replica_route_prefix="/chat-llm"), ["chat-1", "chat-2"])
    code = served(
        AppRoute(name="code-llm", model=CODE, replica_route_prefix="/code-llm", router_route_prefix=OPEN_ROUTER_PREFIX),
        ["code-1", "code-2"],
    )
    stand_ins = [*chat.replicas, chat.router, *code.replicas, code.router]
    for stand_in in stand_ins:
        loop.run(stand_in.start())
    settings = HAProxySettings(
        workdir=tmp_path_factory.mktemp("models"),
        apps=[chat.app, code.app],
        model_lookup_bytes=LOOKUP_BYTES,
        port=free_port(),
        prometheus_port=free_port(),
        # Checks rarely: a stopped replica stays UP until its connection is refused (the retry test).
        check_inter_s=10.0,
    )
    register_frontend(settings.port)
    haproxy = HAProxyProcess(settings).start()

    def sources(model: Served) -> AppSources:
        async def replicas() -> list[ReplicaEndpoint]:
            return model.endpoints()

        async def routers() -> list[ReplicaEndpoint]:
            return [model.router.endpoint]

        return AppSources(replicas=replicas, routers=routers)

    syncer = HAProxySyncer(haproxy.runtime, settings, [sources(chat), sources(code)])
    future = loop.submit(syncer.run(interval_s=0.1))
    try:
        wait_until(10, lambda: _routable(syncer, haproxy), "both apps' replicas published, routers UP", poll_s=0.05)
        yield TwoModels(loop, chat, code, haproxy, syncer)
    finally:
        future.cancel()
        haproxy.stop(grace_s=2)
        for stand_in in stand_ins:
            loop.run(stand_in.stop())
        loop.close()


@pytest.fixture
def client(models: TwoModels) -> Iterator[httpx.Client]:
    models.chat.behavior.replica_ids, models.chat.behavior.ranked = ["chat-1", "chat-2"], None
    models.code.behavior.replica_ids, models.code.behavior.ranked = ["code-1"], None
    with httpx.Client(base_url=models.url, timeout=10) as c:
        yield c


def assert_model_refused(response: httpx.Response, status: int, reason: str) -> str:
    """Refused by the frontend itself with the reason and an OpenAI-style error; returns the message."""
    assert response.status_code == status, response.text
    assert response.headers[SERVE_REASON_HEADER] == reason and REPLICA_HEADER not in response.headers
    assert response.headers["content-type"] == "application/json" and response.headers[REQUEST_ID_HEADER]
    error = response.json()["error"]
    assert error["code"] == status and error["type"] == "invalid_request_error"
    return error["message"]


def chat_body(model: str | None, filler: int = 0, **extra: object) -> dict[str, object]:
    """An OpenAI chat body with `model` after `messages`, as OpenAI clients send it."""
    body: dict[str, object] = {"messages": [{"role": "user", "content": "x" * filler or "hi"}], **extra}
    if model is not None:
        body["model"] = model
    return body


def test_each_request_goes_to_the_app_of_the_model_it_names(models: TwoModels, client: httpx.Client) -> None:
    for i in range(20):
        model, served = (CHAT, models.chat) if i % 2 == 0 else (CODE, models.code)
        calls = len(served.behavior.calls)
        response = client.post(CHAT_PATH, json=chat_body(model))
        assert response.status_code == 200, response.text
        replica = response.headers[REPLICA_HEADER]
        assert replica in {r.name for r in served.replicas}
        # Its own router pool was asked, under its route prefix and with its app's name.
        assert len(served.behavior.calls) == calls + 1
        _, call = served.behavior.calls[-1]
        assert call.path == served.app.router_route_prefix + ROUTE_PATH and call.header(APP_HEADER) == served.app.name
        # Its replicas serve vLLM's paths under its route prefix; the model header never reaches them.
        received = next(r for r in served.replicas if r.name == replica).requests[-1]
        assert received.path == served.app.replica_route_prefix + CHAT_PATH
        assert received.header(MODEL_HEADER) is None


def test_the_header_names_the_model_and_only_the_top_level_model_counts(
    models: TwoModels, client: httpx.Client
) -> None:
    response = client.post(CHAT_PATH, json=chat_body(CODE), headers={MODEL_HEADER: CHAT})
    assert response.status_code == 200 and response.headers[REPLICA_HEADER].startswith("chat-")
    nested = chat_body(CHAT, metadata={"model": CODE}, tools=[{"function": {"parameters": {"model": CODE}}}])
    response = client.post(CHAT_PATH, json=nested)
    assert response.status_code == 200 and response.headers[REPLICA_HEADER].startswith("chat-")
    # An escaped model name is read as JSON reads it.
    response = client.post(CHAT_PATH, content=b'{"model": "code\\u003av2", "messages": []}')
    assert response.status_code == 200 and response.headers[REPLICA_HEADER] == "code-1"


def test_an_unknown_or_missing_model_is_refused_before_any_route_call(models: TwoModels, client: httpx.Client) -> None:
    before, calls, posts = refusal_counts(models.haproxy.settings.prometheus_port), models.route_calls(), models.posts()
    message = assert_model_refused(client.post(CHAT_PATH, json=chat_body('gpt-4"o')), 404, REASON_MODEL_NOT_FOUND)
    assert CHAT in message and CODE in message and "gpt-4?o" in message
    response = client.post(CHAT_PATH, json=chat_body(CHAT), headers={MODEL_HEADER: "nope"})
    assert "`nope`" in assert_model_refused(response, 404, REASON_MODEL_NOT_FOUND)
    for body in (chat_body(None), {"model": {"name": CHAT}}, "not json"):
        message = assert_model_refused(client.post(CHAT_PATH, json=body), 400, REASON_MODEL_MISSING)
        assert MODEL_HEADER in message and CHAT in message
    assert (models.route_calls(), models.posts()) == (calls, posts)
    after = refusal_counts(models.haproxy.settings.prometheus_port)
    assert after[REASON_MODEL_NOT_FOUND] - before[REASON_MODEL_NOT_FOUND] == 2
    assert after[REASON_MODEL_MISSING] - before[REASON_MODEL_MISSING] == 3


def test_a_model_beyond_the_lookup_bytes_gets_a_4xx_naming_the_limit(models: TwoModels, client: httpx.Client) -> None:
    calls, posts = models.route_calls(), models.posts()
    late = chat_body(CODE, filler=LOOKUP_BYTES)
    message = assert_model_refused(client.post(CHAT_PATH, json=late), 400, REASON_MODEL_BEYOND_BUFFER)
    assert f"first {LOOKUP_BYTES} bytes" in message and "routing.body_buffer_bytes" in message
    assert (models.route_calls(), models.posts()) == (calls, posts)
    # The same body is served when the model comes first, or in the header.
    response = client.post(CHAT_PATH, json={"model": CODE, **late})
    assert response.status_code == 200 and response.headers[REPLICA_HEADER] == "code-1"
    assert first_event(response)["body_len"] > LOOKUP_BYTES
    response = client.post(CHAT_PATH, json=late, headers={MODEL_HEADER: CODE})
    assert response.status_code == 200 and response.headers[REPLICA_HEADER] == "code-1"


def test_models_lists_every_model_of_the_frontend(models: TwoModels, client: httpx.Client) -> None:
    gets = sum(1 for s in (models.chat, models.code) for r in s.replicas for q in r.requests if q.method == "GET")
    response = client.get(MODELS_PATH)
    assert response.status_code == 200
    assert [m["id"] for m in response.json()["data"]] == [CHAT, CODE]
    assert all(m["object"] == "model" and isinstance(m["created"], int) for m in response.json()["data"])
    assert gets == sum(
        1 for s in (models.chat, models.code) for r in s.replicas for q in r.requests if q.method == "GET"
    )
    # Other GETs go to the header's model, else to the first model.
    assert client.get("/health", headers={MODEL_HEADER: CODE}).headers[REPLICA_HEADER].startswith("code-")
    assert client.get("/health").headers[REPLICA_HEADER].startswith("chat-")


def test_a_router_can_never_send_a_request_to_another_models_replica(models: TwoModels, client: httpx.Client) -> None:
    models.code.behavior.ranked = ["chat-1"]
    posts = models.posts()
    response = client.post(CHAT_PATH, json=chat_body(CODE))
    assert_fail_closed(response, REASON_UNKNOWN_REPLICA_ID)
    assert models.posts() == posts


def test_a_refused_connection_passes_to_the_next_ranked_replica_of_the_same_model(
    models: TwoModels, client: httpx.Client
) -> None:
    code_2 = models.code.replicas[1]
    assert models.haproxy.runtime.show_stat()[(replica_backend(1), code_2.name)].up
    try:
        models.loop.run(code_2.stop())  # still UP in HAProxy: checks run every 10 s
        models.code.behavior.ranked = ["code-2", "code-1"]
        response = client.post(CHAT_PATH, json=chat_body(CODE))
        assert response.status_code == 200, response.text
        assert response.headers[REPLICA_HEADER] == "code-1" and response.headers[FALLBACK_RANK_HEADER] == "1"
        assert SERVE_REASON_HEADER not in response.headers
    finally:
        models.loop.run(code_2.start())
