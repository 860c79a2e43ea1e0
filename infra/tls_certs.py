"""Throwaway certificates for local tries and tests (`sluice serve --tls-self-signed`): a CA of its own, a server
certificate it signs for 127.0.0.1 and localhost, and a client certificate it signs (for mTLS: `client_ca_file` is
`ca.pem`), made with `cryptography` (no openssl shell-out). Clients trust `ca.pem`. Never for a stack others use: the
keys sit unencrypted in the folder.
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
    ca: Path  # what clients trust (and, for mTLS, what the server trusts)
    cert: Path  # the server's certificate
    key: Path  # its private key
    client_cert: Path  # a client's certificate, for mTLS
    client_key: Path


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    encoding, private = serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8
    return key.private_bytes(encoding, private, serialization.NoEncryption())


def throwaway_certificate(folder: Path, common_name: str = "sluice throwaway") -> TLSFiles:
    """A new CA, a server certificate it signs (for `SERVER_NAMES` and `SERVER_ADDRESSES`) and a client one, in
    `folder`."""
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
    alternative_names = [x509.DNSName(name) for name in SERVER_NAMES]
    alternative_names += [x509.IPAddress(ipaddress.ip_address(address)) for address in SERVER_ADDRESSES]
    server = _signed(
        ca, ca_key, common_name, ExtendedKeyUsageOID.SERVER_AUTH, x509.SubjectAlternativeName(alternative_names)
    )
    client = _signed(ca, ca_key, f"{common_name} client", ExtendedKeyUsageOID.CLIENT_AUTH)
    files = TLSFiles(*(folder / name for name in ("ca.pem", "cert.pem", "key.pem", "client.pem", "client-key.pem")))
    files.ca.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    for (cert, key), cert_path, key_path in (
        (server, files.cert, files.key),
        (client, files.client_cert, files.client_key),
    ):
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        key_path.touch(mode=0o600)
        key_path.write_bytes(_pem(key))
    return files


def _signed(
    ca: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    common_name: str,
    usage: x509.ObjectIdentifier,
    *extensions: x509.ExtensionType,
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """A new key and its certificate, signed by the CA, for `usage` (server or client authentication)."""
    now = datetime.datetime.now(datetime.UTC)
    key = ec.generate_private_key(ec.SECP256R1())
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
    )
    for extension in extensions:
        builder = builder.add_extension(extension, critical=False)
    return builder.sign(ca_key, hashes.SHA256()), key
