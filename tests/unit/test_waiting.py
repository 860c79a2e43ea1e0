"""The one deadline-polling helper (blocking and a replica start's) and the router's wait for its replicas."""

from __future__ import annotations

import asyncio
import logging

import pytest

from base.waiting import StartDeadline, WaitTimeout, async_wait_until, wait_until
from services.router.live_replicas import LiveReplicas
from services.serve_internals import ReplicaEndpoint


def test_a_wait_returns_the_first_value_it_finds() -> None:
    answers = iter([None, None, "ready"])

    async def probe() -> str | None:
        return next(answers)

    assert asyncio.run(async_wait_until(5, probe, "the answer", 0.001, logging.getLogger("t"))) == "ready"


def test_a_wait_logs_what_it_waits_for_and_gives_up_at_its_deadline(caplog: pytest.LogCaptureFixture) -> None:
    async def never() -> None:
        return None

    with caplog.at_level(logging.WARNING, logger="t"), pytest.raises(StartDeadline, match="waiting for the answer"):
        asyncio.run(async_wait_until(0.3, never, "the answer", 0.01, logging.getLogger("t"), log_interval_s=0.1))
    assert any("for the answer" in record.getMessage() for record in caplog.records)


def test_a_wait_says_what_it_waits_for_at_its_first_empty_probe(caplog: pytest.LogCaptureFixture) -> None:
    # A deploy with a 10 s deadline reads the router's log while the router waits: a first line only after
    # `log_interval_s` (5 s) came too late on a loaded machine.
    answers = iter([None, None, "ready"])

    async def probe() -> str | None:
        return next(answers)

    with caplog.at_level(logging.WARNING, logger="t"):
        asyncio.run(async_wait_until(5, probe, "the answer", 0.001, logging.getLogger("t"), log_interval_s=60))
    assert [record.getMessage() for record in caplog.records] == ["waiting 0 s so far (deadline 5 s) for the answer"]


def test_a_router_without_endpoints_fails_its_start_naming_the_app() -> None:
    async def none_listed() -> list[ReplicaEndpoint]:
        return []

    live = LiveReplicas(none_listed, capacity=8, refresh_interval_s=0.01, what="a running replica of app 'x-llm'")
    with pytest.raises(StartDeadline, match="a running replica of app 'x-llm'"):
        asyncio.run(live.start(timeout_s=0.1))


def test_a_blocking_wait_returns_the_first_true_value_and_names_what_it_gave_up_on() -> None:
    answers = iter([False, None, 7])
    assert wait_until(5, lambda: next(answers), "seven", poll_s=0.001) == 7
    probes = []
    with pytest.raises(WaitTimeout, match="waiting for the moon"):
        wait_until(0.05, lambda: probes.append(1), "the moon", poll_s=0.01)
    assert len(probes) >= 2
