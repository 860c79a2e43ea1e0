"""The tool-call parser of a model's family, as vLLM's docs pair them, for `tool_call_parser: auto`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.replica.tool_parsers import family_tool_call_parser


@pytest.mark.parametrize(
    ("source", "parser"),
    [
        ("meta-llama/Llama-3.1-8B-Instruct", "llama3_json"),
        ("meta-llama/Llama-3.3-70B-Instruct", "llama3_json"),
        ("meta-llama/Llama-4-Scout-17B-16E-Instruct", "llama4_pythonic"),
        ("Qwen/Qwen3-30B-A3B", "hermes"),
        ("Qwen/Qwen2.5-7B-Instruct", "hermes"),
        ("Qwen/Qwen3-Coder-30B-A3B-Instruct", "qwen3_coder"),
        ("NousResearch/Hermes-3-Llama-3.1-8B", "hermes"),
        ("mistralai/Mistral-7B-Instruct-v0.3", "mistral"),
        ("ibm-granite/granite-3.1-8b-instruct", "granite"),
        ("openai/gpt-oss-20b", "openai"),
        ("some-org/unknown-model", None),
    ],
)
def test_a_hub_id_names_its_familys_parser(source: str, parser: str | None) -> None:
    assert family_tool_call_parser(source) == parser


def test_a_local_folder_is_read_by_its_config(tmp_path: Path) -> None:
    # A folder's name says nothing; Llama 3.x announces its RoPE type, Qwen its model type.
    llama, qwen = tmp_path / "weights-a", tmp_path / "weights-b"
    for folder, config in (
        (
            llama,
            {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "rope_scaling": {"rope_type": "llama3"}},
        ),
        (qwen, {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}),
    ):
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(config))
    assert family_tool_call_parser("chat", str(llama), model_path=str(llama)) == "llama3_json"
    assert family_tool_call_parser("chat", str(qwen), model_path=str(qwen)) == "hermes"
    assert family_tool_call_parser("chat", str(tmp_path / "none"), model_path=str(tmp_path / "none")) is None
