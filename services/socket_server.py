"""An ASGI app served by uvicorn inside the caller's event loop, on sockets the caller bound first (so it knows its
ports before anything is served), and the stop a benchmark's child process waits for: its parent closing its stdin,
or SIGTERM. The simulated replicas' fleet and the policy bench's router run this way."""

from __future__ import annotations

import asyncio
import signal
import socket
import sys
from typing import Any

import uvicorn


def bound_listener(host: str) -> socket.socket:
    """A TCP socket bound to a free port of `host`, not yet listening (uvicorn listens on it)."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((host, 0))
    return listener


class SocketServer:
    """`app` on `sockets` once `start` returned; `stop` ends it."""

    def __init__(self, app: Any, sockets: list[socket.socket], lifespan: str = "off", backlog: int = 2048) -> None:
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan=lifespan, backlog=backlog)
        self._server = uvicorn.Server(config)
        # The caller's loop owns the signals (`until_told_to_stop`).
        self._server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
        self._sockets = sockets
        self._serving: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Serve, and return once uvicorn is up (or raise what stopped it)."""
        self._serving = asyncio.get_running_loop().create_task(self._server.serve(sockets=self._sockets))
        while not self._server.started:
            if self._serving.done():
                await self._serving
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        if self._serving is not None:
            self._server.should_exit = True
            await self._serving


async def until_told_to_stop() -> None:
    """Return once stdin reaches its end (the parent closed it, or died) or SIGTERM came."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_reader(sys.stdin.fileno(), lambda: stop.set() if not sys.stdin.buffer.read1(4096) else None)
    try:
        await stop.wait()
    finally:
        loop.remove_reader(sys.stdin.fileno())
        loop.remove_signal_handler(signal.SIGTERM)
