"""The one deadline-polling helper: `wait_until` (blocking) and `async_wait_until` (on an event loop: a replica's
start, a frontend's move; it says in its log what it waits for). Neither waits forever: docs/design.md §3.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")
# Often enough to follow a start in the replica's log, rarely enough not to flood it.
WAIT_LOG_INTERVAL_S = 5.0
# What a replica's start waits on is other replicas starting, and a GPU replica's model load is the slowest part
# (the deploy timeout of GPU specs is the same 30 minutes).
START_DEADLINE_S = 1800.0


class WaitTimeout(TimeoutError):
    """A wait that passed its deadline; the message names what was awaited."""


class StartDeadline(WaitTimeout):
    """An `async_wait_until` past its deadline: in a replica's start it fails the constructor (Serve shows why)."""


def _done(value: object) -> bool:
    return value is not None and value is not False


def wait_until(timeout_s: float, probe: Callable[[], T | None], what: str = "a condition", poll_s: float = 0.1) -> T:
    """The first value of `probe()` that is neither None nor False, polled every `poll_s`; past `timeout_s` it raises
    `WaitTimeout` naming `what`. The probe runs at least once, and once more at the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = probe()
        if _done(value):
            return value  # type: ignore[return-value]
        left = deadline - time.monotonic()
        if left <= 0:
            raise WaitTimeout(f"gave up after {timeout_s:g} s waiting for {what}")
        time.sleep(min(poll_s, left))


async def async_wait_until(
    timeout_s: float,
    probe: Callable[[], Awaitable[T | None]],
    what: str,
    poll_s: float,
    logger: logging.Logger,
    log_interval_s: float = WAIT_LOG_INTERVAL_S,
) -> T:
    """`wait_until` on an event loop (a replica's start, a frontend's move): at the first probe that finds nothing,
    then every `log_interval_s`, a line in `logger` says how long it has waited for `what` (at once, so a deploy
    that reads the replica's log under a short deadline names the wait); past `timeout_s` it raises
    `StartDeadline`."""
    started = time.monotonic()
    next_log = started
    while not _done(value := await probe()):
        now = time.monotonic()
        if now - started >= timeout_s:
            raise StartDeadline(f"gave up after {timeout_s:.0f} s waiting for {what}")
        if now >= next_log:
            logger.warning("waiting %.0f s so far (deadline %.0f s) for %s", now - started, timeout_s, what)
            next_log = now + log_interval_s
        await asyncio.sleep(poll_s)
    return value  # type: ignore[return-value]
