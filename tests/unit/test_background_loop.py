"""The frontend's background loop keeps every task running: a task that raises is logged, counted and started again,
and neither its siblings nor the loop's thread (HAProxy's parent, by its death signal) end with it (review #2)."""

from __future__ import annotations

import asyncio
import threading

from base.waiting import wait_until
from services.frontend.background_loop import BackgroundLoop


def test_a_task_that_raises_is_started_again_and_takes_nothing_down() -> None:
    failures_left = [2]
    ticks = [0]
    failing_ran = threading.Event()

    async def guard() -> None:
        if failures_left[0]:
            failures_left[0] -= 1
            raise RuntimeError("no legacy ingress replica came UP")
        failing_ran.set()
        await asyncio.Event().wait()

    async def syncer() -> None:
        while True:
            ticks[0] += 1
            await asyncio.sleep(0.01)

    loop = BackgroundLoop([guard, syncer], restart_delay_s=0.05)
    loop.start()
    try:
        assert failing_ran.wait(10), "the failed task was not started again"
        ticked = ticks[0]
        wait_until(10, lambda: ticks[0] > ticked, "the other task to keep running", poll_s=0.01)
        assert loop.is_running()
        assert dict(loop.restarts) == {guard.__qualname__: 2}
    finally:
        loop.stop()
    assert not loop.is_running()


def test_a_task_that_returns_is_not_started_again() -> None:
    runs = [0]

    async def once() -> None:
        runs[0] += 1

    loop = BackgroundLoop([once], restart_delay_s=0.01)
    loop.start()
    wait_until(10, lambda: not loop.is_running(), "the loop to end with its only task", poll_s=0.01)
    assert runs == [1] and not loop.restarts
