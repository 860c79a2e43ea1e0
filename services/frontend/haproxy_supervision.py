"""Starting and retiring the HAProxy a replica supervises, shared by a stack's frontend (`services.frontend.app`)
and a platform's (`services.platform.app`).

`start_until_up` retries a start while the old HAProxy's port is still held (its worker exits after its master) and
warns when HAProxy could not leave Ray's worker niceness (`DATA_PLANE_NICENESS`: infra/haproxy/process.py says what
that costs). `retire` is a replica's stop: its supervisor starts no new HAProxy, HAProxy soft-stops and serves what
it holds for up to the drain, while the loop whose thread started it (its death signal) lives; then the loop ends
and the workdir goes.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import threading
from collections.abc import Callable

from infra.haproxy.process import DATA_PLANE_NICENESS, HAProxyProcess, HAProxyStartError
from services.frontend.background_loop import BackgroundLoop
from services.orphan_guard import guard_descendants

logger = logging.getLogger(__name__)

# How long a failed start waits before the next (and how often a supervisor looks at HAProxy's master process).
SUPERVISE_INTERVAL_S = 0.2


async def start_until_up(start: Callable[[], HAProxyProcess]) -> HAProxyProcess:
    """`start()` until HAProxy runs; it ends with this process, however that ends (`services.orphan_guard`, beside
    its master's death signal, which a thread's end also sends)."""
    guard_descendants()
    while True:
        try:
            haproxy = start()
        except HAProxyStartError as error:
            logger.error("HAProxy did not start, retrying: %s", error)
            await asyncio.sleep(SUPERVISE_INTERVAL_S)
            continue
        if (haproxy.niceness or 0) > DATA_PLANE_NICENESS:
            logger.warning(
                "HAProxy runs at niceness %s, level with Ray's workers (no privilege to lower it to %s): "
                "under engine load each token waits longer for a core",
                haproxy.niceness,
                DATA_PLANE_NICENESS,
            )
        return haproxy


def retire(replica: object, drain_s: float) -> None:
    """Stop a supervising replica's parts (its `_retiring` event, `_haproxy`, `_loop` and `_settings.workdir`),
    whichever it got to build: a constructor may have failed half-way."""
    retiring: threading.Event | None = getattr(replica, "_retiring", None)
    haproxy: HAProxyProcess | None = getattr(replica, "_haproxy", None)
    loop: BackgroundLoop | None = getattr(replica, "_loop", None)
    settings = getattr(replica, "_settings", None)
    if retiring is not None:
        retiring.set()
    if haproxy is not None:
        haproxy.stop(grace_s=drain_s)
    if loop is not None:
        loop.stop()
    if settings is not None:
        shutil.rmtree(settings.workdir, ignore_errors=True)
