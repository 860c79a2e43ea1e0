"""What a stack ships for Prometheus and Grafana, without servers: the dashboard's shape and metric names, the
rendered scrape config, the frontend's discovery and counters in the HAProxy config and Lua, the syncer's router
targets, and the ledger's metrics."""

from __future__ import annotations

import asyncio
import json
import re
from itertools import combinations
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from base.contracts import CANARY_CRITERIA
from infra.haproxy.apps import AppRoute
from infra.haproxy.canary import ROLLBACK_COUNTER, ROLLBACK_TABLE
from infra.haproxy.config import (
    PROMETHEUS_PATH,
    ROUTER_BACKEND,
    SLUICE_METRICS_PATH,
    UNROUTED_TABLE,
    HAProxySettings,
)
from infra.haproxy.haproxy_cfg import render_config
from infra.haproxy.lua import LUA_TEMPLATE, render_lua
from infra.haproxy.spoe import AGENT_BACKEND
from infra.observability import DASHBOARD_PATH, PLATFORM_DASHBOARD_PATH
from infra.observability.dashboard import Dashboard, GridPos, load_dashboard, metric_names
from infra.observability.targets import METRICS_PATH, ROUTER_TARGETS_BACKEND, TARGETS_PATH, router_targets_backend
from infra.prometheus_config import (
    JOB_FRONTEND,
    JOB_HAPROXY,
    JOB_REPLICAS,
    JOB_ROUTERS,
    metrics_address,
    prometheus_config,
    render_prometheus_config,
)
from routers.capacity_ledger import CapacityLedger
from routers.capacity_queue import CapacityQueue, LocalLedgerClient
from routers.metrics import LEDGER_METRICS, LedgerMetrics
from services.router.settings import RouterSettings
from services.serve_internals import ReplicaEndpoint
from tests.support.router_service_client import REPLICA_IDS, route, router, unique_app, views
from tests.support.syncer_fakes import FakeRuntime, endpoint, make_syncer

ROOT = Path(__file__).resolve().parents[2]


def two_apps(tmp_path: Path, bind_host: str = "127.0.0.1") -> HAProxySettings:
    apps = [
        AppRoute(name="chat", model="chat", router_route_prefix="/chat-router", replica_route_prefix="/chat"),
        AppRoute(name="code", model="code", router_route_prefix="/code-router", replica_route_prefix="/code"),
    ]
    return HAProxySettings(workdir=tmp_path, apps=apps, bind_host=bind_host, port=18000, prometheus_port=18404)


# The dashboard.
def test_the_dashboard_is_valid_grafana_json_over_the_datasource_variable() -> None:
    raw = json.loads(DASHBOARD_PATH.read_text())
    dashboard = load_dashboard()
    assert dashboard.schema_version == 39 and raw["uid"] == dashboard.uid
    for panel in dashboard.panels:
        for target in panel.targets:
            assert target.datasource.uid == "${DS_PROMETHEUS}" and target.expr.strip()
    # No two panels share a cell of the grid.
    cells = [(p.title, p.grid_pos) for p in dashboard.panels]
    for (a, pa), (b, pb) in combinations(cells, 2):
        apart = pa.x + pa.w <= pb.x or pb.x + pb.w <= pa.x or pa.y + pa.h <= pb.y or pb.y + pb.h <= pa.y
        assert apart, f"{a!r} overlaps {b!r}"


def test_the_dashboard_model_refuses_what_grafana_could_not_show() -> None:
    raw = json.loads(DASHBOARD_PATH.read_text())
    first = next(p for p in raw["panels"] if p["type"] != "row")
    broken = [
        {**raw, "panels": raw["panels"] + [first]},  # a repeated panel id
        {**raw, "panels": [{**first, "targets": [{**first["targets"][0], "expr": ""}]}]},
        {**raw, "panels": [{**first, "targets": []}]},
        {**raw, "templating": {"list": []}},  # no datasource variable
        {**raw, "panels": [{**first, "datasource": {"type": "prometheus", "uid": "my-prom"}}]},
    ]
    for dashboard in broken:
        with pytest.raises(ValidationError):
            Dashboard.model_validate(dashboard)
    with pytest.raises(ValidationError, match="past the grid"):
        GridPos(h=8, w=12, x=18, y=0)


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        (
            'histogram_quantile(0.95, sum by (le) (rate(vllm:time_to_first_token_seconds_bucket{app=~"$app"}[5m])))',
            {"vllm:time_to_first_token_seconds_bucket"},
        ),
        ("sum(rate(a_total[$__rate_interval])) by (reason) / ignoring(x) b", {"a_total", "b"}),
        ('max by (app, replica) (ledger{state="held", le="1"}) offset 1h', {"ledger"}),
        ("rate(x[1m]) > bool 0 and on(instance) up_total or vector(1)", {"x", "up_total"}),
        ('label_replace(m, "dst", "$1", \'src\', "(.*)")', {"m"}),
        ("1e3 * sum without (instance) (y:recorded)", {"y:recorded"}),
    ],
)
def test_metric_names_are_read_from_selectors_only(expr: str, names: set[str]) -> None:
    assert metric_names(expr) == names


def test_every_sluice_metric_the_dashboard_queries_is_defined_in_sluice() -> None:
    """sluice's own names are checked against the code here; the integration test checks every name (vLLM's and
    HAProxy's too) against a running stack."""
    queried = set().union(*(metric_names(expr) for expr in load_dashboard().exprs()))
    sources = "".join(
        path.read_text() for folder in ("routers", "services", "infra") for path in (ROOT / folder).rglob("*.py")
    )
    sources += LUA_TEMPLATE.template
    for name in sorted(n for n in queried if n.startswith("sluice_")):
        family = re.sub(r"_(total|bucket|sum|count)$", "", name)  # a counter's or a histogram's series
        assert f'"{family}"' in sources or f'"{name}"' in sources, name
    assert {n.split("_")[0].split(":")[0] for n in queried} == {"sluice", "vllm", "haproxy"}


# The scrape config.
def test_the_rendered_prometheus_config_scrapes_the_frontend_and_discovers_the_rest(tmp_path: Path) -> None:
    settings = two_apps(tmp_path, bind_host="10.0.0.5")
    text = render_prometheus_config([metrics_address(settings), "10.0.0.6:8404"], scrape_interval_s=5)
    config = yaml.safe_load(text)
    assert config["global"] == {"scrape_interval": "5s", "scrape_timeout": "5s", "evaluation_interval": "5s"}
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert list(jobs) == [JOB_HAPROXY, JOB_FRONTEND, JOB_ROUTERS, JOB_REPLICAS]
    frontends = ["10.0.0.5:18404", "10.0.0.6:8404"]
    assert jobs[JOB_HAPROXY]["metrics_path"] == PROMETHEUS_PATH
    assert jobs[JOB_FRONTEND]["metrics_path"] == SLUICE_METRICS_PATH
    for job in (JOB_HAPROXY, JOB_FRONTEND):
        assert jobs[job]["static_configs"] == [{"targets": frontends}]
    for job, role in ((JOB_ROUTERS, "router"), (JOB_REPLICAS, "replica")):
        assert jobs[job]["http_sd_configs"] == [
            {"url": f"http://{f}{TARGETS_PATH}?role={role}", "refresh_interval": "5s"} for f in frontends
        ]
    assert prometheus_config(["h:1"], scrape_interval_s=60)["global"]["scrape_timeout"] == "10s"
    with pytest.raises(ValueError):
        prometheus_config([])


# The frontend: metrics port, discovery, fail-closed counter.
def test_the_metrics_frontend_listens_on_the_bind_host_and_serves_the_discovery(tmp_path: Path) -> None:
    config = render_config(two_apps(tmp_path, bind_host="10.0.0.5"))
    metrics = config[config.index("frontend sluice_prometheus") : config.index("frontend sluice_http")]
    assert "bind 10.0.0.5:18404" in metrics
    assert f"http-request use-service lua.sluice_targets if {{ path {TARGETS_PATH} }}" in metrics
    # Each app's routers are kept thrice: at Serve's port and at their agents (both checked), and as targets.
    for index in range(2):
        assert f"backend {router_targets_backend(index)}\n" in config
    assert router_targets_backend(0) == ROUTER_TARGETS_BACKEND != ROUTER_BACKEND


def test_fail_closed_503s_are_counted_by_reason_in_both_frontends(tmp_path: Path) -> None:
    config = render_config(two_apps(tmp_path))
    assert f"backend {UNROUTED_TABLE}\n    #" in config
    for frontend in ("frontend sluice_http", "frontend sluice_retry"):
        section = config[config.index(frontend) :].split("\n\n")[0].splitlines()
        track = next(i for i, line in enumerate(section) if f"table {UNROUTED_TABLE}" in line)
        answer = next(i for i, line in enumerate(section) if "http-request return status 503" in line)
        assert track == answer - 1
        assert section[track].split(" if ")[1] == section[answer].split(" if ")[1]


def test_the_lua_lists_each_app_s_targets_with_its_metrics_path(tmp_path: Path) -> None:
    lua = render_lua(two_apps(tmp_path))
    assert 'core.register_service("sluice_targets", "http"' in lua
    assert 'router_targets_backend = "sluice_router_targets_1"' in lua
    assert 'router_metrics_path = "/chat-router/metrics"' in lua and 'replica_metrics_path = "/code/metrics"' in lua
    assert '"sluice_frontend_unrouted_total"' in lua and 'local UNROUTED_TABLE = "sluice_unrouted"' in lua


def test_the_canary_s_automatic_rollbacks_are_a_counter_by_criterion_read_from_a_table_the_frontend_sets(
    tmp_path: Path,
) -> None:
    config = render_config(two_apps(tmp_path))
    table = config[config.index(f"backend {ROLLBACK_TABLE}\n") :].split("\n\n")[0]
    assert f"store {ROLLBACK_COUNTER}" in table
    assert f"table {ROLLBACK_TABLE}" not in config.replace(f"backend {ROLLBACK_TABLE}", "")  # no request tracks it
    lua = render_lua(two_apps(tmp_path))
    reasons = ", ".join(f'"{c}"' for c in CANARY_CRITERIA)
    assert f"local ROLLBACK_REASONS = {{{reasons}}}" in lua
    assert f'local ROLLBACK_TABLE = "{ROLLBACK_TABLE}"' in lua
    assert f'local ROLLBACK_COUNTER = "{ROLLBACK_COUNTER}"' in lua
    assert 'counter_lines(lines, "sluice_canary_rollbacks_total",' in lua


# The syncer keeps each router's Serve address for the discovery.
def test_the_syncer_keeps_each_router_s_serve_address_as_a_target(tmp_path: Path) -> None:
    runtime = FakeRuntime()
    router = ReplicaEndpoint(replica_id="r", deployment="d", host="127.0.0.1", port=2001, route_port=2999)
    routers = [router]
    now = [0.0]
    syncer = make_syncer(tmp_path, runtime, [endpoint("a", 1001)], routers, now)
    report = asyncio.run(syncer.sync_once())
    assert report.added == ["a", "r"], "a router is reported once"
    assert runtime.servers[(AGENT_BACKEND, "r")]["addr"] == "127.0.0.1:2999"
    assert runtime.servers[(ROUTER_BACKEND, "r")]["addr"] == "127.0.0.1:2001"
    target = runtime.servers[(ROUTER_TARGETS_BACKEND, "r")]
    assert (target["addr"], target["state"], target["options"]) == ("127.0.0.1:2001", "ready", [])
    # Listed when this HAProxy started: the router and its agent start UP (checked from then on); the target is
    # never checked.
    assert runtime.commands.count("health down r") == 0
    # The router is replaced on a new Serve port, then leaves: its target follows.
    routers[:] = [router.model_copy(update={"port": 2002})]
    now[0] = 1.0
    asyncio.run(syncer.sync_once())
    assert runtime.servers[(ROUTER_TARGETS_BACKEND, "r")]["addr"] == "127.0.0.1:2002"
    routers[:] = []
    for now[0] in (2.0, 3.0):
        asyncio.run(syncer.sync_once())
    assert (ROUTER_TARGETS_BACKEND, "r") not in runtime.servers
    # A restarted syncer adopts the targets like the other servers.
    routers[:] = [router]
    asyncio.run(syncer.sync_once())
    again = make_syncer(tmp_path, runtime, [endpoint("a", 1001)], routers, [4.0])
    assert not asyncio.run(again.sync_once()).changed
    assert set(again.apps[0].router_targets.live) == {"r"}


# The capacity ledger's metrics.
def test_the_ledger_metrics_export_tokens_held_and_free_per_replica() -> None:
    ledger = CapacityLedger(seed=0)
    ledger.set_replicas({"a": 2, "b": 1})
    token = asyncio.run(ledger.acquire(("a",), "req-1"))
    assert token is not None
    ledger.release(token.token_id)
    ledger.release(token.token_id)
    asyncio.run(ledger.acquire(("a",), "req-2"))
    metrics = LedgerMetrics()
    assert list(metrics.collect()) == []
    metrics.update("llm", ledger.snapshot())
    families = {family.name: family for family in metrics.collect()}
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value for family in families.values() for s in family.samples
    }
    assert samples[("sluice_ledger_tokens", (("app", "llm"), ("replica", "a"), ("state", "held")))] == 1
    assert samples[("sluice_ledger_tokens", (("app", "llm"), ("replica", "a"), ("state", "free")))] == 1
    assert samples[("sluice_ledger_tokens", (("app", "llm"), ("replica", "b"), ("state", "free")))] == 1
    assert samples[("sluice_ledger_waiting", (("app", "llm"),))] == 0
    events = {dict(k[1])["event"]: v for k, v in samples.items() if k[0] == "sluice_ledger_token_events_total"}
    assert events == {
        "granted": 2,
        "released": 1,
        "reaped": 0,
        "double_release": 1,
        "unknown_release": 0,
        "late_release": 0,
        "rejected": 0,
    }
    metrics.update("llm", None)  # the ledger did not answer this scrape: nothing stale is exported
    assert list(metrics.collect()) == []


def test_a_capacity_queue_router_exports_its_ledger_at_each_scrape() -> None:
    app = unique_app()
    settings = RouterSettings(target_app=app, target_capacity=2, policy="capacity_queue")
    ledger = CapacityLedger(seed=0)

    async def run() -> str:
        async with router(settings, views(REPLICA_IDS[:2], capacity=2), LocalLedgerClient(ledger)) as client:
            assert (await route(client)).status_code == 200
            return (await client.get(METRICS_PATH)).text

    text = asyncio.run(run())
    held = re.findall(rf'^sluice_ledger_tokens\{{app="{app}",replica="(\w+)",state="held"\}} (\S+)$', text, re.M)
    assert {replica for replica, _ in held} == set(REPLICA_IDS[:2])
    assert sum(float(count) for _, count in held) == 1  # the token the route call took
    LEDGER_METRICS.update(app, None)


def test_a_ledger_that_does_not_answer_is_no_decision_fault() -> None:
    class Down(LocalLedgerClient):
        async def snapshot(self) -> dict:
            raise TimeoutError

    policy = CapacityQueue(Down(CapacityLedger()))
    assert asyncio.run(policy.ledger_snapshot()) is None
    assert not policy.counts.events


def test_the_platform_dashboard_reads_only_the_platforms_counters_and_haproxys_own_series() -> None:
    """Its shape is checked on load; its sluice names are the platform's Lua counters (the standin-plane test reads
    every queried name off a running platform)."""
    queried = set().union(*(metric_names(expr) for expr in load_dashboard(PLATFORM_DASHBOARD_PATH).exprs()))
    lua = (ROOT / "infra" / "haproxy" / "platform_admission.lua.tmpl").read_text()
    for name in sorted(n for n in queried if n.startswith("sluice_")):
        assert f"{name}{{" in lua or f"{name} " in lua, name
    assert {name.split("_")[0] for name in queried} == {"sluice", "haproxy"}
