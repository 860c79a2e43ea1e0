"""`sluice load --dataset`: ShareGPT JSON and JSON Lines prompts, read in the file's order, and every malformed entry
refused with its line or entry and why before any load is sent."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadtests.dataset import DatasetError, DatasetPrompt, read_dataset


def _sharegpt(*conversations: list[str]) -> str:
    turns = ("human", "gpt")
    return json.dumps(
        [
            {"id": str(i), "conversations": [{"from": turns[j % 2], "value": v} for j, v in enumerate(c)]}
            for i, c in enumerate(conversations)
        ]
    )


def test_json_lines_give_their_prompts_and_output_lengths_in_order(tmp_path: Path) -> None:
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "one", "output_len": 5}\n\n{"prompt": "two", "source": "kept apart"}\n')
    assert read_dataset(path) == [DatasetPrompt("one", 5), DatasetPrompt("two", None)]


def test_sharegpt_takes_the_first_turn_and_the_answers_length_and_skips_one_turn_entries(tmp_path: Path) -> None:
    path = tmp_path / "sharegpt.json"
    path.write_text(_sharegpt(["what is a cache", "a store of work done"], ["alone"], ["hi", "hello there"]))
    words = lambda text: len(text.split())  # noqa: E731
    assert read_dataset(path, words) == [DatasetPrompt("what is a cache", 5), DatasetPrompt("hi", 2)]
    assert read_dataset(path) == [DatasetPrompt("what is a cache"), DatasetPrompt("hi")], "checked without lengths"


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ('{"prompt": "one"}\nnot json\n', "line 2 is not JSON"),
        ('{"text": "one"}\n', "line 1 has no `prompt` string"),
        ('["a list"]\n{"prompt": "x"}', "not JSON"),
        ('{"prompt": "one", "output_len": 0}\n', "line 1: `output_len` must be a positive whole number, not 0"),
        ('{"prompt": "one", "output_len": "8"}\n', "not '8'"),
        ('[{"conversations": "none"}]', "entry 0 has no `conversations` list"),
        ("[]", "it holds no prompt"),
        ("\n\n", "it holds no prompt"),
    ],
)
def test_a_malformed_dataset_is_refused_naming_where_and_why(tmp_path: Path, text: str, why: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(text)
    with pytest.raises(DatasetError, match=f"--dataset {path}") as refused:
        read_dataset(path)
    assert why in str(refused.value)


def test_a_missing_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="cannot read it"):
        read_dataset(tmp_path / "none.jsonl")
