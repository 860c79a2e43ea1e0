"""A client's body cannot make the router render or keep what it likes (review #5): `chat_template_kwargs` that vLLM
refuses (`chat_template`, `tokenize`) are routed by load with nothing rendered, kwargs the model's template does not
read never reach `apply_chat_template`, the piece cache is bounded in characters, and only a prompt's first
`MAX_PROMPT_CHARS` characters are tokenized."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from routers import prompt_tokens
from routers.prompt_tokens import PromptTokens

WORDS = "ka lo mi na te po su ri ve do ga hu".split()


@pytest.fixture(scope="module")
def tokens(tiny_model_dir: Path) -> PromptTokens:
    return PromptTokens(str(tiny_model_dir))


def _chat(system: str, **extra: object) -> bytes:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "ka lo"}]
    return json.dumps({"model": "m", "messages": messages, **extra}).encode()


@pytest.mark.parametrize(
    "kwargs", [{"chat_template": "{{ 'ka ' * 200000 }}"}, {"tokenize": True}], ids=["chat_template", "tokenize"]
)
def test_kwargs_vllm_refuses_are_routed_by_load_and_nothing_is_rendered(tokens: PromptTokens, kwargs: dict) -> None:
    assert tokens.tokens(_chat("ka", chat_template_kwargs=kwargs)) is None


def test_kwargs_the_models_template_does_not_read_never_reach_it(tokens: PromptTokens) -> None:
    plain = tokens.tokens(_chat("ka lo mi"))
    # `return_dict` would turn the rendered text into a dict, `padding` into a tokenizer call's option.
    extra = {"return_dict": True, "padding": True, "unknown": "x"}
    assert plain and tokens.tokens(_chat("ka lo mi", chat_template_kwargs=extra)) == plain


def test_the_piece_cache_is_bounded_in_characters(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prompt_tokens, "PIECE_CACHE_CHARS", 20_000)
    monkeypatch.setattr(prompt_tokens, "PIECE_MAX_CHARS", 6_000)
    fresh = PromptTokens(str(tiny_model_dir))
    rng = random.Random(3)
    for _ in range(20):
        fresh.tokens(_chat(" ".join(rng.choice(WORDS) for _ in range(1_500))))  # ~4.5k characters each
        assert fresh.cached_chars <= 20_000
    held = fresh.cached_chars
    fresh.tokens(_chat(" ".join(rng.choice(WORDS) for _ in range(3_000))))  # ~9k characters: never kept
    assert fresh.cached_chars <= held + 100


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_only_a_prompts_first_characters_are_tokenized(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    monkeypatch.setattr(prompt_tokens, "MAX_PROMPT_CHARS", 3_000)
    fresh = PromptTokens(str(tiny_model_dir))
    encoded: list[int] = []
    encode = fresh._encode
    monkeypatch.setattr(
        fresh, "_encode", lambda text, specials=False: encoded.append(len(text)) or encode(text, specials)
    )
    long_text = " ".join(WORDS[i % len(WORDS)] for i in range(100_000))  # ~300k characters
    if kind == "completion":
        body = json.dumps({"model": "m", "prompt": long_text}).encode()
    else:
        body = json.dumps({"model": "m", "messages": [{"role": "user", "content": long_text}]}).encode()
    found = fresh.tokens(body)
    assert found and sum(encoded) <= 3_000
