"""`sluice status` in words: where a file and the running stack differ, and a canary's state."""

from __future__ import annotations

from pathlib import Path

from builders.plan import build_plan
from builders.specs import load_spec
from sluice.deploy.status import canary_line, differences, model_line

TEAMS = Path(__file__).resolve().parents[2] / "topologies" / "teams"


def test_the_running_policy_and_replicas_are_named_where_they_differ_from_the_file() -> None:
    file_spec = load_spec(TEAMS / "local-cpu.yaml")
    running = file_spec.model_copy(
        update={
            "routing": file_spec.routing.model_copy(update={"policy": "consistent_hash"}),
            "models": [file_spec.models[0].model_copy(update={"replicas": 3})],
        }
    )
    said = differences(file_spec, build_plan(file_spec), running, build_plan(running))
    assert "sluice-tiny: policy round_robin in the file, consistent_hash running" in said
    assert "sluice-tiny: min_replicas 2 in the file, 3 running" in said
    assert differences(file_spec, build_plan(file_spec), file_spec, build_plan(file_spec)) == []


def test_a_canary_that_rolled_back_by_itself_says_when_why_and_by_how_much() -> None:
    breach = {"criterion": "ratio_503", "value": 0.5, "threshold": 0.05}
    abort = {"at": 1_800_000_000.0, "app": "platform-canary-llm", "weight_before": 30, "breach": breach}
    line = canary_line({"direct_weight": 0, "declared_weight": 30, "abort": abort})
    assert line is not None and "ROLLED BACK" in line and "from weight 30%" in line
    assert "ratio_503 measured 0.500 over its limit 0.050" in line
    assert canary_line({"direct_weight": 30, "declared_weight": 30, "abort": None}) == (
        "canary running: 30% of sessions on the direct path"
    )
    assert canary_line({"direct_weight": 100, "declared_weight": 100, "abort": None}) is None


def test_a_kv_aware_routers_index_is_printed_under_its_model() -> None:
    plan = build_plan(load_spec(TEAMS / "kv-aware-cpu.yaml"))
    index = {
        "block_size": 16,
        "replicas": {"r1": {"source": "events", "blocks": 3}, "r2": {"source": "lost", "blocks": 0}},
        "decisions": {},
    }
    described = {"policy": "kv_aware", "policy_kwargs": {}, "prefill_policy": None, "kv_events": index}
    line = model_line(plan.models[0], described)
    assert line.endswith("\n    KV events (block size 16): r1 events (3 blocks), r2 lost (0 blocks)")
    empty = model_line(plan.models[0], {**described, "kv_events": {**index, "replicas": {}}})
    assert empty.endswith("KV events (block size 16): no replica yet")
    assert "KV events" not in model_line(plan.models[0], None)
