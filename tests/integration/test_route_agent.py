"""Route calls through a router's route agent (SPOE): a real HAProxy, sluice's real agent code in a process of its own
(answers scripted by the test), stand-in replicas, and the router's HTTP route call beside it. The agent's answer
pins the request with no HTTP route call; its refusals and bad answers fail closed with their reasons; a stalled or
killed agent leaves the request to the HTTP route call within the route timeout."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from base.contracts import (
    BODY_TRUNCATED_HEADER,
    REASON_NO_PREFILL_REPLICA,
    REASON_NO_REPLICA,
    REPLICA_HEADER,
    REQUEST_ID_HEADER,
)
from base.waiting import wait_until
from infra.haproxy.apps import AppRoute
from infra.haproxy.spoe import AGENT_BACKEND, AGENT_TIMEOUT_SHARE, FAILURE_TIMEOUT
from tests.integration.standin_plane.plane import Plane, start_plane, stop_plane
from tests.integration.standin_plane.standins import (
    APP,
    BODY_BUFFER_BYTES,
    CHAT_PATH,
    LOOPBACK,
    ROUTE_TIMEOUT_S,
    LoopThread,
    ReplicaStandIn,
    RouterBehavior,
    RouterStandIn,
    assert_fail_closed,
)
from tests.support.frontend_metrics import frontend_counts
from tests.support.ports import free_port

pytestmark = pytest.mark.integration

ROUTER = "router-a"
AGENT_FAILURES_COUNTER = "sluice_frontend_route_agent_failures_total"
CHAT = {"model": "stand-in", "messages": [{"role": "user", "content": "hi"}]}


@dataclass
class AgentEnv:
    plane: Plane
    behavior: RouterBehavior
    script: Path
    calls: Path
    agent: subprocess.Popen[bytes]

    def answer(self, mode: str, ranked: list[str] | None = None, reason: str = REASON_NO_REPLICA) -> None:
        self.script.write_text(json.dumps({"mode": mode, "ranked": ranked or ["r1", "r2"], "reason": reason}))

    def agent_calls(self) -> list[dict]:
        return [json.loads(line) for line in self.calls.read_text().splitlines()]

    def failures(self) -> dict[str, int]:
        return frontend_counts(self.plane.haproxy.settings.prometheus_port, AGENT_FAILURES_COUNTER)

    def agent_up(self) -> bool:
        stat = self.plane.runtime.show_stat().get((AGENT_BACKEND, ROUTER))
        return stat is not None and stat.up

    def agent_down_transitions(self) -> int:
        return self.plane.runtime.show_stat()[(AGENT_BACKEND, ROUTER)].down_transitions


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AgentEnv]:
    workdir = tmp_path_factory.mktemp("agent")
    script, calls = workdir / "script.json", workdir / "calls.jsonl"
    calls.touch()
    loop = LoopThread()
    # The HTTP route call (the fallback) chooses r2; the agent chooses as scripted (r1 first by default).
    behavior = RouterBehavior(replica_ids=["r2"])
    r1, r2, router = ReplicaStandIn("r1"), ReplicaStandIn("r2"), RouterStandIn(ROUTER, behavior)
    agent_port = free_port()
    agent = subprocess.Popen(
        [sys.executable, "-m", "tests.support.agent_standin", str(agent_port), str(script), str(calls)],
        cwd=Path(__file__).parents[2],
    )
    plane = None
    try:
        wait_until(30, lambda: _listening(agent_port), "the agent process to listen", poll_s=0.05)
        for stand_in in (r1, r2, router):
            loop.run(stand_in.start())
        app = AppRoute(name=APP, forward_body=True, body_buffer_bytes=BODY_BUFFER_BYTES)
        endpoint = router.endpoint.model_copy(update={"route_port": agent_port})
        plane = start_plane(loop, workdir / "haproxy", app, [r1.endpoint, r2.endpoint], [endpoint])
        started = AgentEnv(plane, behavior, script, calls, agent)
        started.answer("choose")
        wait_until(10, started.agent_up, "the route agent's server to be UP", poll_s=0.05)
        yield started
    finally:
        agent.kill()
        agent.wait()
        if plane is not None:
            stop_plane(plane)
        for stand_in in (r1, r2, router):
            loop.run(stand_in.stop())
        loop.close()


def _listening(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection((LOOPBACK, port), 0.5):
        return True
    return False


def _post(env: AgentEnv, body: dict | bytes = CHAT, **headers: str) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"content-type": "application/json", **headers}
    return httpx.post(env.plane.url + CHAT_PATH, content=content, headers=headers, timeout=10)


def test_a_post_is_pinned_to_the_agents_choice_without_an_http_route_call(env: AgentEnv) -> None:
    env.answer("choose", ["r1", "r2"])
    http_calls, agent_calls = len(env.behavior.calls), len(env.agent_calls())
    for i in range(5):
        response = _post(env, **{"x-session-id": f"s{i}", REQUEST_ID_HEADER: f"agent-{i}"})
        assert response.status_code == 200 and response.headers[REPLICA_HEADER] == "r1", response.text
    assert len(env.behavior.calls) == http_calls, "no HTTP route call while the agent answers"
    made = env.agent_calls()[agent_calls:]
    assert [c["headers"][REQUEST_ID_HEADER] for c in made] == [f"agent-{i}" for i in range(5)]
    assert [c["headers"]["x-session-id"] for c in made] == [f"s{i}" for i in range(5)]
    assert all(c["body_len"] == len(json.dumps(CHAT)) for c in made)
    assert env.plane.runtime.show_stat()[(AGENT_BACKEND, ROUTER)].scur >= 1, "the connection is kept"


def test_the_agent_gets_the_forwarded_body_cut_at_the_buffer_and_says_so(env: AgentEnv) -> None:
    env.answer("choose", ["r2"])
    body = json.dumps({**CHAT, "pad": "x" * (2 * BODY_BUFFER_BYTES)}).encode()
    assert _post(env, body).headers[REPLICA_HEADER] == "r2"
    call = env.agent_calls()[-1]
    assert call["body_len"] == BODY_BUFFER_BYTES
    assert call["headers"][BODY_TRUNCATED_HEADER] == f"{BODY_BUFFER_BYTES}/{len(body)}"


@pytest.mark.parametrize(
    ("mode", "ranked", "reason"),
    [
        ("refuse", None, REASON_NO_REPLICA),
        ("refuse", None, REASON_NO_PREFILL_REPLICA),
        ("choose", ["not a replica id!"], "unparseable_replica_id"),
        ("choose", ["no-such-replica"], "unknown_replica_id"),
    ],
)
def test_agent_refusals_and_bad_answers_fail_closed_with_their_reasons(
    env: AgentEnv, mode: str, ranked: list[str] | None, reason: str
) -> None:
    env.answer(mode, ranked, reason)
    http_calls = len(env.behavior.calls)
    assert_fail_closed(_post(env), reason)
    assert len(env.behavior.calls) == http_calls, "an answer, even a refusal, is never asked again over HTTP"


def test_a_stalled_agent_leaves_the_request_to_the_http_route_call_within_the_route_timeout(env: AgentEnv) -> None:
    env.answer("stall")
    http_calls, failures = len(env.behavior.calls), env.failures()
    started = time.monotonic()
    response = _post(env)
    elapsed = time.monotonic() - started
    assert response.status_code == 200 and response.headers[REPLICA_HEADER] == "r2", response.text
    assert len(env.behavior.calls) == http_calls + 1
    assert ROUTE_TIMEOUT_S * AGENT_TIMEOUT_SHARE <= elapsed < ROUTE_TIMEOUT_S + 0.5, elapsed
    assert env.failures() == {**failures, FAILURE_TIMEOUT: failures[FAILURE_TIMEOUT] + 1}


def test_a_killed_agent_costs_no_request(env: AgentEnv) -> None:
    env.answer("choose", ["r1"])
    assert _post(env).headers[REPLICA_HEADER] == "r1"
    failures, down_transitions = env.failures(), env.agent_down_transitions()
    os.kill(env.agent.pid, signal.SIGKILL)
    env.agent.wait()
    responses = [_post(env) for _ in range(10)]
    assert [(r.status_code, r.headers.get(REPLICA_HEADER)) for r in responses] == [(200, "r2")] * 10
    # The first refused connection marks the agent's server DOWN; its health checks (on Serve's port, which this
    # stand-in keeps answering) may bring it back UP soon after, so the test counts the transition, not the state.
    assert env.agent_down_transitions() > down_transitions
    # The requests that met the dead agent are counted; the rest went straight to the HTTP route call.
    assert 1 <= sum(env.failures().values()) - sum(failures.values()) <= len(responses)
