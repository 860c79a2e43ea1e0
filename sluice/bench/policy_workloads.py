"""The workloads of `sluice bench policies`: every request each closed-loop user sends, planned ahead from a seed.

The simulator answers every request with `ANSWER_TOKENS` copies of one word (`services.replica.sim.fleet`), so a
conversation's later turns are known before it starts: its history holds those answers. Sizes scale with the
replicas (`REQUESTS_PER_REPLICA` requests and `USERS_PER_REPLICA` users each), so every replica count sees the same
shape. Prompt lengths are exact in the served model's tokens (`loadtests.workloads.PromptMaker`).

- `shared_prefix`: `SHARED_PREFIXES_PER_REPLICA` system prompts per replica, each request one of them at random and a
  question of its own; no session header. The prefix is everything: a request that lands where its prompt is cached
  computes only its question.
- `multi_turn`: conversations of `TURNS` turns, each with a system prompt of its own; every turn re-sends the history
  (its answers included) and a new user message; a session header per conversation.
- `hot_sessions`: `HOT_SESSIONS_PER_REPLICA` sessions per replica, each a document and a question; each request picks
  its session by a Zipf law of exponent `ZIPF_EXPONENT` (the hottest about a sixth of the traffic at 64 replicas), so
  several users ask about the same document at once; a session header per session.
- `mixed`: `LONG_SHARE` of the requests ask about one of the long documents (`LONG_TOKENS`, 8k: the prompts the
  decision time is judged on), the rest are short prompts behind one short shared system prompt; no session header.
- `agentic`: tool-using agents: one long tool catalogue shared by every agent, then `AGENT_TURNS` turns each adding
  the agent's call (its answer) and the tool's result, re-sending the whole growing context; a session per agent.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from loadtests.workloads import PromptMaker

POLICY_WORKLOADS = ("shared_prefix", "multi_turn", "hot_sessions", "mixed", "agentic")
# What `sluice bench policies` runs by default (capacity_queue cannot run there: sluice/bench/policies.py).
BENCH_POLICIES = ("round_robin", "power_of_two", "consistent_hash", "kv_aware")
DEFAULT_REPLICAS = (8, 32, 64)
ANSWER_TOKENS = 8
REQUESTS_PER_REPLICA = 32
USERS_PER_REPLICA = 1
# shared_prefix: one system prompt per 2 replicas, ~64 requests each: a perfect cache misses one in 64, so TTFT's p90
# is a hit wherever the policy keeps prompts together.
SHARED_PREFIXES_PER_REPLICA = 0.5
SYSTEM_TOKENS, QUESTION_TOKENS = 1536, 32
# multi_turn: 12 turns of 160 new tokens after a 512-token system prompt (the last turn ~2,600 tokens): only one
# turn in 12 opens a conversation (a miss for every policy), so TTFT's p90 tells the policies apart.
TURNS, OPENING_TOKENS, TURN_TOKENS = 12, 512, 160
# hot_sessions: 2 sessions per replica; a Zipf law over 128 sessions gives the hottest ~18 % of the requests.
HOT_SESSIONS_PER_REPLICA = 2
ZIPF_EXPONENT = 1.0
DOCUMENT_TOKENS = 1536
# mixed: one long document per 4 replicas, each asked ~26 times.
LONG_SHARE, LONG_TOKENS, LONG_DOCUMENTS_PER_REPLICA = 0.2, 8192, 0.25
SHORT_SYSTEM_TOKENS, SHORT_TOKENS = 96, 96
# agentic: a 1,024-token tool catalogue, a 64-token task, then 8 turns of a call (the answer) and a 192-token result.
CATALOGUE_TOKENS, AGENT_TASK_TOKENS, AGENT_TURNS, TOOL_RESULT_TOKENS = 1024, 64, 8, 192


@dataclass(frozen=True)
class PlannedRequest:
    body: dict[str, Any]
    # Sent as the session header; None: no header.
    session: str | None = None


@dataclass
class WorkloadPlan:
    name: str
    users: list[list[PlannedRequest]] = field(default_factory=list)

    @property
    def requests(self) -> int:
        return sum(len(user) for user in self.users)


def answer_text(answer_word: str) -> str:
    """What the simulator answers every request with."""
    return answer_word * ANSWER_TOKENS


class _Planner:
    def __init__(self, maker: PromptMaker, served_name: str, answer: str, seed: int, replicas: int) -> None:
        self.maker = maker
        self.served_name = served_name
        self.answer = answer
        self.rng = random.Random(seed)
        self.replicas = replicas
        self.user_count = USERS_PER_REPLICA * replicas
        self.total = REQUESTS_PER_REPLICA * replicas

    def text(self, tokens: int) -> str:
        return self.maker.prompt(tokens, self.rng).lstrip()

    def chat(self, messages: list[dict[str, str]]) -> dict[str, Any]:
        return {
            "model": self.served_name,
            "messages": messages,
            "max_tokens": ANSWER_TOKENS,
            "stream": True,
            "stream_options": {"include_usage": True},
        }

    def deal(self, requests: list[PlannedRequest]) -> list[list[PlannedRequest]]:
        """Independent requests dealt round the users."""
        users: list[list[PlannedRequest]] = [[] for _ in range(self.user_count)]
        for index, request in enumerate(requests):
            users[index % self.user_count].append(request)
        return users

    def deal_sessions(self, sessions: list[list[PlannedRequest]]) -> list[list[PlannedRequest]]:
        """Whole conversations dealt round the users, each user running its conversations one after the other."""
        users: list[list[PlannedRequest]] = [[] for _ in range(self.user_count)]
        for index, session in enumerate(sessions):
            users[index % self.user_count].extend(session)
        return users

    def conversation(self, session: str, opening: list[dict[str, str]], turns: list[str]) -> list[PlannedRequest]:
        messages = list(opening)
        planned = []
        for turn in turns:
            messages = [*messages, {"role": "user", "content": turn}]
            planned.append(PlannedRequest(self.chat(messages), session))
            messages = [*messages, {"role": "assistant", "content": self.answer}]
        return planned

    def shared_prefix(self) -> list[list[PlannedRequest]]:
        prompts = [self.text(SYSTEM_TOKENS) for _ in range(max(1, round(SHARED_PREFIXES_PER_REPLICA * self.replicas)))]
        return self.deal(
            [
                PlannedRequest(
                    self.chat(
                        [
                            {"role": "system", "content": self.rng.choice(prompts)},
                            {"role": "user", "content": self.text(QUESTION_TOKENS)},
                        ]
                    )
                )
                for _ in range(self.total)
            ]
        )

    def multi_turn(self) -> list[list[PlannedRequest]]:
        sessions = [
            self.conversation(
                f"conversation-{index}",
                [{"role": "system", "content": self.text(OPENING_TOKENS)}],
                [self.text(TURN_TOKENS) for _ in range(TURNS)],
            )
            for index in range(self.total // TURNS)
        ]
        return self.deal_sessions(sessions)

    def hot_sessions(self) -> list[list[PlannedRequest]]:
        count = HOT_SESSIONS_PER_REPLICA * self.replicas
        documents = [self.text(DOCUMENT_TOKENS) for _ in range(count)]
        weights = [1 / (rank + 1) ** ZIPF_EXPONENT for rank in range(count)]
        picks = self.rng.choices(range(count), weights, k=self.total)
        return self.deal(
            [
                PlannedRequest(
                    self.chat(
                        [
                            {"role": "system", "content": documents[pick]},
                            {"role": "user", "content": self.text(QUESTION_TOKENS)},
                        ]
                    ),
                    f"session-{pick}",
                )
                for pick in picks
            ]
        )

    def mixed(self) -> list[list[PlannedRequest]]:
        documents = [self.text(LONG_TOKENS) for _ in range(max(1, round(LONG_DOCUMENTS_PER_REPLICA * self.replicas)))]
        system = self.text(SHORT_SYSTEM_TOKENS)
        requests = []
        for _ in range(self.total):
            if self.rng.random() < LONG_SHARE:
                opening = {"role": "system", "content": self.rng.choice(documents)}
                question = self.text(QUESTION_TOKENS)
            else:
                opening = {"role": "system", "content": system}
                question = self.text(SHORT_TOKENS)
            requests.append(PlannedRequest(self.chat([opening, {"role": "user", "content": question}])))
        return self.deal(requests)

    def agentic(self) -> list[list[PlannedRequest]]:
        catalogue = self.text(CATALOGUE_TOKENS)
        sessions = []
        for index in range(self.total // AGENT_TURNS):
            task = self.text(AGENT_TASK_TOKENS)
            results = [f"{task}" if turn == 0 else self.text(TOOL_RESULT_TOKENS) for turn in range(AGENT_TURNS)]
            sessions.append(self.conversation(f"agent-{index}", [{"role": "system", "content": catalogue}], results))
        return self.deal_sessions(sessions)


def plan_workload(
    name: str, replicas: int, maker: PromptMaker, served_name: str, answer_word: str, seed: int
) -> WorkloadPlan:
    """The plan of workload `name` at `replicas` replicas: the same seed, the same requests."""
    if name not in POLICY_WORKLOADS:
        raise ValueError(f"unknown workload {name!r}: one of {', '.join(POLICY_WORKLOADS)}")
    planner = _Planner(maker, served_name, answer_text(answer_word), seed, replicas)
    return WorkloadPlan(name, getattr(planner, name)())
