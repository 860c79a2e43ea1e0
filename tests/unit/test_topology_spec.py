"""Team topology specs: every team file validates (engine arguments through vLLM's parser too), and each invalid spec
fails with its field path and a message that says what to change; the JSON Schema for editors agrees."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from builders.specs import engine_problems, load_spec, parse_spec, topology_json_schema
from sluice.cli.main import main
from topologies.problems import SpecError

TEAMS = sorted((Path(__file__).resolve().parents[2] / "topologies" / "teams").glob("*.yaml"))

BASE: dict[str, Any] = {
    "kind": "openai",
    "team": "platform",
    "name": "t",
    "models": [{"name": "sluice-tiny", "source": "tiny", "replicas": 1}],
}


def _with(path: str, value: Any) -> dict[str, Any]:
    """BASE with `value` set at a dotted path (digits index lists; None deletes the key)."""
    spec = copy.deepcopy(BASE)
    *parents, last = path.split(".")
    node: Any = spec
    for part in parents:
        node = node[int(part)] if part.isdigit() else node.setdefault(part, {})
    key: Any = int(last) if last.isdigit() else last
    if value is None:
        del node[key]
    else:
        node[key] = value
    return spec


def test_there_is_a_team_file_of_each_kind_and_two_models() -> None:
    specs = [load_spec(path) for path in TEAMS]
    assert {spec.kind for spec in specs} == {"openai", "data_parallel", "prefill_decode"}
    assert any(len(spec.models) >= 2 for spec in specs if spec.kind == "openai")
    assert "local-cpu.yaml" in {path.name for path in TEAMS}


@pytest.mark.parametrize("path", TEAMS, ids=lambda p: p.name)
def test_every_team_file_validates_with_vllms_parser_and_the_json_schema(path: Path) -> None:
    spec = load_spec(path)
    assert engine_problems(spec) == []
    jsonschema.validate(yaml.safe_load(path.read_text()), topology_json_schema())


INVALID = [
    ("unknown top-level key", _with("replica", 2), "replica", "unknown key"),
    ("no kind", _with("kind", None), "kind", "one of openai, data_parallel, prefill_decode"),
    ("unknown kind", _with("kind", "mixture"), "kind", "unknown kind"),
    ("no team", _with("team", None), "team", "required"),
    ("team not an identifier", _with("team", "Team A"), "team", "lower-case letters"),
    ("no models", _with("models", []), "models", "list at least one"),
    ("model without source", _with("models.0.source", None), "models[0].source", "required"),
    ("served name with a space", _with("models.0.name", "my model"), "models[0].name", "not a served model name"),
    ("zero replicas", _with("models.0.replicas", 0), "models[0].replicas", "greater than or equal to 1"),
    (
        "replicas and autoscaling",
        _with("models.0.autoscaling", {"max_replicas": 3}),
        "models[0]",
        "either replicas",
    ),
    (
        "autoscaling bounds",
        _with("models.0", {"name": "m", "source": "tiny", "autoscaling": {"min_replicas": 4, "max_replicas": 2}}),
        "models[0].autoscaling",
        "lower min_replicas",
    ),
    (
        "accelerator without gpus",
        _with("models.0.resources", {"accelerator_type": "H100"}),
        "models[0].resources",
        "needs gpus > 0",
    ),
    ("negative gpus", _with("models.0.resources", {"gpus": -1}), "models[0].resources.gpus", "greater than or equal"),
    ("unknown policy", _with("routing.policy", "random"), "routing.policy", "round_robin"),
    (
        "unknown policy kwarg",
        _with("routing", {"policy": "consistent_hash", "policy_kwargs": {"replicas_per_node": 3}}),
        "routing.policy_kwargs",
        "replicas_per_node",
    ),
    (
        "user affinity without the body",
        _with("routing", {"policy": "consistent_hash", "policy_kwargs": {"user_affinity": True}}),
        "routing.policy_kwargs.user_affinity",
        "set routing.forward_body: true",
    ),
    (
        "per-model user affinity without the body",
        _with("models.0.routing", {"policy": "consistent_hash", "policy_kwargs": {"user_affinity": True}}),
        "models[0].routing.policy_kwargs.user_affinity",
        "forward_body",
    ),
    (
        "internal session header",
        _with("routing.session_header", "x-sluice-session"),
        "routing.session_header",
        "strips",
    ),
    ("fail mode", _with("routing.fail_mode", "fallback"), "routing.fail_mode", "'closed' or 'open'"),
    ("route timeout", _with("routing.route_timeout_s", 0), "routing.route_timeout_s", "greater than 0"),
    ("same ports", _with("frontend", {"port": 9000, "metrics_port": 9000}), "frontend", "metrics_port equals port"),
    ("no router", _with("frontend.routers", 0), "frontend.routers", "greater than or equal to 1"),
    (
        "buffer over the body limit",
        _with("routing", {"forward_body": True, "body_buffer_bytes": 2_000_000})
        | {"frontend": {"protection": {"max_body_bytes": 1_000_000}}},
        "routing.body_buffer_bytes",
        "lower the buffer or raise the maximum",
    ),
    (
        "api keys from both",
        _with("frontend.protection", {"api_keys": {"file": "/k", "env": "K"}}),
        "frontend.protection.api_keys",
        "exactly one",
    ),
    (
        "duplicate model names",
        _with("models", [BASE["models"][0], BASE["models"][0]]),
        "models[1].name",
        "already models[0]",
    ),
    (
        "data parallel without its section",
        _with("kind", "data_parallel"),
        "models[0].data_parallel",
        "required",
    ),
    (
        "ranks autoscaled",
        _with("kind", "data_parallel")
        | {
            "models": [
                {
                    "name": "m",
                    "source": "tiny",
                    "data_parallel": {"mode": "ranks", "size": 2},
                    "autoscaling": {"max_replicas": 2},
                }
            ]
        },
        "models[0].autoscaling",
        "gang of fixed size",
    ),
    (
        "prefill/decode without decode",
        _with("kind", "prefill_decode") | {"models": [{"name": "m", "source": "tiny", "prefill": {"replicas": 1}}]},
        "models[0].decode",
        "required",
    ),
    (
        "unknown KV connector",
        _with("kind", "prefill_decode")
        | {
            "models": [
                {
                    "name": "m",
                    "source": "tiny",
                    "prefill": {},
                    "decode": {},
                    "kv_transfer": {"connector": "Mooncake"},
                }
            ]
        },
        "models[0].kv_transfer.connector",
        "NixlConnector",
    ),
    (
        "capacity tokens on the prefill side (inherited from the stack)",
        _with("kind", "prefill_decode")
        | {
            "routing": {"policy": "capacity_queue"},
            "models": [{"name": "m", "source": "tiny", "prefill": {}, "decode": {}}],
        },
        "models[0].prefill.routing.policy",
        "takes no capacity tokens",
    ),
]


@pytest.mark.parametrize(("data", "path", "message"), [case[1:] for case in INVALID], ids=[c[0] for c in INVALID])
def test_invalid_specs_name_the_field_and_the_fix(data: dict, path: str, message: str) -> None:
    with pytest.raises(SpecError) as refused:
        parse_spec(data)
    problems = {problem.path: problem.message for problem in refused.value.problems}
    assert path in problems, problems
    assert message in problems[path]


def test_engine_arguments_are_checked_by_vllm() -> None:
    spec = parse_spec(_with("models.0.engine", {"max_model_len": 512, "no_such_flag": 1}))
    (problem,) = engine_problems(spec)
    assert problem.path == "models[0].engine" and "--no-such-flag" in problem.message


def test_a_yaml_error_names_its_line(tmp_path: Path) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text("kind: openai\nteam: [platform\n")
    with pytest.raises(SpecError, match=r"(?s)broken\.yaml: 1 problem.*line 3, column 1: not valid YAML"):
        load_spec(path)


def test_the_cli_validates_and_prints_the_schema(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", str(TEAMS[0])]) == 0
    assert "valid" in capsys.readouterr().out
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(_with("models.0.replicas", 0)))
    assert main(["validate", str(bad)]) == 1
    assert "models[0].replicas: Input should be greater than or equal to 1" in capsys.readouterr().err
    assert main(["schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    jsonschema.Draft202012Validator.check_schema(schema)
    assert set(schema["discriminator"]["mapping"]) == {"openai", "data_parallel", "prefill_decode"}


def test_a_relative_key_file_is_relative_to_the_spec(tmp_path: Path) -> None:
    data = _with("frontend", {"protection": {"api_keys": {"file": "keys/team.txt"}}})
    (tmp_path / "specs").mkdir()
    path = tmp_path / "specs" / "stack.yaml"
    path.write_text(yaml.safe_dump(data))
    keys = load_spec(path).frontend.protection.api_keys
    assert keys is not None and keys.file == (tmp_path / "specs" / "keys" / "team.txt").resolve()


def _schema_keys(node: Any) -> set[str]:
    keys: set[str] = set()
    if isinstance(node, dict):
        keys |= set(node.get("properties", {}))
        for value in node.values():
            keys |= _schema_keys(value)
    elif isinstance(node, list):
        for value in node:
            keys |= _schema_keys(value)
    return keys


def test_the_spec_reference_lists_every_key() -> None:
    page = (Path(__file__).resolve().parents[2] / "docs" / "specs.md").read_text()
    section = page[page.index("## Spec reference") : page.index("## Ray's direct streaming")]
    documented = {word for token in re.findall(r"`([^`]+)`", section) for word in re.split(r"[.\[\] ]+", token)}
    assert _schema_keys(topology_json_schema()) - documented == set()


def test_the_schema_describes_every_field_for_an_editor() -> None:
    # Each field's docstring in its model is its description (`base.spec_config`): an editor shows it beside the key.
    fields = [
        (name, key, prop)
        for name, model in topology_json_schema()["$defs"].items()
        for key, prop in model.get("properties", {}).items()
    ]
    assert len(fields) >= 100
    assert [f"{name}.{key}" for name, key, prop in fields if not prop.get("description")] == []
