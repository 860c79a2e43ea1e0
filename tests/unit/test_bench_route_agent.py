"""The route-agent bench drives the real agent in a process of its own: every NOTIFY it sends is answered by an ACK
that chose a replica, the agent's CPU per decision is measured, and no process is left (the numbers themselves are
`make bench`'s)."""

from __future__ import annotations

import psutil
import pytest

from routers.consistent_hash import NAME as CONSISTENT_HASH
from routers.round_robin import NAME as ROUND_ROBIN
from sluice.bench import route_agent


def test_every_frame_is_answered_with_a_decision_and_its_cpu_is_measured(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(route_agent, "AGENT_STEP_S", 1.0)
    children_before = {child.pid for child in psutil.Process().children(recursive=True)}
    results = route_agent.agent_cpu_per_decision((ROUND_ROBIN, CONSISTENT_HASH), rates=(200,))
    # The agent processes are ended and reaped, and nothing else of theirs stays behind.
    assert {child.pid for child in psutil.Process().children(recursive=True)} <= children_before
    for policy in (ROUND_ROBIN, CONSISTENT_HASH):
        entry = results[policy]["200"]
        assert entry["frames"] == 200 and entry["acks"] == 200, results
        assert entry["cpu_us_per_decision"] > 0
    assert f"{ROUND_ROBIN:<34}{200:>8}{'200/200':>10}" in route_agent.agent_table(results)


def test_an_ack_counts_as_a_decision_only_when_it_chose_a_replica() -> None:
    from base.agent_wire import answer_variables
    from base.route_wire import RouteRefusal, RouteReply
    from services.router import spop

    def ack(status: int, answer: RouteReply | RouteRefusal) -> bytes:
        actions = spop.set_var_actions(answer_variables(status, answer))
        return spop.encode_frame(spop.FrameType.ACK, 1, 1, actions)[4:]

    assert route_agent._decided(ack(200, RouteReply(replica_id="r1", fallbacks=["r2"])))
    assert not route_agent._decided(ack(503, RouteRefusal(reason="no_replica")))
    assert not route_agent._decided(spop.encode_frame(spop.FrameType.AGENT_DISCONNECT, 0, 0, b"")[4:])
