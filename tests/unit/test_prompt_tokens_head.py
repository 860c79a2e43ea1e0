"""The router's tokenizer stops where no replica can match: a long new piece is tried by its head first, and every
prefix it reports (to `held`, or as its answer) is exactly the leading part of the whole prompt's tokens."""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path

import pytest

from routers.prompt_tokens import HEAD_CHARS, PromptTokens, head_cut

WORDS = "ka lo mi na te po su ri ve do ga hu kalo mina. tepo, su? 12 7".split(" ")


def _text(rng: random.Random, words: int) -> str:
    # Double spaces and punctuation too: the cut must still fall where the tokenizer splits the whole text.
    return "".join(rng.choice(WORDS) + rng.choice([" ", " ", " ", "  "]) for _ in range(words)).strip()


@pytest.fixture(scope="module")
def tokens(tiny_model_dir: Path) -> PromptTokens:
    return PromptTokens(str(tiny_model_dir))


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> PromptTokens:
    """A second router's tokenizer: the whole prompts, without filling `tokens`' piece cache (a cached piece is
    never cut: it costs nothing)."""
    return PromptTokens(str(tiny_model_dir))


def _bodies(rng: random.Random) -> list[bytes]:
    long_system = {"role": "system", "content": _text(rng, 900)}
    chat = {"model": "m", "messages": [long_system, {"role": "user", "content": _text(rng, 10)}]}
    completion = {"model": "m", "prompt": _text(rng, 900)}
    return [json.dumps(chat).encode(), json.dumps(completion).encode()]


def test_a_head_is_cut_before_a_space_that_follows_a_non_space_within_the_head() -> None:
    assert head_cut("ka " * (HEAD_CHARS // 3)) is None, "a text not over twice the head is encoded whole"
    text = "ka  lo " * HEAD_CHARS
    cut = head_cut(text)
    assert cut is not None and cut < HEAD_CHARS and text[cut] == " " and not text[cut - 1].isspace()
    assert head_cut("x" * 3 * HEAD_CHARS) is None, "no space to cut at"


def test_what_held_sees_and_what_comes_back_lead_the_whole_prompts_tokens(
    tokens: PromptTokens, reference: PromptTokens
) -> None:
    rng = random.Random(7)
    for _ in range(5):
        for body in _bodies(rng):
            whole = reference(body)
            assert whole is not None and len(whole) > 600
            asked: list[list[int]] = []

            def never_held(prefix: Sequence[int], asked: list[list[int]] = asked) -> bool:
                asked.append(list(prefix))
                return len(prefix) < 8  # as if a replica held the first block only

            stopped = tokens(body, never_held)
            assert stopped is not None and 8 <= len(stopped) < len(whole) // 2, "stopped after the head"
            assert stopped == whole[: len(stopped)]
            assert all(prefix == whole[: len(prefix)] for prefix in asked)


def test_a_prompt_some_replica_may_hold_all_along_is_tokenized_whole(
    tokens: PromptTokens, reference: PromptTokens
) -> None:
    for body in _bodies(random.Random(8)):
        # Head, then the rest from the cut on: the same tokens as the whole piece encoded at once.
        assert tokens(body, lambda prefix: True) == reference(body)
