"""Shadow policies: each shadow's pick is scored on its own virtual caches (what it would have cached had it been
live), the live pick on the engines' index; the predicted hit counts as vLLM counts; a shadow's decisions stay off
the router's metrics; only policies that need neither a prompt nor a ledger may shadow; the report and its lines."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from builders.plan import build_plan
from builders.specs import parse_spec
from routers.core import ReplicaView, RouteRequest
from routers.metrics import DECISIONS_TOTAL, ENGINE_HIT_RATIO, PICK_SPREAD, PREDICTED_HIT_RATIO
from routers.registry import build_stateless_policy
from routers.shadows import ShadowPolicies, VirtualCaches, shadow_lines
from services.replica.llm_config import LLMAppConfig
from services.router.settings import RouterAppArgs, RouterSettings, build_shadows
from topologies.spec import SpecError

BLOCK = 4
VIEWS = tuple(ReplicaView(replica_id=r, capacity=64) for r in ("a", "b", "c", "d"))


def _tokens(body: bytes, read_on: object = None) -> list[int] | None:
    return json.loads(body)


def _request(tokens: list[int], n: int, session: str | None = None) -> RouteRequest:
    return RouteRequest(request_id=f"r{n}", session_id=session, body_prefix=json.dumps(tokens).encode())


def _shadows() -> ShadowPolicies:
    policies = {name: build_stateless_policy(name, {}) for name in ("round_robin", "consistent_hash")}
    shadow = ShadowPolicies("kv_aware", policies, _tokens)
    shadow.block_size = BLOCK
    return shadow


def test_a_sticky_shadow_is_predicted_to_hit_what_it_would_have_cached_and_round_robin_mostly_not() -> None:
    shadow = _shadows()
    conversation = list(range(40))
    for turn in range(8):
        # The live policy keeps the conversation on "a", whose engine holds every turn's prompt.
        prompt = conversation[: 8 + 4 * turn]
        shadow.index.stored("a", [f"a-{turn}-{i}" for i in range(99)], None, prompt, BLOCK)
        shadow.observe(VIEWS, _request(prompt, turn, session="s"), "a")
    report = shadow.report()
    assert report["predicted_hit"]["kv_aware"] > 0.6, "the live pick holds all but the new turn"
    assert report["predicted_hit"]["consistent_hash"] > 0.4, "one session, one ring point: it would have hit too"
    assert report["predicted_hit"]["round_robin"] < report["predicted_hit"]["consistent_hash"]
    assert report["spread"]["consistent_hash"] == 4.0, "every pick on one of four replicas"


def test_hits_count_as_vllm_counts_them_whole_blocks_and_never_the_last_token() -> None:
    caches = VirtualCaches(blocks=100)
    shadow = _shadows()
    prompt = list(range(8))
    shadow.index.stored("a", ["x", "y"], None, prompt, BLOCK)
    shadow.observe(VIEWS, _request(prompt, 0), "a")
    assert shadow.scores["kv_aware"].cached_tokens == 4, "8 tokens cached, 7 at most usable: one whole block"
    caches.stored("a", [1, 2, 3])
    assert caches.matched("a", [1, 2, 9]) == 2 and caches.matched("b", [1]) == 0


def test_a_virtual_cache_forgets_the_least_recently_used_blocks_past_its_size() -> None:
    caches = VirtualCaches(blocks=3)
    caches.stored("a", [1, 2])
    caches.stored("a", [3, 4])
    assert caches.matched("a", [1]) == 0 and caches.matched("a", [2, 3, 4]) == 3


def test_a_shadows_decisions_are_not_counted_as_the_routers() -> None:
    before = DECISIONS_TOTAL.labels("round_robin", "rotation")._value.get()
    shadow = _shadows()
    shadow.observe(VIEWS, _request(list(range(8)), 0), "a")
    assert shadow.shadows["round_robin"].counts.decisions.total() == 1
    assert DECISIONS_TOTAL.labels("round_robin", "rotation")._value.get() == before


def test_only_policies_without_a_prompt_or_a_ledger_may_shadow_and_shadows_need_the_models_files() -> None:
    with pytest.raises(ValidationError, match="kv_aware cannot shadow"):
        RouterSettings(target_app="llm", model_path="/m", shadow_policies=["kv_aware"])
    with pytest.raises(ValidationError, match="capacity_queue cannot shadow"):
        RouterSettings(target_app="llm", model_path="/m", shadow_policies=["capacity_queue"])
    with pytest.raises(ValidationError, match="give model_path"):
        RouterSettings(target_app="llm", shadow_policies=["round_robin"])
    with pytest.raises(ValidationError, match="unknown shadow policy"):
        RouterSettings(target_app="llm", model_path="/m", shadow_policies=["nearest"])
    assert build_shadows(RouterSettings(target_app="llm")) is None


def test_the_status_lines_name_each_policy_with_its_role() -> None:
    shadow = _shadows()
    shadow.observe(VIEWS, _request(list(range(8)), 0), "a")
    lines = shadow_lines(shadow.report())
    assert lines[0] == "hit ratio the engines report: none yet"
    assert lines[1].startswith("live kv_aware: predicted hit")
    assert [line.split()[0] for line in lines[2:]] == ["shadow", "shadow"]


TEAMS = Path(__file__).resolve().parents[2] / "topologies" / "teams"


def _team(**routing: object) -> dict:
    data = yaml.safe_load((TEAMS / "local-cpu.yaml").read_text())
    data["routing"].update(routing)
    return data


def test_a_team_file_with_shadow_policies_gives_its_routers_the_models_files_and_turns_the_events_on() -> None:
    apps = {
        app.name: app.args
        for app in build_plan(
            parse_spec(_team(forward_body=True, shadow_policies=["round_robin", "consistent_hash"]))
        ).apps
    }
    router = RouterAppArgs.model_validate(apps["platform-local-cpu-router"]).settings
    llm = LLMAppConfig.model_validate(apps["platform-local-cpu-llm"])
    assert router.shadow_policies == ["round_robin", "consistent_hash"]
    assert router.model_path == llm.engine.model
    assert "kv_events_config" in llm.engine.extra_args


@pytest.mark.parametrize(
    ("routing", "says"),
    [
        ({"forward_body": True, "shadow_policies": ["kv_aware"]}, "kv_aware cannot shadow"),
        ({"shadow_policies": ["round_robin"]}, "set routing.forward_body: true"),
        ({"forward_body": True, "kv_events": False, "shadow_policies": ["round_robin"]}, "drop routing.kv_events"),
        ({"forward_body": True, "shadow_policies": ["nearest"]}, "Input should be"),
    ],
)
def test_a_team_file_whose_shadows_cannot_run_is_refused_naming_the_field(routing: dict, says: str) -> None:
    with pytest.raises(SpecError) as refused:
        parse_spec(_team(**routing))
    assert "routing.shadow_policies" in str(refused.value) and says in str(refused.value)


def test_the_shadows_are_on_the_routers_metrics_by_policy_and_role() -> None:
    shadow = _shadows()
    prompt = list(range(12))
    shadow.index.stored("a", ["p", "q", "r"], None, prompt, BLOCK)
    shadow.observe(VIEWS, _request(prompt, 0), "a")
    shadow.engine_loads.reported("a", 0, 0, prefix_queries=100, prefix_hits=40)
    shadow.refresh_metrics("llm")
    assert PREDICTED_HIT_RATIO.labels("llm", "kv_aware", "live")._value.get() == pytest.approx(8 / 12, abs=1e-3)
    assert PREDICTED_HIT_RATIO.labels("llm", "round_robin", "shadow")._value.get() == 0.0
    assert PICK_SPREAD.labels("llm", "consistent_hash", "shadow")._value.get() == 4.0
    assert ENGINE_HIT_RATIO.labels("llm")._value.get() == 0.4
