"""TLS at the frontend: HAProxy terminates it on the frontend's port (ALPN `h2,http/1.1`), optionally asks clients for
a certificate its CA signed (mTLS), and keeps a plain-HTTP listener only where the spec names one, on which a request
carrying an API key is refused (`REASON_TLS_REQUIRED`: the key crossed the network in clear).

HAProxy reads the certificate and its key as one PEM, written into the frontend's folder at start and replaced at run
time (`set ssl cert` / `commit ssl cert`) when the files change: services/frontend/tls_watcher.py.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, Field

from base.spec_config import SPEC_SECTION_CONFIG

ALPN = "h2,http/1.1"
_PRIVATE_KEY_MARK = "PRIVATE KEY-----"


class TLSError(ValueError):
    """A certificate or key file that cannot be used."""


class FrontendTLS(BaseModel):
    """`frontend.tls` of a spec: where the certificate and key are, whether clients must present one, and whether a
    plain-HTTP port stays open beside TLS."""

    model_config = SPEC_SECTION_CONFIG

    cert_file: Path
    """The certificate (with its chain) in PEM; its private key too, unless `key_file` names the key."""
    key_file: Path | None = None
    """The private key in PEM, when not in `cert_file`."""
    client_ca_file: Path | None = None
    """mTLS: a client must present a certificate this CA (PEM) signed."""
    plain_port: int | None = Field(None, ge=1, le=65535)
    """A plain-HTTP port kept open beside TLS (None: TLS only). A request with an API key is refused there."""

    def pem(self) -> str:
        """The certificate and its key as the one PEM HAProxy loads; TLSError naming the file that is unusable."""
        cert = _read(self.cert_file, "certificate")
        if "-----BEGIN CERTIFICATE-----" not in cert:
            raise TLSError(f"{self.cert_file}: no PEM certificate in it")
        key = _read(self.key_file, "key") if self.key_file is not None else ""
        if _PRIVATE_KEY_MARK not in cert + key:
            raise TLSError(f"{self.key_file or self.cert_file}: no PEM private key (give key_file)")
        return cert.rstrip() + "\n" + (key.rstrip() + "\n" if key else "")

    def bind_options(self, pem_path: Path) -> str:
        options = f"ssl crt {pem_path} alpn {ALPN}"
        if self.client_ca_file is not None:
            options += f" ca-file {self.client_ca_file.resolve()} verify required"
        return options


def _read(path: Path, what: str) -> str:
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError) as error:
        raise TLSError(f"cannot read the {what} file {path}: {error}") from None
