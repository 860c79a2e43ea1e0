"""An event loop in a thread of its own for a frontend's background tasks (the supervisor, the syncer, the key
watcher, the request log, the canary guard), so they run whatever Serve's replica loop does
(services/frontend/README.md).

A task that raises is logged, counted (`restarts`) and started again after `RESTART_DELAY_S`; it never ends the
loop or its thread. That matters beyond the task: HAProxy is started from this thread with a parent-death signal, so
the thread ending would take HAProxy and every stream down with it (review finding #2: one exception in the canary
guard did exactly that). Only `stop()` ends the tasks and the thread.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import Counter
from collections.abc import Callable, Coroutine
from typing import Any

logger = logging.getLogger(__name__)
# A pause before a failed task starts again, so a task that fails at once does not spin.
RESTART_DELAY_S = 1.0


class BackgroundLoop:
    """Long-running coroutines (a frontend's syncer, its key watcher, its supervisor) on an event loop and thread of
    their own, so they keep running whatever the caller does; `stop()` cancels them all at once."""

    def __init__(
        self, tasks: list[Callable[[], Coroutine[Any, Any, None]]], restart_delay_s: float = RESTART_DELAY_S
    ) -> None:
        self._loop = asyncio.new_event_loop()
        self._main: asyncio.Task | None = None
        self._factories = tasks
        self._restart_delay_s = restart_delay_s
        # Restarts after a failure, by task (its factory's name).
        self.restarts: Counter[str] = Counter()
        self._thread = threading.Thread(target=self._run, name="sluice-frontend", daemon=True)

    async def _keep_running(self, factory: Callable[[], Coroutine[Any, Any, None]]) -> None:
        name = getattr(factory, "__qualname__", repr(factory))
        while True:
            try:
                await factory()
                return
            except Exception:
                self.restarts[name] += 1
                logger.exception("background task %s failed; starting it again in %g s", name, self._restart_delay_s)
            await asyncio.sleep(self._restart_delay_s)

    async def _run_all(self) -> None:
        tasks = [asyncio.create_task(self._keep_running(factory)) for factory in self._factories]
        try:
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        assert self._main is not None
        try:
            self._loop.run_until_complete(self._main)
        except asyncio.CancelledError:
            pass
        finally:
            self._loop.close()

    def start(self) -> None:
        self._main = self._loop.create_task(self._run_all())
        self._thread.start()

    def is_running(self) -> bool:
        return self._thread.is_alive()

    def submit(self, coroutine: Coroutine[Any, Any, Any]) -> asyncio.Future[Any]:
        """Run `coroutine` on this loop; await the returned future from any other loop."""
        return asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coroutine, self._loop))

    def stop(self) -> None:
        if self._main is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._main.cancel)
        self._thread.join(timeout=10)
