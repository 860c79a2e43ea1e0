"""Traces across the path, without servers: the spec's `observability.tracing` and where the plan takes it, the
frontend's rendering with tracing on and off, W3C propagation, the router's decision span and the replica's."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import StatusCode
from pydantic import ValidationError

from base import agent_wire
from base.contracts import REQUEST_ID_HEADER, TRACEPARENT_HEADER
from base.route_wire import RouteReply
from base.tracing import Tracing, parent_context, traceparent
from builders.plan import build_plan, serve_config
from builders.specs import load_spec, parse_spec
from infra.haproxy.apps import AppRoute
from infra.haproxy.config import HAProxySettings
from infra.haproxy.haproxy_cfg import render_config
from infra.haproxy.lua import render_lua
from infra.haproxy.process import check_config, write_files
from infra.haproxy.spoe import render_spoe
from routers.core import Decision, ReplicaView
from services.frontend.app import FrontendArgs
from services.replica.llm_config import LLMAppConfig
from services.replica.middleware.tracing import SPAN_NAME as REPLICA_SPAN
from services.replica.middleware.tracing import TracingMiddleware
from services.router.http_app import build_router_app
from services.router.route_span import ATTR_CANDIDATES, ATTR_PICK, ATTR_REASON, ATTR_REFUSAL, RouteSpans
from services.router.settings import RouterAppArgs, RouterSettings, build_policy
from tests.support.router_service_client import route, unique_app, views

TEAMS = Path(__file__).resolve().parents[2] / "topologies" / "teams"
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
SAMPLED = f"00-{TRACE_ID}-00f067aa0ba902b7-01"
NOT_SAMPLED = f"00-{TRACE_ID}-00f067aa0ba902b7-00"


@pytest.fixture
def exported() -> tuple[TracerProvider, InMemorySpanExporter]:
    """A tracer provider of the test's own (ratio 0: only a sampled parent is traced) with its finished spans."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=ParentBased(TraceIdRatioBased(0.0)))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


# The settings.
def test_tracing_is_off_unless_a_receiver_is_named() -> None:
    assert not Tracing().enabled
    assert Tracing(otlp_endpoint="127.0.0.1:4317").url == "http://127.0.0.1:4317"
    assert Tracing(otlp_endpoint="http://collector.obs:4317").url == "http://collector.obs:4317"


@pytest.mark.parametrize("endpoint", ["https://collector:4317", "collector", "http://collector:4317/v1/traces"])
def test_a_receiver_that_is_no_plain_grpc_host_and_port_is_refused(endpoint: str) -> None:
    with pytest.raises(ValidationError, match="host:port"):
        Tracing(otlp_endpoint=endpoint)


def test_the_sample_ratio_is_a_share() -> None:
    with pytest.raises(ValidationError):
        Tracing(otlp_endpoint="127.0.0.1:4317", sample_ratio=1.5)


def test_a_team_file_s_tracing_reaches_the_routers_the_replicas_and_the_frontend() -> None:
    data = load_spec(TEAMS / "local-cpu.yaml").model_dump(mode="json", exclude_unset=True)
    data["observability"] = {"tracing": {"otlp_endpoint": "127.0.0.1:4317", "sample_ratio": 0.5}}
    apps = serve_config(build_plan(parse_spec(data)))["applications"]
    llm, router, frontend = apps
    tracing = Tracing(otlp_endpoint="127.0.0.1:4317", sample_ratio=0.5)
    assert LLMAppConfig.model_validate(llm["args"]).tracing == tracing
    assert LLMAppConfig.model_validate(llm["args"]).traced_engine().extra_args["otlp_traces_endpoint"] == tracing.url
    assert RouterAppArgs.model_validate(router["args"]).settings.tracing == tracing
    assert FrontendArgs.model_validate(frontend["args"]).haproxy["tracing"] is True


def test_without_tracing_the_plan_traces_nothing() -> None:
    apps = serve_config(build_plan(load_spec(TEAMS / "local-cpu.yaml")))["applications"]
    config = LLMAppConfig.model_validate(apps[0]["args"])
    assert not config.tracing.enabled and "otlp_traces_endpoint" not in config.traced_engine().extra_args
    assert FrontendArgs.model_validate(apps[-1]["args"]).haproxy["tracing"] is False


# The frontend.
def _settings(tmp_path: Path, **extra: Any) -> HAProxySettings:
    return HAProxySettings(workdir=tmp_path, apps=[AppRoute(name="llm")], port=18000, prometheus_port=18404, **extra)


def test_without_tracing_the_frontend_renders_as_before(tmp_path: Path) -> None:
    off, default = _settings(tmp_path, tracing=False), _settings(tmp_path)
    assert render_config(off) == render_config(default) and render_spoe(off) == render_spoe(default)
    assert TRACEPARENT_HEADER not in render_spoe(off)
    assert "local TRACING = false" in render_lua(off)


def test_a_tracing_frontend_hands_the_traceparent_to_the_agent_and_is_valid_haproxy(tmp_path: Path) -> None:
    on = _settings(tmp_path, tracing=True)
    spoe = render_spoe(on)
    assert f"{TRACEPARENT_HEADER}=req.fhdr({TRACEPARENT_HEADER})" in spoe
    assert f" {agent_wire.TRACE_VAR}" in spoe.split("register-var-names", 1)[1].split("\n", 1)[0]
    assert "local TRACING = true" in render_lua(on)
    write_files(on)
    assert "Configuration file is valid" in check_config(on)


def test_the_route_answer_carries_a_traceparent_only_when_traced() -> None:
    reply = RouteReply(replica_id="r1")
    assert "traceparent" not in reply.wire_json()
    assert agent_wire.answer_variables(200, reply)[agent_wire.TRACE_VAR] is None
    traced = reply.model_copy(update={"traceparent": SAMPLED})
    assert f'"traceparent":"{SAMPLED}"' in traced.wire_json()
    assert agent_wire.answer_variables(200, traced)[agent_wire.TRACE_VAR] == SAMPLED


# Propagation.
def test_a_span_s_traceparent_makes_the_next_hop_its_child(exported: tuple[TracerProvider, Any]) -> None:
    provider, _ = exported
    span = provider.get_tracer("t").start_span("s", context=parent_context({TRACEPARENT_HEADER: SAMPLED}))
    header = traceparent(span)
    assert header is not None and header.startswith(f"00-{TRACE_ID}-") and header.endswith("-01")
    assert header.split("-")[2] == format(span.get_span_context().span_id, "016x")


def test_a_malformed_traceparent_starts_a_new_trace(exported: tuple[TracerProvider, Any]) -> None:
    provider, _ = exported
    span = provider.get_tracer("t").start_span("s", context=parent_context({TRACEPARENT_HEADER: "garbage"}))
    header = traceparent(span)
    assert header is not None and TRACE_ID not in header
    assert int(header.rsplit("-", 1)[1], 16) & 1 == 0  # ratio 0: not sampled


# The router's decision span.
def _view(replica_id: str) -> ReplicaView:
    return ReplicaView(replica_id=replica_id, in_flight=0, capacity=8)


def test_a_decision_is_a_child_span_with_its_candidates_pick_and_reason(
    exported: tuple[TracerProvider, InMemorySpanExporter],
) -> None:
    provider, exporter = exported
    spans = RouteSpans(provider.get_tracer("t"), "llm", "round_robin")
    views = [_view("a"), _view("b")]
    span = spans.start({TRACEPARENT_HEADER: SAMPLED, REQUEST_ID_HEADER: "req-1"})
    decision = Decision(ranking=[[views[1]], [views[0]]], reason="rotation")
    reply = spans.picked(span, views, decision, RouteReply(replica_id="b", fallbacks=["a"]))
    (finished,) = exporter.get_finished_spans()
    assert format(finished.context.trace_id, "032x") == TRACE_ID
    assert finished.parent is not None and format(finished.parent.span_id, "016x") == "00f067aa0ba902b7"
    attributes = finished.attributes or {}
    assert (attributes[ATTR_CANDIDATES], attributes[ATTR_PICK], attributes[ATTR_REASON]) == (2, "b", "rotation")
    assert reply.traceparent == traceparent(span) and reply.replica_id == "b"


def test_a_refusal_ends_its_span_as_an_error(exported: tuple[TracerProvider, InMemorySpanExporter]) -> None:
    provider, exporter = exported
    spans = RouteSpans(provider.get_tracer("t"), "llm", "round_robin")
    RouteSpans.refused(spans.start({TRACEPARENT_HEADER: SAMPLED}), [], "no_replica")
    (finished,) = exporter.get_finished_spans()
    assert finished.status.status_code == StatusCode.ERROR and (finished.attributes or {})[ATTR_REFUSAL] == "no_replica"


def test_an_unsampled_request_exports_no_decision_yet_passes_its_trace_on(
    exported: tuple[TracerProvider, InMemorySpanExporter],
) -> None:
    provider, exporter = exported
    spans = RouteSpans(provider.get_tracer("t"), "llm", "round_robin")
    span = spans.start({TRACEPARENT_HEADER: NOT_SAMPLED})
    reply = spans.picked(span, [_view("a")], Decision(ranking=[[_view("a")]], reason="r"), RouteReply(replica_id="a"))
    assert exporter.get_finished_spans() == ()
    assert reply.traceparent is not None and reply.traceparent.startswith(f"00-{TRACE_ID}-")
    assert int(reply.traceparent.rsplit("-", 1)[1], 16) & 1 == 0


def test_the_http_route_call_answers_its_decision_s_traceparent(
    exported: tuple[TracerProvider, InMemorySpanExporter],
) -> None:
    provider, exporter = exported
    settings = RouterSettings(target_app=unique_app())
    spans = RouteSpans(provider.get_tracer("t"), settings.target_app, settings.policy)
    app = build_router_app(settings, build_policy(settings), lambda: views(), spans=spans)

    async def call() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as client:
            return await route(client, traceparent=SAMPLED)

    response = asyncio.run(call())
    (finished,) = exporter.get_finished_spans()
    assert response.status_code == 200
    assert response.json()["traceparent"] == f"00-{TRACE_ID}-{finished.context.span_id:016x}-01"
    assert (finished.attributes or {})[ATTR_PICK] == response.json()["replica_id"]


# The replica's request span.
def _call(middleware: TracingMiddleware, method: str, headers: dict[str, str]) -> dict[str, str]:
    """Run one request through the middleware; the headers the app saw."""
    seen: dict[str, str] = {}

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        seen.update({k.decode(): v.decode() for k, v in scope["headers"]})
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok", "more_body": False})

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        return None

    scope = {
        "type": "http",
        "method": method,
        "path": "/v1/completions",
        "headers": [(k.encode(), v.encode()) for k, v in headers.items()],
    }
    middleware.app = app
    asyncio.run(middleware(scope, receive, send))
    return seen


def test_the_replica_s_span_is_the_parent_of_what_the_engine_sees(
    exported: tuple[TracerProvider, InMemorySpanExporter],
) -> None:
    provider, exporter = exported
    middleware = TracingMiddleware(None, provider.get_tracer("t"), "replica-1")  # type: ignore[arg-type]
    seen = _call(middleware, "POST", {TRACEPARENT_HEADER: SAMPLED})
    (finished,) = exporter.get_finished_spans()
    assert finished.name == REPLICA_SPAN and format(finished.context.trace_id, "032x") == TRACE_ID
    assert seen[TRACEPARENT_HEADER] == f"00-{TRACE_ID}-{finished.context.span_id:016x}-01"


def test_a_health_check_without_a_traceparent_is_no_span(
    exported: tuple[TracerProvider, InMemorySpanExporter],
) -> None:
    provider, exporter = exported
    middleware = TracingMiddleware(None, provider.get_tracer("t"), "replica-1")  # type: ignore[arg-type]
    assert TRACEPARENT_HEADER not in _call(middleware, "GET", {})
    assert exporter.get_finished_spans() == ()
