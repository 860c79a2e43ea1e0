"""`sluice load --dataset FILE`: prompts from a file instead of generated ones, as `vllm bench serve` takes them.

Two shapes, told apart by the file's first non-blank character:
- a JSON array (ShareGPT's shape): each entry's `conversations` (or `conversation`) list of `{"from", "value"}`
  turns; the first turn is the prompt and the second the reference answer, whose length in the served model's tokens
  becomes the request's output length (vLLM's ShareGPT dataset does the same). Entries with fewer than two turns are
  skipped, as vLLM skips them.
- JSON Lines: one object a line with a `prompt` string and an optional `output_len` (a positive whole number of
  tokens); other keys are left alone (datasets carry their own).

The file is read and checked before any load is sent (`read_dataset`): a line that is no object, a missing prompt or
an output length that is no positive whole number names its line (or entry) and why, so a campaign never starts on a
file it cannot use.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# ShareGPT files name the conversation either way.
CONVERSATION_KEYS = ("conversations", "conversation")
OUTPUT_LEN_KEY = "output_len"


class DatasetError(ValueError):
    """A `--dataset` file that cannot give prompts; the message names the file, the line or entry, and why."""


@dataclass(frozen=True)
class DatasetPrompt:
    """One prompt of a dataset and the output length it asks for (None: the campaign's or the workload's)."""

    prompt: str
    output_len: int | None = None


def read_dataset(path: Path, count_tokens: Callable[[str], int] | None = None) -> list[DatasetPrompt]:
    """Every prompt of `path`, in the file's order. `count_tokens` measures a ShareGPT answer's output length (without
    it, as when only checking the file, a ShareGPT prompt has none)."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as error:
        raise DatasetError(f"--dataset {path}: cannot read it ({error})") from None
    if text.lstrip().startswith("["):
        prompts = _sharegpt(path, text, count_tokens)
    else:
        prompts = _json_lines(path, text)
    if not prompts:
        raise DatasetError(f"--dataset {path}: it holds no prompt")
    return prompts


def _sharegpt(path: Path, text: str, count_tokens: Callable[[str], int] | None) -> list[DatasetPrompt]:
    try:
        entries = json.loads(text)
    except ValueError as error:
        raise DatasetError(f"--dataset {path}: not JSON ({error})") from None
    prompts = []
    for index, entry in enumerate(entries):
        turns = _conversation(entry)
        if turns is None:
            raise DatasetError(
                f"--dataset {path}: entry {index} has no `conversations` list of {{'from', 'value'}} turns"
            )
        if len(turns) < 2:
            continue
        answer_len = count_tokens(turns[1]) if count_tokens is not None else None
        prompts.append(DatasetPrompt(turns[0], answer_len or None))
    return prompts


def _conversation(entry: Any) -> list[str] | None:
    """The turns' texts of a ShareGPT entry, or None when it is not one."""
    if not isinstance(entry, dict):
        return None
    turns = next((entry[key] for key in CONVERSATION_KEYS if key in entry), None)
    if not isinstance(turns, list) or not all(isinstance(t, dict) and isinstance(t.get("value"), str) for t in turns):
        return None
    return [turn["value"] for turn in turns]


def _json_lines(path: Path, text: str) -> list[DatasetPrompt]:
    prompts = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except ValueError as error:
            raise DatasetError(f"--dataset {path}: line {number} is not JSON ({error})") from None
        if not isinstance(entry, dict) or not isinstance(entry.get("prompt"), str) or not entry["prompt"]:
            raise DatasetError(f"--dataset {path}: line {number} has no `prompt` string")
        output_len = entry.get(OUTPUT_LEN_KEY)
        if output_len is not None and (type(output_len) is not int or output_len < 1):
            raise DatasetError(
                f"--dataset {path}: line {number}: `{OUTPUT_LEN_KEY}` must be a positive whole number, not "
                f"{output_len!r}"
            )
        prompts.append(DatasetPrompt(entry["prompt"], output_len))
    return prompts
