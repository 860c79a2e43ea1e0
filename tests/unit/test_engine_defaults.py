"""What a team file's engines get that no model shares: tool calling only where the spec asks, with the parser of the
model's family (or the one it names), and vLLM's JSON-valued arguments written as YAML, checked by vLLM's parser."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from base.tiny_model import TINY_TOOL_CALL_PARSER
from builders.specs import engine_problems, parse_spec
from topologies.problems import SpecError

TEAMS = Path(__file__).resolve().parents[2] / "topologies" / "teams"


def _team(engine: dict[str, Any], source: str = "tiny", name: str = "sluice-tiny") -> dict[str, Any]:
    return {
        "kind": "openai",
        "team": "platform",
        "name": "engine-defaults",
        "models": [{"name": name, "source": source, "engine": engine}],
    }


def _rendered_parsers(path: Path) -> list[str | None]:
    """Each LLM app's tool-call parser, as `sluice render` prints the Serve config."""
    rendered = subprocess.run(
        [sys.executable, "-m", "sluice.cli.main", "render", str(path)], capture_output=True, text=True, check=True
    )
    applications = yaml.safe_load(rendered.stdout)["applications"]
    return [app["args"]["engine"].get("tool_call_parser") for app in applications if "engine" in app["args"]]


def test_the_llama_chat_team_renders_llamas_tool_parser_not_hermes() -> None:
    assert _rendered_parsers(TEAMS / "gpu-chat-8b.yaml") == ["llama3_json"]


def test_tool_calling_is_off_unless_asked_but_the_tiny_models() -> None:
    hub_model = parse_spec(_team({}, source="org/some-model-7b", name="some-model")).models[0]  # type: ignore[attr-defined]
    assert hub_model.engine_config(hub_model.source).tool_call_parser is None
    assert "--tool-call-parser" not in hub_model.engine_config(hub_model.source).cli_args()
    tiny = parse_spec(_team({})).models[0]  # type: ignore[attr-defined]
    assert tiny.engine_config("/models/tiny").tool_call_parser == TINY_TOOL_CALL_PARSER
    named = parse_spec(_team({"tool_call_parser": "mistral"}, source="org/some-model-7b", name="m")).models[0]  # type: ignore[attr-defined]
    assert named.engine_config(named.source).tool_call_parser == "mistral"


def test_auto_refuses_a_family_it_does_not_know_naming_the_field() -> None:
    with pytest.raises(SpecError, match=r"tool_call_parser: auto knows no tool-call parser for 'org/some-model-7b'"):
        parse_spec(_team({"tool_call_parser": "auto"}, source="org/some-model-7b", name="some-model"))


def test_yaml_maps_for_vllms_json_arguments_validate_and_vllm_still_checks_them() -> None:
    spec = parse_spec(_team({"override_generation_config": {"temperature": 0.5}}))
    assert engine_problems(spec) == []
    refused = engine_problems(parse_spec(_team({"compilation_config": {"level": 0}})))
    assert [problem.path for problem in refused] == ["models[0].engine"]
    assert "CompilationConfig; level; Unexpected keyword" in refused[0].message


def test_auto_in_a_roles_engine_is_refused_naming_the_roles_field() -> None:
    spec = yaml.safe_load((TEAMS / "prefill-decode-cpu.yaml").read_text())
    spec["models"][0].update(name="some-model", source="org/some-model-7b")
    spec["models"][0]["decode"]["engine"] = {"tool_call_parser": "auto"}
    with pytest.raises(SpecError) as refused:
        parse_spec(spec)
    assert "models[0].decode.engine.tool_call_parser" in str(refused.value)
    assert "auto knows no tool-call parser for 'org/some-model-7b'" in str(refused.value)
    assert "models[0].prefill" not in str(refused.value), "the prefill role asked for no tool calling"
