"""An event loop in a thread of its own for a frontend's background tasks (the supervisor, the syncer, the key
watcher, the request log, the canary guard), so they run whatever Serve's replica loop does
(services/frontend/README.md).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine
from typing import Any


class BackgroundLoop:
    """Long-running coroutines (a frontend's syncer, its key watcher, its supervisor) on an event loop and thread of
    their own, so they keep running whatever the caller does; `stop()` cancels them all at once."""

    def __init__(self, tasks: list[Callable[[], Coroutine[Any, Any, None]]]) -> None:
        self._loop = asyncio.new_event_loop()
        self._main: asyncio.Task | None = None
        self._factories = tasks
        self._thread = threading.Thread(target=self._run, name="sluice-frontend", daemon=True)

    async def _run_all(self) -> None:
        tasks = [asyncio.create_task(factory()) for factory in self._factories]
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

    def submit(self, coroutine: Coroutine[Any, Any, Any]) -> asyncio.Future[Any]:
        """Run `coroutine` on this loop; await the returned future from any other loop."""
        return asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coroutine, self._loop))

    def stop(self) -> None:
        if self._main is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._main.cancel)
        self._thread.join(timeout=10)
