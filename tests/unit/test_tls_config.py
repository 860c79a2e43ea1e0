"""TLS at the frontend, without traffic: the spec's `frontend.tls`, HAProxy's listeners and rules it renders (checked by
`haproxy -c`), the PEM it loads (a private file), and throwaway certificates that verify for 127.0.0.1."""

from __future__ import annotations

import socket
import ssl
import stat
import threading
from pathlib import Path

import pytest
import yaml

from base.contracts import REASON_TLS_REQUIRED
from builders.specs import load_spec
from infra.haproxy.apps import AppRoute
from infra.haproxy.config import FRONTEND, HAProxySettings
from infra.haproxy.haproxy_cfg import render_config
from infra.haproxy.process import check_config, write_files
from infra.haproxy.tls import ALPN, FrontendTLS, TLSError
from infra.tls_certs import throwaway_certificate
from topologies.problems import SpecError

TEAMS = Path(__file__).resolve().parents[2] / "topologies" / "teams"


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory):
    return throwaway_certificate(tmp_path_factory.mktemp("certs"))


def _settings(tmp_path: Path, tls: FrontendTLS | None) -> HAProxySettings:
    return HAProxySettings(workdir=tmp_path, apps=[AppRoute(name="llm")], port=18000, prometheus_port=18404, tls=tls)


def _binds(config: str) -> list[str]:
    public = config[config.index(f"frontend {FRONTEND}\n") :].split("\n\n")[0]
    return [line.strip() for line in public.splitlines() if line.strip().startswith("bind ")]


def test_tls_on_the_port_and_no_plain_listener_unless_kept(tmp_path: Path, certs) -> None:
    only_tls = _settings(tmp_path, FrontendTLS(cert_file=certs.cert, key_file=certs.key))
    assert _binds(render_config(only_tls)) == [f"bind 127.0.0.1:18000 ssl crt {only_tls.tls_pem_path} alpn {ALPN}"]
    assert REASON_TLS_REQUIRED not in render_config(only_tls)
    kept = _settings(tmp_path, FrontendTLS(cert_file=certs.cert, key_file=certs.key, plain_port=18080))
    config = render_config(kept)
    assert _binds(config)[1] == "bind 127.0.0.1:18080"
    refusal = next(line for line in config.splitlines() if "return status 403" in line)
    assert "dst_port 18080" in refusal and "req.hdr(authorization) -m found" in refusal
    assert _binds(render_config(_settings(tmp_path, None))) == ["bind 127.0.0.1:18000"]


def test_haproxy_accepts_tls_with_client_certificates_and_the_pem_is_private(tmp_path: Path, certs) -> None:
    tls = FrontendTLS(cert_file=certs.cert, key_file=certs.key, client_ca_file=certs.ca, plain_port=18080)
    settings = _settings(tmp_path, tls)
    write_files(settings)
    assert "Configuration file is valid" in check_config(settings)
    assert f"ca-file {certs.ca} verify required" in _binds(settings.config_path.read_text())[0]
    assert stat.S_IMODE(settings.tls_pem_path.stat().st_mode) == 0o600
    assert settings.tls_pem_path.read_text() == certs.cert.read_text() + certs.key.read_text()


def test_unusable_files_are_named(tmp_path: Path, certs) -> None:
    with pytest.raises(TLSError, match="cannot read the certificate file"):
        FrontendTLS(cert_file=tmp_path / "missing.pem").pem()
    with pytest.raises(TLSError, match="no PEM private key"):
        FrontendTLS(cert_file=certs.cert).pem()
    with pytest.raises(TLSError, match="no PEM certificate"):
        FrontendTLS(cert_file=certs.key).pem()


def test_the_spec_resolves_tls_files_beside_it_and_refuses_what_cannot_serve(tmp_path: Path, certs) -> None:
    data = yaml.safe_load((TEAMS / "local-cpu.yaml").read_text())
    (tmp_path / "cert.pem").write_text(certs.cert.read_text())
    (tmp_path / "key.pem").write_text(certs.key.read_text())
    data["frontend"]["tls"] = {"cert_file": "cert.pem", "key_file": "key.pem", "plain_port": 8080}
    path = tmp_path / "stack.yaml"
    path.write_text(yaml.safe_dump(data))
    spec = load_spec(path)
    assert spec.frontend.tls is not None and spec.frontend.tls.cert_file == tmp_path / "cert.pem"
    for broken, message in (
        ({"cert_file": "nope.pem"}, "cannot read the certificate file"),
        ({"cert_file": "cert.pem", "key_file": "key.pem", "plain_port": spec.frontend.port}, "plain_port"),
    ):
        data["frontend"]["tls"] = broken
        path.write_text(yaml.safe_dump(data))
        with pytest.raises(SpecError, match=message):
            load_spec(path)


def test_a_throwaway_certificate_verifies_for_127_0_0_1_against_its_ca(certs) -> None:
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(certs.cert, certs.key)
    client = ssl.create_default_context(cafile=certs.ca)
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]

        def accept() -> None:
            conn, _ = listener.accept()
            with server.wrap_socket(conn, server_side=True) as tls:
                tls.recv(1)

        thread = threading.Thread(target=accept)
        thread.start()
        with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
            with client.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
                assert tls.version() in ("TLSv1.2", "TLSv1.3")
                tls.send(b"x")
        thread.join(timeout=5)
