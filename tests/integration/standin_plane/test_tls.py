"""TLS at the frontend (infra/haproxy/tls.py) on a real HAProxy in front of the stand-ins: streams over TLS with ALPN
offering h2, a plain port kept beside it that refuses API keys, a certificate replaced while 8 streams run (none cut;
new handshakes get the new certificate), and client certificates required by a CA (mTLS)."""

from __future__ import annotations

import shutil
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from cryptography import x509

from base.contracts import REASON_TLS_REQUIRED, SERVE_REASON_HEADER
from base.waiting import wait_until
from infra.haproxy.apps import AppRoute
from infra.haproxy.tls import FrontendTLS
from infra.tls_certs import TLSFiles, throwaway_certificate
from tests.integration.standin_plane.plane import Env, Plane, start_plane, stop_plane
from tests.integration.standin_plane.standins import APP, BODY_BUFFER_BYTES, CHAT_PATH, LOOPBACK
from tests.support.frontend_contract import assert_refused, register_frontend
from tests.support.ports import free_port
from tests.support.sse import stream_lines

pytestmark = pytest.mark.integration

STREAMS = 8
EVENTS, EVENT_DELAY_S = 30, 0.1  # 3 s streams: the replacement lands in their middle


class TLSPlane:
    def __init__(self, plane: Plane, folder: Path, first: TLSFiles, plain_port: int) -> None:
        self.plane, self.folder, self.first, self.plain_port = plane, folder, first, plain_port

    @property
    def cert(self) -> Path:
        return self.folder / "cert.pem"

    @property
    def key(self) -> Path:
        return self.folder / "key.pem"


@pytest.fixture(scope="module")
def tls(env: Env, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TLSPlane]:
    folder = tmp_path_factory.mktemp("tls")
    first = throwaway_certificate(folder / "first")
    shutil.copy(first.cert, folder / "cert.pem")
    shutil.copy(first.key, folder / "key.pem")
    plain_port = free_port()
    register_frontend(plain_port)
    settings = FrontendTLS(cert_file=folder / "cert.pem", key_file=folder / "key.pem", plain_port=plain_port)
    app = AppRoute(name=APP, forward_body=True, body_buffer_bytes=BODY_BUFFER_BYTES)
    replicas = [env.r1.endpoint, env.r2.endpoint]
    plane = start_plane(env.loop, folder / "haproxy", app, replicas, [env.router_a.endpoint], tls=settings)
    yield TLSPlane(plane, folder, first, plain_port)
    stop_plane(plane)


@pytest.fixture(scope="module")
def mtls(env: Env, tls: TLSPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Plane]:
    """A frontend that asks every client for a certificate the throwaway CA signed."""
    first = tls.first
    settings = FrontendTLS(cert_file=first.cert, key_file=first.key, client_ca_file=first.ca)
    app = AppRoute(name=APP, forward_body=True, body_buffer_bytes=BODY_BUFFER_BYTES)
    replicas = [env.r1.endpoint, env.r2.endpoint]
    folder = tmp_path_factory.mktemp("mtls")
    plane = start_plane(env.loop, folder, app, replicas, [env.router_a.endpoint], tls=settings)
    yield plane
    stop_plane(plane)


def _handshake(port: int, context: ssl.SSLContext) -> tuple[str | None, bytes]:
    """(the protocol ALPN chose, the server's certificate in DER) of a new TLS connection."""
    with socket.create_connection((LOOPBACK, port), timeout=5) as raw:
        with context.wrap_socket(raw, server_hostname=LOOPBACK) as conn:
            return conn.selected_alpn_protocol(), conn.getpeercert(binary_form=True) or b""


def _der(path: Path) -> bytes:
    from cryptography.hazmat.primitives.serialization import Encoding

    return x509.load_pem_x509_certificate(path.read_bytes()).public_bytes(Encoding.DER)


def _stream(url: str, verify: ssl.SSLContext, events: int = 2, delay_s: float = 0.0) -> tuple[int, list[str]]:
    body = {"events": events, "delay_s": delay_s}
    with httpx.Client(verify=verify, timeout=30) as client, client.stream("POST", url + CHAT_PATH, json=body) as r:
        return r.status_code, [line for line in stream_lines(r) if line.startswith("data: ")]


def _trusting(*cas: Path) -> ssl.SSLContext:
    context = ssl.create_default_context()
    for ca in cas:
        context.load_verify_locations(ca)
    return context


def test_a_stream_over_tls_after_alpn_offers_h2(tls: TLSPlane) -> None:
    context = _trusting(tls.first.ca)
    context.set_alpn_protocols(["h2", "http/1.1"])
    protocol, der = _handshake(tls.plane.haproxy.settings.port, context)
    assert protocol == "h2" and der == _der(tls.first.cert)
    status, events = _stream(tls.plane.url, _trusting(tls.first.ca))
    assert status == 200 and events[-1] == "data: [DONE]" and len(events) == 4
    # Plain HTTP on the TLS port is not served.
    with pytest.raises(httpx.HTTPError):
        httpx.post(f"http://{LOOPBACK}:{tls.plane.haproxy.settings.port}{CHAT_PATH}", json={}, timeout=5)


def test_the_kept_plain_port_serves_but_refuses_a_request_carrying_an_api_key(tls: TLSPlane) -> None:
    plain = f"http://{LOOPBACK}:{tls.plain_port}"
    with httpx.Client(timeout=10) as client:
        assert client.post(plain + CHAT_PATH, json={"events": 1}).status_code == 200
        refused = client.post(plain + CHAT_PATH, json={}, headers={"authorization": "Bearer sk-team-a"})
    assert refused.headers[SERVE_REASON_HEADER] == REASON_TLS_REQUIRED
    assert_refused(refused, 403)


def test_a_new_certificate_is_served_without_cutting_8_running_streams(tls: TLSPlane) -> None:
    second = throwaway_certificate(tls.folder / "second")
    trust = _trusting(tls.first.ca, second.ca)
    results: list[tuple[int, list[str]]] = []
    streams = [
        threading.Thread(target=lambda: results.append(_stream(tls.plane.url, trust, EVENTS, EVENT_DELAY_S)))
        for _ in range(STREAMS)
    ]
    for stream in streams:
        stream.start()
    time.sleep(0.5)
    # The key first, then the certificate: a pass that sees a new key with the old certificate keeps the old pair.
    shutil.copy(second.key, tls.key)
    shutil.copy(second.cert, tls.cert)
    port = tls.plane.haproxy.settings.port
    wait_until(5, lambda: _handshake(port, trust)[1] == _der(second.cert), "the new certificate in handshakes")
    for stream in streams:
        stream.join(timeout=30)
    assert [status for status, _ in results] == [200] * STREAMS
    assert all(len(events) == EVENTS + 2 and events[-1] == "data: [DONE]" for _, events in results)
    status, events = _stream(tls.plane.url, _trusting(second.ca))
    assert status == 200 and events[-1] == "data: [DONE]"


def test_with_a_client_ca_only_clients_holding_a_certificate_it_signed_are_served(tls: TLSPlane, mtls: Plane) -> None:
    without = _trusting(tls.first.ca)
    with pytest.raises(httpx.HTTPError):
        _stream(mtls.url, without)
    holding = _trusting(tls.first.ca)
    holding.load_cert_chain(tls.first.client_cert, tls.first.client_key)
    status, events = _stream(mtls.url, holding)
    assert status == 200 and events[-1] == "data: [DONE]"
    stranger = throwaway_certificate(tls.folder / "stranger")  # a client certificate another CA signed
    foreign = _trusting(tls.first.ca)
    foreign.load_cert_chain(stranger.client_cert, stranger.client_key)
    with pytest.raises(httpx.HTTPError):
        _stream(mtls.url, foreign)
