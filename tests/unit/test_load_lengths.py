"""`sluice load --input-len/--output-len/--range-ratio` and `--dataset` as a workload draws them, and `--rate` opening
any workload's loop."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from loadtests.dataset import DatasetPrompt
from loadtests.lengths import Lengths
from loadtests.sweep import parse_rates
from loadtests.workloads import DEFAULT_RATE, LONG_DECODE, SHORT_PROMPT, PromptMaker, Workload


@pytest.fixture(scope="module")
def prompts(tiny_model_dir: Path) -> PromptMaker:
    return PromptMaker(tiny_model_dir / "tokenizer.json", seed=1)


def test_a_ratio_spreads_each_length_uniformly_within_its_bounds() -> None:
    lengths = Lengths(input_len=100, range_ratio=0.25)
    drawn = [lengths.prompt_tokens(16, random.Random(seed)) for seed in range(400)]
    assert min(drawn) >= 75 and max(drawn) <= 125 and len(set(drawn)) > 30
    assert {Lengths(range_ratio=0.9).spread(1, random.Random(seed)) for seed in range(50)} <= {1, 2}, "at least 1"
    assert Lengths().output_tokens(8, random.Random(0), dataset_tokens=40) == 40, "the dataset's length stands"
    assert Lengths(output_len=3).output_tokens(8, random.Random(0), dataset_tokens=40) == 3, "--output-len over it"


def test_given_lengths_replace_every_kind_of_a_mixed_workload_exactly(prompts: PromptMaker) -> None:
    workload = Workload("mixed", "sluice-tiny", prompts, seed=3, lengths=Lengths(input_len=40, output_len=7))
    bodies = [workload.next_request().body for _ in range(20)]
    assert {prompts.count(body["prompt"]) for body in bodies} == {40}
    assert {body["max_tokens"] for body in bodies} == {7}
    default = Workload("short_long", "sluice-tiny", prompts).next_request().body
    assert (prompts.count(default["prompt"]), default["max_tokens"]) == (SHORT_PROMPT, LONG_DECODE)


def test_a_dataset_gives_every_prompt_in_turn_and_its_output_length(prompts: PromptMaker) -> None:
    dataset = [DatasetPrompt("alpha beta", 5), DatasetPrompt("gamma", None)]
    workload = Workload("short_long", "sluice-tiny", prompts, seed=2, dataset=dataset)
    bodies = [workload.next_request().body for _ in range(4)]
    assert sorted((b["prompt"], b["max_tokens"]) for b in bodies[:2]) == [("alpha beta", 5), ("gamma", LONG_DECODE)]
    assert [b["prompt"] for b in bodies[2:]] == [b["prompt"] for b in bodies[:2]], "then again from the start"
    turn = Workload("multi_turn", "sluice-tiny", prompts, dataset=dataset)
    body = turn.next_request(turn.new_conversation()).body
    assert body["messages"][-1]["content"] in {"alpha beta", "gamma"}


def test_a_rate_opens_any_workloads_loop_and_bursts_keep_theirs_without_one(prompts: PromptMaker) -> None:
    assert Workload("mixed", "sluice-tiny", prompts).loop == "closed"
    opened = Workload("mixed", "sluice-tiny", prompts, rate=20.0, duration_s=10.0)
    arrivals = list(opened.arrivals())
    assert opened.loop == "open" and 120 <= len(arrivals) <= 280 and arrivals == sorted(arrivals)
    bursts = Workload("bursts", "sluice-tiny", prompts)
    assert bursts.loop == "open" and bursts.rate == DEFAULT_RATE


@pytest.mark.parametrize(
    ("text", "why"), [("2,x", "'x' is no number"), ("0", "not a positive rate"), ("2,2", "given twice"), ("inf", "not")]
)
def test_a_sweeps_rates_are_checked(text: str, why: str) -> None:
    assert parse_rates("2,4.5") == [2.0, 4.5]
    with pytest.raises(ValueError, match=why):
        parse_rates(text)
