"""The vLLM tool-call parser a model's family speaks, for a spec's `tool_call_parser: auto`.

vLLM's tool calling docs name a parser per model family (its `--tool-call-parser` choices); none fits every model, so a
team asks for tool calling and either names the parser or says `auto`. `auto` reads the family from the model's
served name, its source (a Hub id or a folder's name) and, where the source is a local folder, its config.json's
`model_type`, `architectures` and RoPE type (Llama 3.x announces `llama3`); the first pattern of `FAMILY_PARSERS`
that matches names the parser, so the more specific families come first (Qwen3-Coder before Qwen, Hermes before the
Llama it was tuned from, Llama 4 before Llama 3).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from base.runtime import is_local_model

# `tool_call_parser: auto`: the parser of the model's family.
AUTO_TOOL_CALL_PARSER = "auto"
# (pattern over the lower-cased names, parser), as vLLM's tool calling docs pair them.
FAMILY_PARSERS: tuple[tuple[str, str], ...] = (
    (r"qwen3-?coder", "qwen3_coder"),
    (r"hermes", "hermes"),
    (r"llama-?4", "llama4_pythonic"),
    (r"llama-?3|\bllama3\b", "llama3_json"),
    (r"qwen|qwq", "hermes"),
    (r"mistral|mixtral|ministral|codestral|devstral|magistral", "mistral"),
    (r"granite-?4", "granite4"),
    (r"granite", "granite"),
    (r"internlm", "internlm"),
    (r"deepseek-?v3", "deepseek_v3"),
    (r"gpt-?oss", "openai"),
    (r"phi-?4-?mini", "phi4_mini_json"),
    (r"kimi-?k2", "kimi_k2"),
    (r"jamba", "jamba"),
)


def _config_names(model_path: str) -> list[str]:
    """What a local model folder's config.json says of its family (nothing for a Hub id or a folder without one)."""
    config_file = Path(model_path) / "config.json"
    if not is_local_model(model_path) or not config_file.is_file():
        return []
    config = json.loads(config_file.read_text())
    rope = config.get("rope_scaling") or {}
    return [
        str(config.get("model_type", "")),
        *map(str, config.get("architectures", [])),
        str(rope.get("rope_type", "")),
    ]


def family_tool_call_parser(*names: str, model_path: str | None = None) -> str | None:
    """The parser of the family these names (served name, source) and the folder's config.json point to; None when no
    family matches."""
    haystack = " ".join([*names, *(_config_names(model_path) if model_path else [])]).lower()
    return next((parser for pattern, parser in FAMILY_PARSERS if re.search(pattern, haystack)), None)
