"""A platform's HAProxy, real, in front of a stand-in team frontend (SSE streams over a hold time) for the
standin-plane platform tests: its tenants, keys and models, the stand-in, and the requests the tests send."""

from __future__ import annotations

import asyncio
import hashlib
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from pydantic import SecretStr

from base.contracts import (
    AUTHORIZATION_HEADER,
    SERVE_REASON_HEADER,
)
from infra.haproxy.platform_cfg import write_platform_files
from infra.haproxy.platform_runtime import PlatformRuntime
from infra.haproxy.platform_settings import (
    PlatformHAProxySettings,
    TenantRoute,
)
from infra.haproxy.process import HAProxyProcess
from tests.support.ports import free_port

LOOPBACK = "127.0.0.1"
CHAT_PATH = "/v1/chat/completions"
QUEUE_TIMEOUT_S = 3.0
# Test-only request headers the stand-in team reads (not internal: the platform forwards them).
HOLD_HEADER, CLIENT_HEADER = "x-test-hold-ms", "x-test-client"
CHUNKS = 5
TENANTS = [
    TenantRoute(name="alpha", priority_class=0, weight=1.0),
    TenantRoute(name="beta", priority_class=1, weight=1.0),
    TenantRoute(name="capped", priority_class=0, weight=1.0, max_concurrent_requests=2),
    TenantRoute(name="metered", priority_class=0, weight=1.0, requests_per_minute=5),
    TenantRoute(name="counted", priority_class=0, weight=1.0, tokens_per_minute=100),
]
KEYS = {name: f"sk-{name}" for name in ("alpha", "beta", "capped", "metered", "counted")}
CREDENTIAL = "test-internal-credential"
# Models: (slot, who may call it). Attached by the tests that use them.
MODELS = {
    "team/chat": (0, {"alpha", "beta", "capped", "metered", "counted"}),
    "solo": (1, {"alpha", "beta"}),
    "beta-only": (2, {"beta"}),
    "fleeting": (3, {"alpha"}),
    "down": (4, {"alpha"}),
    "share": (5, {"alpha", "beta"}),
}


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass
class Team:
    """A stand-in team frontend: every POST streams `CHUNKS` SSE events over the request's hold time."""

    loop: asyncio.AbstractEventLoop
    port: int
    seen: list[dict[str, str]] = field(default_factory=list)
    in_flight: int = 0
    most_in_flight: int = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode().split("\r\n")
                headers = {
                    k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)
                }
                if length := int(headers.get("content-length", 0)):
                    await reader.readexactly(length)
                self.seen.append(headers)
                self.in_flight += 1
                self.most_in_flight = max(self.most_in_flight, self.in_flight)
                try:
                    await self._stream(writer, int(headers.get(HOLD_HEADER, "100")) / 1000)
                finally:
                    self.in_flight -= 1
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def _stream(self, writer: asyncio.StreamWriter, hold_s: float) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        for index in range(CHUNKS):
            data = b'data: {"i": %d}\n\n' % index
            writer.write(b"%x\r\n%s\r\n" % (len(data), data))
            await writer.drain()
            await asyncio.sleep(hold_s / CHUNKS)
        writer.write(b"0\r\n\r\n")
        await writer.drain()


@dataclass
class Platform:
    settings: PlatformHAProxySettings
    process: HAProxyProcess
    runtime: PlatformRuntime
    team: Team

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.settings.port}"

    def attach(self, model: str, capacity: int, port: int | None = None) -> None:
        self.runtime.attach_model(MODELS[model][0], model, LOOPBACK, port or self.team.port, capacity)


@contextmanager
def running_platform(folder: Path) -> Iterator[Platform]:
    """The platform's HAProxy and its stand-in team, no model attached yet."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    team = Team(loop, free_port())
    server = asyncio.run_coroutine_threadsafe(asyncio.start_server(team.handle, LOOPBACK, team.port), loop).result(5)
    settings = PlatformHAProxySettings(
        workdir=folder,
        platform="test",
        tenants=TENANTS,
        port=free_port(),
        prometheus_port=free_port(),
        model_slots=len(MODELS),
        queue_timeout_s=QUEUE_TIMEOUT_S,
        usage_port=free_port(),
        internal_credential=SecretStr(CREDENTIAL),
    )
    access = {(tenant, model) for model, (_, tenants) in MODELS.items() for tenant in tenants}
    keys = {digest(key): name for name, key in KEYS.items()}
    process = HAProxyProcess(settings, write=lambda: write_platform_files(settings, keys, access, {}))
    process.start()
    try:
        yield Platform(settings, process, PlatformRuntime(process.runtime, settings), team)
    finally:
        process.stop()
        loop.call_soon_threadsafe(server.close)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)


def key_headers(tenant: str, **extra: str) -> dict[str, str]:
    return {AUTHORIZATION_HEADER: f"Bearer {KEYS[tenant]}", **extra}


def chat(platform: Platform, tenant: str | None, model: str | None = "team/chat", **extra: str) -> httpx.Response:
    body = {"messages": []} if model is None else {"model": model, "messages": []}
    sent = {**(key_headers(tenant) if tenant else {}), **extra}
    return httpx.post(platform.url + CHAT_PATH, json=body, headers=sent, timeout=10)


def assert_refusal(response: httpx.Response, status: int, reason: str) -> None:
    assert response.status_code == status, (response.status_code, response.headers, response.text)
    assert response.headers[SERVE_REASON_HEADER] == reason
    assert response.headers["content-type"] == "application/json"
    assert response.json()["error"]["code"] == status
