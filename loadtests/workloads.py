"""The campaign workloads: what each simulated user sends, and when.

`short_long`, `long_short`, `mixed` (closed loop), `bursts`, `step` (open loop), `multi_turn` (growing shared
prefixes, one session header per conversation), `shared_prefix` (a few long system prompts shared by every user, no
session header) and `hot_prefix` (the same, one system prompt a session taking a third of the traffic). Prompt lengths
are exact in tokens of the served model's tokenizer. A rate given opens any workload's loop (arrivals at that rate,
as `vllm bench serve --request-rate`); lengths given (`loadtests.lengths`) or a dataset's prompts
(`loadtests.dataset`) replace the workload's own. Each workload's shape: loadtests/README.md (workloads).
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Literal

from loadtests.dataset import DatasetPrompt
from loadtests.lengths import Lengths
from loadtests.sse_timing import StreamOutput

WORKLOADS = ("short_long", "long_short", "mixed", "bursts", "step", "multi_turn", "shared_prefix", "hot_prefix")
SHORT_PROMPT, LONG_DECODE = 16, 256
LONG_PROMPT, SHORT_DECODE = 512, 8
TURN_PROMPT, TURN_DECODE = 48, 32
STEP_FACTORS = (1.0, 4.0, 1.0)
# Open loop without a rate given; their decodes are shorter, so a sender keeps its schedule.
OPEN_LOOP_WORKLOADS = ("bursts", "step")
DEFAULT_RATE, OPEN_DECODE = 4.0, 64
# Each workload's own lengths, exact.
WORKLOAD_LENGTHS = Lengths()
# shared_prefix, hot_prefix: system prompt + question + answer stay well inside the tiny model's 1,024-token context,
# and 384 is a whole number of 16- and 32-token KV blocks, so a perfect cache can hold every system-prompt token.
SHARED_PREFIX_WORKLOADS = ("shared_prefix", "hot_prefix")
SYSTEM_PROMPTS, SYSTEM_PROMPT_TOKENS = 4, 384
QUESTION_PROMPT, ANSWER_DECODE = 32, 32
# hot_prefix: the share of requests on the first system prompt, one session (the rest spread over the others).
HOT_SHARE = 1 / 3


def arrival_rate(workload: str, rate: float | None) -> float | None:
    """A campaign's requests per second, or None for a closed loop: a rate given opens any workload's loop, and
    `bursts` and `step` are open at `DEFAULT_RATE` without one."""
    if rate is None and workload in OPEN_LOOP_WORKLOADS:
        return DEFAULT_RATE
    return rate


class PromptMaker:
    """Prompts of an exact token count for a tokenizer (`tokenizer.json` of the served model)."""

    def __init__(self, tokenizer_file: Path, seed: int = 0) -> None:
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(str(tokenizer_file))
        self.random = random.Random(seed)

    @cached_property
    def words(self) -> list[str]:
        """Lower-case words the tokenizer holds as one token with their leading space."""
        spaced = sorted(t[1:] for t in self.tokenizer.get_vocab() if re.fullmatch(r"Ġ[a-z]{2,}", t))
        if len(spaced) < 16:
            raise ValueError("the tokenizer has too few single-token words to build exact prompts")
        return spaced

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def prompt(self, tokens: int, chooser: random.Random | None = None) -> str:
        """`tokens` random words, drawn with `chooser` (default: this maker's own seeded generator)."""
        chooser = chooser or self.random
        text = "".join(" " + chooser.choice(self.words) for _ in range(tokens))
        if self.count(text) != tokens:
            raise ValueError(f"a {tokens}-token prompt encoded to {self.count(text)} tokens")
        return text


@dataclass
class Request:
    """One request a user sends: the OpenAI path and body, and the session it belongs to (sent in the session header
    unless `send_session` is off; the rows record it either way)."""

    path: str
    body: dict[str, Any]
    session: str
    send_session: bool = True


def system_prompt_key(session: str) -> str:
    """The system prompt a `shared_prefix` or `hot_prefix` request used, from the session it was recorded under."""
    return session.split("/", 1)[0]


@dataclass
class Conversation:
    session: str
    turns_left: int
    messages: list[dict[str, str]] = field(default_factory=list)
    # The tokens the engine computed for the previous turn: its prompt, then its answer.
    computed_token_ids: list[int] = field(default_factory=list)

    def answered(self, output: StreamOutput) -> int:
        """Take the turn's answer into the conversation; returns how many leading tokens of the turn's prompt the
        previous turn computed (0 when the server sent no token ids). The last answer token is left out: it was
        sampled, never run through the model, so no cache holds it."""
        self.messages.append({"role": "assistant", "content": output.text})
        earlier = self.computed_token_ids[:-1]
        reusable = 0
        for earlier_id, prompt_id in zip(earlier, output.prompt_token_ids, strict=False):
            if earlier_id != prompt_id:
                break
            reusable += 1
        self.computed_token_ids = output.prompt_token_ids + output.token_ids
        return reusable


class Workload:
    """Requests for one workload; `arrivals()` for open-loop workloads (planned offsets from the start, s).

    `seed` drives this process's choices and prompts; `prefix_seed` the shared system prompts, which every Locust
    process of a campaign must draw alike (the campaign's seed: a new seed, new system prompts, so no campaign finds
    the previous one's prompts in the replicas' prefix caches)."""

    def __init__(
        self,
        name: str,
        model: str,
        prompts: PromptMaker,
        rate: float | None = None,
        burstiness: float = 1.0,
        duration_s: float = 60.0,
        turns: int = 4,
        seed: int = 0,
        system_prompts: int = SYSTEM_PROMPTS,
        prefix_seed: int = 0,
        lengths: Lengths = WORKLOAD_LENGTHS,
        dataset: Sequence[DatasetPrompt] = (),
    ) -> None:
        if name not in WORKLOADS:
            raise ValueError(f"unknown workload {name!r}: one of {', '.join(WORKLOADS)}")
        if name == "hot_prefix" and system_prompts < 2:
            raise ValueError("hot_prefix needs at least two system prompts: a hot one and the rest")
        self.name, self.model, self.prompts = name, model, prompts
        self.rate = arrival_rate(name, rate)
        self.burstiness, self.duration_s, self.turns = burstiness, duration_s, turns
        self.random = random.Random(seed)
        self.system_prompt_count, self.prefix_seed = system_prompts, prefix_seed
        self.lengths = lengths
        # A dataset's prompts in an order of this process's own, taken in turn and again from the start.
        self.dataset = list(dataset)
        self.random.shuffle(self.dataset)
        self._sessions = self._dataset_drawn = 0

    @property
    def loop(self) -> Literal["open", "closed"]:
        return "closed" if self.rate is None else "open"

    def arrivals(self) -> Iterator[float]:
        """Planned send offsets (s) within the duration: a Poisson step (`step`), else gamma gaps (shape
        `burstiness`, 1 = Poisson)."""
        assert self.rate is not None, "a closed loop plans no arrivals"
        at = 0.0
        while True:
            if self.name == "step":
                third = min(int(at / (self.duration_s / 3)), 2)
                at += self.random.expovariate(self.rate * STEP_FACTORS[third])
            else:
                shape = self.burstiness
                at += self.random.gammavariate(shape, 1.0 / (self.rate * shape))
            if at >= self.duration_s:
                return
            yield at

    def _session(self) -> str:
        self._sessions += 1
        return f"{self.name}-{self.random.getrandbits(48):012x}-{self._sessions}"

    def _prompt_and_answer(self, prompt_tokens: int, answer_tokens: int) -> tuple[str, int]:
        """The next prompt's text and its answer's length: the dataset's next prompt when there is a dataset, else
        a prompt of an exact token count; lengths as `self.lengths` says."""
        if self.dataset:
            entry = self.dataset[self._dataset_drawn % len(self.dataset)]
            self._dataset_drawn += 1
            return entry.prompt, self.lengths.output_tokens(answer_tokens, self.random, entry.output_len)
        prompt = self.prompts.prompt(self.lengths.prompt_tokens(prompt_tokens, self.random))
        return prompt, self.lengths.output_tokens(answer_tokens, self.random)

    def _completion(self, prompt_tokens: int, answer_tokens: int) -> Request:
        prompt, max_tokens = self._prompt_and_answer(prompt_tokens, answer_tokens)
        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        return Request("/v1/completions", body, self._session())

    @cached_property
    def system_prompts(self) -> list[str]:
        chooser = random.Random(f"system-prompts-{self.prefix_seed}")
        return [self.prompts.prompt(SYSTEM_PROMPT_TOKENS, chooser) for _ in range(self.system_prompt_count)]

    def _shared_prefix(self) -> Request:
        """A question under one of the shared system prompts: `shared_prefix` picks one uniformly and sends no
        session header (a fresh session per request, named after its system prompt for the rows); `hot_prefix` sends
        the system prompt's key as the session, the first one taking `HOT_SHARE` of the requests."""
        hot = self.name == "hot_prefix"
        if hot and self.random.random() < HOT_SHARE:
            index = 0
        else:
            index = self.random.randrange(1 if hot else 0, len(self.system_prompts))
        key = f"prompt{index}-seed{self.prefix_seed}"
        question, max_tokens = self._prompt_and_answer(QUESTION_PROMPT, ANSWER_DECODE)
        body = {
            "model": self.model,
            "messages": [
                {"role": "system", "content": self.system_prompts[index]},
                {"role": "user", "content": question},
            ],
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if hot:
            return Request("/v1/chat/completions", body, key)
        return Request("/v1/chat/completions", body, f"{key}/{self._session()}", send_session=False)

    def next_request(self, conversation: Conversation | None = None) -> Request:
        """The next request; a multi-turn user passes its conversation (updated here, one turn per call)."""
        if self.name in SHARED_PREFIX_WORKLOADS:
            return self._shared_prefix()
        if self.name == "multi_turn":
            assert conversation is not None
            turn, max_tokens = self._prompt_and_answer(TURN_PROMPT, TURN_DECODE)
            conversation.messages.append({"role": "user", "content": turn})
            conversation.turns_left -= 1
            body = {
                "model": self.model,
                "messages": list(conversation.messages),
                "max_tokens": max_tokens,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
                # vLLM's: the prompt and answer token ids, so the campaign knows what a cache could reuse.
                "return_token_ids": True,
            }
            return Request("/v1/chat/completions", body, conversation.session)
        short = self.name == "short_long" or (self.name != "long_short" and self.random.random() < 0.5)
        if self.name in OPEN_LOOP_WORKLOADS:
            return self._completion(SHORT_PROMPT, OPEN_DECODE)
        if short:
            return self._completion(SHORT_PROMPT, LONG_DECODE)
        return self._completion(LONG_PROMPT, SHORT_DECODE)

    def new_conversation(self) -> Conversation:
        return Conversation(self._session(), self.turns)
