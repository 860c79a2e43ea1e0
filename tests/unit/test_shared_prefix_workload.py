"""The `shared_prefix` and `hot_prefix` workloads: a few long system prompts shared by every user, exact in the tiny
model's tokens, new ones for a new campaign seed; no session header, except `hot_prefix`'s one hot session."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from loadtests.workloads import (
    ANSWER_DECODE,
    HOT_SHARE,
    QUESTION_PROMPT,
    SYSTEM_PROMPT_TOKENS,
    SYSTEM_PROMPTS,
    PromptMaker,
    Request,
    Workload,
    system_prompt_key,
)

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def prompts(tiny_model_dir: Path) -> PromptMaker:
    return PromptMaker(tiny_model_dir / "tokenizer.json", seed=1)


def _requests(prompts: PromptMaker, name: str, count: int, seed: int = 1, prefix_seed: int = 7) -> list[Request]:
    workload = Workload(name, "sluice-tiny", prompts, seed=seed, prefix_seed=prefix_seed)
    return [workload.next_request(workload.new_conversation()) for _ in range(count)]


def test_shared_prefix_sends_no_session_header_and_names_a_fresh_session_per_request(prompts: PromptMaker) -> None:
    requests = _requests(prompts, "shared_prefix", 200)
    assert not any(request.send_session for request in requests)
    assert len({request.session for request in requests}) == len(requests)
    assert len({system_prompt_key(request.session) for request in requests}) == SYSTEM_PROMPTS


def test_every_request_is_one_of_a_few_system_prompts_word_for_word_and_a_question_of_its_own(
    prompts: PromptMaker,
) -> None:
    requests = _requests(prompts, "shared_prefix", 200)
    by_key: dict[str, set[str]] = {}
    for request in requests:
        system, question = request.body["messages"]
        assert (system["role"], question["role"]) == ("system", "user")
        assert request.path == "/v1/chat/completions" and request.body["stream"]
        by_key.setdefault(system_prompt_key(request.session), set()).add(system["content"])
    assert all(len(texts) == 1 for texts in by_key.values())  # a key names one system prompt
    assert len({text for texts in by_key.values() for text in texts}) == SYSTEM_PROMPTS
    uses = Counter(system_prompt_key(request.session) for request in requests)
    assert min(uses.values()) >= 25  # picked at random, each well reused
    questions = [request.body["messages"][1]["content"] for request in requests]
    assert len(set(questions)) == len(questions)


def test_prompt_lengths_are_exact_in_the_served_models_tokens(prompts: PromptMaker) -> None:
    for request in _requests(prompts, "shared_prefix", 20):
        system, question = request.body["messages"]
        assert prompts.count(system["content"]) == SYSTEM_PROMPT_TOKENS
        assert prompts.count(question["content"]) == QUESTION_PROMPT
        assert request.body["max_tokens"] == ANSWER_DECODE


def _system_prompts(prompts: PromptMaker, seed: int, prefix_seed: int) -> set[str]:
    return {r.body["messages"][0]["content"] for r in _requests(prompts, "shared_prefix", 60, seed, prefix_seed)}


def test_every_process_of_a_campaign_shares_the_system_prompts_and_a_new_campaign_seed_draws_new_ones(
    prompts: PromptMaker,
) -> None:
    # Locust processes differ in their own seed (campaign seed + pid) and share the campaign's (prefix_seed).
    first = _system_prompts(prompts, seed=11, prefix_seed=7)
    assert _system_prompts(prompts, seed=12, prefix_seed=7) == first
    assert not first & _system_prompts(prompts, seed=11, prefix_seed=8)


def test_hot_prefix_sends_a_third_of_the_requests_as_one_session_and_each_system_prompt_as_its_session(
    prompts: PromptMaker,
) -> None:
    requests = _requests(prompts, "hot_prefix", 3000)
    assert all(request.send_session for request in requests)
    sessions = Counter(request.session for request in requests)
    assert len(sessions) == SYSTEM_PROMPTS
    hot, hot_count = sessions.most_common(1)[0]
    assert abs(hot_count / len(requests) - HOT_SHARE) < 0.03
    assert all(system_prompt_key(session) == session for session in sessions)
    texts = {r.session: r.body["messages"][0]["content"] for r in requests}
    assert texts == {r.session: r.body["messages"][0]["content"] for r in reversed(requests)}


def test_the_locust_user_sends_the_session_header_only_when_the_request_asks(tmp_path: Path) -> None:
    # Locust patches the interpreter (gevent) at import: its own process, as every campaign runs it.
    script = """
import locust  # first, as `locust -f` does: it patches ssl before anything imports it
import json, requests
from loadtests import locustfile
from loadtests.workloads import Request

class Http:
    sent = []
    def prepare_request(self, request):
        self.sent.append(dict(request.headers))
        return request
    def send(self, *args, **kwargs):
        raise requests.ConnectionError("no server")

class User:
    host, http = "http://127.0.0.1:9", Http()

for send_session in (True, False):
    locustfile.StreamingUser.stream(User(), Request("/v1/chat/completions", {}, "s-1", send_session), None)
print(json.dumps(Http.sent))
"""
    env = os.environ | {"SLUICE_LOAD_SESSION_HEADER": "x-session-id", "SLUICE_LOAD_ROWS_DIR": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    with_header, without = json.loads(done.stdout.strip().splitlines()[-1])
    assert with_header["x-session-id"] == "s-1"
    assert "x-session-id" not in without
