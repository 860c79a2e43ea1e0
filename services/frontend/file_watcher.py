"""What the API key and certificate watchers share: a pass every interval that applies a file's content through
HAProxy's runtime API, run in a worker thread (each runtime API command is a unix socket round trip), a file that
cannot be used logged once and the last good content kept."""

from __future__ import annotations

import asyncio
import logging
from abc import ABC, abstractmethod

from infra.haproxy.config import HAProxySettings
from infra.haproxy.runtime_api import RuntimeAPI


class FileWatcher(ABC):
    # Says in the logs what is watched ("the API key file", "the certificate files").
    watched = "the file"
    # How often the file is read.
    interval_s = 1.0

    def __init__(self, runtime: RuntimeAPI, settings: HAProxySettings, logger: logging.Logger) -> None:
        self._runtime = runtime
        self._settings = settings
        self._logger = logger
        self._last_error: str | None = None

    @abstractmethod
    def sync_once(self) -> bool:
        """Apply the file if it changed; whether HAProxy's state changed."""

    def _unusable(self, error: Exception, keeping: str) -> bool:
        """Log, once per distinct error, that the file cannot be used and what is kept; False (nothing applied)."""
        if str(error) != self._last_error:
            self._logger.error("keeping %s: %s", keeping, error)
            self._last_error = str(error)
        return False

    def _usable(self) -> None:
        self._last_error = None

    async def run(self, interval_s: float | None = None) -> None:
        interval_s = interval_s or self.interval_s
        while True:
            try:
                await asyncio.to_thread(self.sync_once)
            except Exception:  # a runtime API hiccup must not end the watch
                self._logger.exception("applying %s failed; retrying", self.watched)
            await asyncio.sleep(interval_s)
