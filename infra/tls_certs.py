"""Throwaway certificates for local tries and tests (`sluice serve --tls-self-signed`): a CA of its own and a server
certificate it signs for 127.0.0.1 and localhost, made with `cryptography` (no openssl shell-out). Clients trust
`ca.pem`. Never for a stack others use: its key sits unencrypted in the folder.
"""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path
from typing import NamedTuple

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

# Long enough for a session of tries, short enough that a forgotten one expires.
VALID_DAYS = 7
SERVER_NAMES = ("localhost",)
SERVER_ADDRESSES = ("127.0.0.1",)


class TLSFiles(NamedTuple):
    ca: Path  # what clients trust
    cert: Path  # the server's certificate
    key: Path  # its private key


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    encoding, private = serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8
    return key.private_bytes(encoding, private, serialization.NoEncryption())


def throwaway_certificate(folder: Path, common_name: str = "sluice throwaway") -> TLSFiles:
    """A new CA and a server certificate it signs (for `SERVER_NAMES` and `SERVER_ADDRESSES`), in `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(_name(f"{common_name} CA"))
        .issuer_name(_name(f"{common_name} CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    alternative_names = [x509.DNSName(name) for name in SERVER_NAMES]
    alternative_names += [x509.IPAddress(ipaddress.ip_address(address)) for address in SERVER_ADDRESSES]
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
        .add_extension(x509.SubjectAlternativeName(alternative_names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    files = TLSFiles(folder / "ca.pem", folder / "cert.pem", folder / "key.pem")
    files.ca.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    files.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    files.key.touch(mode=0o600)
    files.key.write_bytes(_pem(key))
    return files
