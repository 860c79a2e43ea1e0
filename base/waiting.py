"""The one deadline-polling helper: wait for something with a deadline, saying what is awaited every few seconds.

A replica's start that waits on another part of the stack (a router for the LLM replicas' endpoints, a DP rank for
its gang's rendezvous) must never wait forever: on the deadline it raises `StartDeadline`, which fails the replica's
constructor, and Serve shows the message as the deployment's reason.
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


class StartDeadline(TimeoutError):
    """A wait in a replica's start that passed its deadline."""


async def wait_for(
    probe: Callable[[], Awaitable[T | None]],
    what: str,
    timeout_s: float,
    poll_s: float,
    logger: logging.Logger,
    log_interval_s: float = WAIT_LOG_INTERVAL_S,
) -> T:
    """The first value of `probe()` that is not None, polled every `poll_s`; every `log_interval_s` a line says how
    long it has waited for `what`; past `timeout_s` it raises `StartDeadline` naming `what`."""
    started = time.monotonic()
    next_log = started + log_interval_s
    while (value := await probe()) is None:
        now = time.monotonic()
        if now - started >= timeout_s:
            raise StartDeadline(f"gave up after {timeout_s:.0f} s waiting for {what}")
        if now >= next_log:
            logger.warning("waiting %.0f s so far (deadline %.0f s) for %s", now - started, timeout_s, what)
            next_log = now + log_interval_s
        await asyncio.sleep(poll_s)
    return value
