"""Keeps the certificate HAProxy serves equal to the spec's certificate and key files, through the runtime API.

Every `interval_s` a changed pair is swapped in (`set ssl cert` / `commit ssl cert`): new handshakes get the new
certificate, open connections and their streams go on with the old one, nothing reloads. The pair is also written to
the workdir for a restarted HAProxy. Files that cannot be used (half-written, a key that does not match) keep the
last good certificate: HAProxy checks the pair before it commits.
"""

from __future__ import annotations

import logging

from infra.haproxy.config import HAProxySettings
from infra.haproxy.process import write_private
from infra.haproxy.runtime_api import RuntimeAPI, RuntimeAPIError
from infra.haproxy.tls import FrontendTLS, TLSError
from services.frontend.file_watcher import FileWatcher

logger = logging.getLogger(__name__)

CERT_FILE_INTERVAL_S = 1.0


class TLSWatcher(FileWatcher):
    watched = "the certificate files"
    interval_s = CERT_FILE_INTERVAL_S

    def __init__(self, runtime: RuntimeAPI, settings: HAProxySettings, tls: FrontendTLS) -> None:
        super().__init__(runtime, settings, logger)
        self._tls = tls
        self._applied = settings.tls_pem_path.read_text()

    @classmethod
    def for_settings(cls, runtime: RuntimeAPI, settings: HAProxySettings) -> TLSWatcher | None:
        return cls(runtime, settings, settings.tls) if settings.tls is not None else None

    def sync_once(self) -> bool:
        """Apply the files if they changed; whether HAProxy's certificate changed."""
        try:
            pem = self._tls.pem()
            if pem == self._applied:
                return False
            self._runtime.replace_ssl_cert(self._settings.tls_pem_path, pem)
        except (TLSError, RuntimeAPIError) as error:
            return self._unusable(error, "the certificate in use")
        self._usable()
        write_private(self._settings.tls_pem_path, pem)
        self._applied = pem
        logger.info("TLS: the new certificate of %s is in use", self._tls.cert_file)
        return True
