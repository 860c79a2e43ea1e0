"""The `--json` outputs are objects with a published schema: a status report's replicas are `{id, host, port, rank}`,
its state an enum with the reasons beside it, the canary a state; a check verdict lists every item. The old shapes
(replicas as "id host:port" strings, the state as prose) fail the schema."""

from __future__ import annotations

import copy
import json
from typing import Any

import jsonschema
import pytest

from sluice.deploy.check.checklist import Item, report, verdict
from sluice.deploy.json_reports import CanaryState, StackState, canary_state, check_schema, status_schema

STATUS: dict[str, Any] = {
    "stack": "platform-local-cpu",
    "described_from": "the deployment record (topologies/teams/local-cpu.yaml)",
    "state": "degraded",
    "reasons": ["1 of 2 LLM replicas running"],
    "differences": [],
    "apps": {
        "platform-local-cpu-llm": {
            "role": "replicas of sluice-tiny",
            "status": "RUNNING",
            "replicas": [{"id": "abc123", "host": "127.0.0.1", "port": 8100, "rank": None}],
        }
    },
    "models": {"sluice-tiny": {"routers": {"policy": "round_robin", "policy_kwargs": {}}, "planned_policy": "rr"}},
    "pairs": {},
    "frontend": {"running": True, "servers": []},
    "ingress": {"mode": "direct", "direct_weight": 100},
    "canary": {"state": "none", "direct_weight": 100, "summary": None},
}


def test_a_status_report_validates_and_its_state_and_replicas_are_structured() -> None:
    jsonschema.validate(STATUS, status_schema())
    listed = {"stacks": [{"stack": "s", "source": "f.yaml", "deployed_at": 1.0, "apps": {"s-llm": "RUNNING"}}]}
    jsonschema.validate(listed, status_schema())


@pytest.mark.parametrize(
    ("path", "old_value"),
    [
        (("apps", "platform-local-cpu-llm", "replicas"), ["abc123 127.0.0.1:8100"]),
        (("state",), "degraded: 1 of 2 LLM replicas running"),
        (("canary",), "canary running: 30% of sessions on the direct path"),
    ],
)
def test_the_old_prose_shapes_fail_the_schema(path: tuple[str, ...], old_value: Any) -> None:
    document = copy.deepcopy(STATUS)
    parent = document
    for key in path[:-1]:
        parent = parent[key]
    parent[path[-1]] = old_value
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(document, status_schema())


def test_the_canary_state_follows_the_frontends_ingress() -> None:
    assert canary_state(None) == CanaryState.NONE
    assert canary_state({"direct_weight": 30, "abort": None}) == CanaryState.RUNNING
    assert canary_state({"direct_weight": 100, "abort": None}) == CanaryState.NONE
    assert canary_state({"direct_weight": 0, "abort": {"breach": {}}}) == CanaryState.ROLLED_BACK
    assert {state.value for state in StackState} == {"ready", "degraded"}


def test_check_json_output_validates_against_its_schema(capsys: pytest.CaptureFixture[str]) -> None:
    items = [Item("versions", True, "ray 2.60.0"), Item("fault injection", None, "not staging", "staging: true")]
    code = report(items, as_json=True)
    printed = json.loads(capsys.readouterr().out)
    jsonschema.validate(printed, check_schema())
    assert printed == json.loads(json.dumps(verdict(items), default=str)) and code == 4
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**printed, "verdict": "PASS"}, check_schema())
