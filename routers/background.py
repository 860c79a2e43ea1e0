"""Fire-and-forget asyncio tasks that cannot be garbage-collected before they finish."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any


def run_in_background(tasks: set[asyncio.Task], coro: Coroutine[Any, Any, Any]) -> asyncio.Task:
    """Start `coro` on the running loop and keep it in `tasks` until it is done.

    The event loop holds only a weak reference to a task; `tasks` is the strong one."""
    task = asyncio.get_running_loop().create_task(coro)
    tasks.add(task)
    task.add_done_callback(tasks.discard)
    return task
