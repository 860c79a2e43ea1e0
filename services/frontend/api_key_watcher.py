"""Keeps the frontend's accepted API keys equal to the stack's key file, through HAProxy's runtime API.

Every `interval_s` a changed key file is swapped in atomically (`prepare acl` / `add acl` / `commit acl`, no reload)
and written to the workdir for a restarted HAProxy; a file that cannot be read keeps the last good list. Keys are
never logged. Details: services/frontend/README.md (API keys).
"""

from __future__ import annotations

import logging

from infra.api_keys import ApiKeyError, ApiKeySource, render_acl
from infra.haproxy.config import HAProxySettings
from infra.haproxy.runtime_api import RuntimeAPI
from services.frontend.file_watcher import FileWatcher

logger = logging.getLogger(__name__)

KEY_FILE_INTERVAL_S = 1.0


class ApiKeyWatcher(FileWatcher):
    watched = "the API key file"
    interval_s = KEY_FILE_INTERVAL_S

    def __init__(self, runtime: RuntimeAPI, settings: HAProxySettings, source: ApiKeySource) -> None:
        super().__init__(runtime, settings, logger)
        self._source = source
        self._applied = frozenset(runtime.show_acl(settings.keys_acl_path))

    @property
    def applied(self) -> frozenset[str]:
        """The digests HAProxy accepts now."""
        return self._applied

    def sync_once(self) -> bool:
        """Apply the key file if its digests changed; whether HAProxy's list changed."""
        try:
            digests = self._source.digests()
        except ApiKeyError as error:
            return self._unusable(error, f"the {len(self._applied)} accepted API keys")
        self._usable()
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
