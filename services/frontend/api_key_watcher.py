"""Keeps the frontend's accepted API keys equal to the stack's key file, through HAProxy's runtime API.

Every `interval_s` a changed key file is swapped in atomically (`prepare acl` / `add acl` / `commit acl`, no reload)
and written to the workdir for a restarted HAProxy; a file that cannot be read keeps the last good list. Keys are
never logged. Details: services/frontend/README.md (API keys).
"""

from __future__ import annotations

import asyncio
import logging

from infra.api_keys import ApiKeyError, ApiKeySource, render_acl
from infra.haproxy.config import HAProxySettings
from infra.haproxy.runtime_api import RuntimeAPI

logger = logging.getLogger(__name__)

KEY_FILE_INTERVAL_S = 1.0


class ApiKeyWatcher:
    def __init__(self, runtime: RuntimeAPI, settings: HAProxySettings, source: ApiKeySource) -> None:
        self._runtime = runtime
        self._settings = settings
        self._source = source
        self._applied = frozenset(runtime.show_acl(settings.keys_acl_path))
        self._last_error: str | None = None

    @property
    def applied(self) -> frozenset[str]:
        """The digests HAProxy accepts now."""
        return self._applied

    def sync_once(self) -> bool:
        """Apply the key file if its digests changed; whether HAProxy's list changed."""
        try:
            digests = self._source.digests()
        except ApiKeyError as error:
            if str(error) != self._last_error:
                logger.error("keeping the %d accepted API keys: %s", len(self._applied), error)
                self._last_error = str(error)
            return False
        self._last_error = None
        if digests == self._applied:
            return False
        self._runtime.replace_acl(self._settings.keys_acl_path, sorted(digests))
        self._settings.keys_acl_path.write_text(render_acl(digests))
        logger.info("API keys: %d accepted (was %d)", len(digests), len(self._applied))
        self._applied = digests
        return True

    @classmethod
    def for_settings(cls, runtime: RuntimeAPI, settings: HAProxySettings) -> ApiKeyWatcher | None:
        """The watcher of a frontend whose keys come from a file (an environment variable is read once, at start)."""
        keys = settings.protection.api_keys
        return cls(runtime, settings, keys) if keys is not None and keys.file is not None else None

    async def run(self, interval_s: float = KEY_FILE_INTERVAL_S) -> None:
        while True:
            try:
                await asyncio.to_thread(self.sync_once)
            except Exception:  # a runtime API hiccup must not end the watch
                logger.exception("applying the API key file failed; retrying")
            await asyncio.sleep(interval_s)
