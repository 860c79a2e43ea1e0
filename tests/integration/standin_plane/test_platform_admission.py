"""A platform's HAProxy, real, in front of stand-in team frontends (SSE streams over a hold time): tenants from keys,
the access check, quotas, priority classes, fair share within a class, queue timeouts, and models attached and
detached at run time without a reload. One HAProxy for the module; each test attaches the models it needs."""

from __future__ import annotations

import asyncio
import hashlib
import statistics
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from pydantic import SecretStr

from base.contracts import (
    AUTHORIZATION_HEADER,
    DATA_PARALLEL_RANK_HEADER,
    INTERNAL_CREDENTIAL_HEADER,
    MODEL_HEADER,
    MODELS_PATH,
    PRIORITY_HEADER,
    REASON_INVALID_API_KEY,
    REASON_MODEL_MISSING,
    REASON_MODEL_NOT_FOUND,
    REASON_MODEL_UNAVAILABLE,
    REASON_QUEUE_TIMEOUT,
    REASON_QUOTA_EXCEEDED,
    REASON_TENANT_LIMIT,
    RETRY_AFTER_HEADER,
    SERVE_REASON_HEADER,
    TENANT_HEADER,
    TOKENS_HEADER,
    USAGE_PATH,
    USAGE_URL_HEADER,
)
from base.waiting import wait_until
from infra.haproxy.platform_cfg import QUEUE_TIMEOUT_RETRY_AFTER_S, write_platform_files
from infra.haproxy.platform_runtime import PlatformRuntime
from infra.haproxy.platform_settings import (
    SLOT_BACKEND_PREFIX,
    SLOT_SERVER,
    TENANT_TABLE,
    PlatformHAProxySettings,
    TenantRoute,
    slot_backend,
)
from infra.haproxy.process import HAProxyProcess
from infra.observability import PLATFORM_DASHBOARD_PATH
from infra.observability.dashboard import load_dashboard, metric_names
from tests.support.ports import free_port

pytestmark = pytest.mark.integration

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


def _digest(key: str) -> str:
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


@pytest.fixture(autouse=True)
def reset_behavior() -> None:
    """The package's stand-in stack plane is not used here: no reset of it (nor its start)."""


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    team = Team(loop, free_port())
    server = asyncio.run_coroutine_threadsafe(asyncio.start_server(team.handle, LOOPBACK, team.port), loop).result(5)
    settings = PlatformHAProxySettings(
        workdir=Path(tmp_path_factory.mktemp("platform")),
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
    keys = {_digest(key): name for name, key in KEYS.items()}
    process = HAProxyProcess(settings, write=lambda: write_platform_files(settings, keys, access, {}))
    process.start()
    try:
        yield Platform(settings, process, PlatformRuntime(process.runtime, settings), team)
    finally:
        process.stop()
        loop.call_soon_threadsafe(server.close)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)


def _headers(tenant: str, **extra: str) -> dict[str, str]:
    return {AUTHORIZATION_HEADER: f"Bearer {KEYS[tenant]}", **extra}


def _chat(platform: Platform, tenant: str | None, model: str | None = "team/chat", **headers: str) -> httpx.Response:
    body = {"messages": []} if model is None else {"model": model, "messages": []}
    sent = {**(_headers(tenant) if tenant else {}), **headers}
    return httpx.post(platform.url + CHAT_PATH, json=body, headers=sent, timeout=10)


def _assert_refusal(response: httpx.Response, status: int, reason: str) -> None:
    assert response.status_code == status, (response.status_code, response.headers, response.text)
    assert response.headers[SERVE_REASON_HEADER] == reason
    assert response.headers["content-type"] == "application/json"
    assert response.json()["error"]["code"] == status


def test_a_request_without_a_valid_key_is_refused_401(platform: Platform) -> None:
    platform.attach("team/chat", 4)
    for headers in ({}, {AUTHORIZATION_HEADER: "Bearer sk-nobody"}):
        response = httpx.post(platform.url + CHAT_PATH, json={"model": "team/chat"}, headers=headers, timeout=10)
        _assert_refusal(response, 401, REASON_INVALID_API_KEY)
        assert response.headers["www-authenticate"] == "Bearer"


def test_the_team_gets_neither_the_key_nor_internal_headers_a_client_sent(platform: Platform) -> None:
    platform.attach("team/chat", 4)
    forged = {"x-serve-replica": "r1", "x-sluice-capacity-token": "t", DATA_PARALLEL_RANK_HEADER: "1"}
    response = _chat(platform, "alpha", None, **{MODEL_HEADER: "team/chat", CLIENT_HEADER: "stripped", **forged})
    assert response.status_code == 200, response.text
    seen = next(headers for headers in reversed(platform.team.seen) if headers.get(CLIENT_HEADER) == "stripped")
    assert AUTHORIZATION_HEADER not in seen
    assert not [
        name for name in seen if name.startswith(("x-serve-", "x-sluice-")) or name == DATA_PARALLEL_RANK_HEADER
    ]


def test_a_model_comes_from_the_header_or_the_body_and_none_is_400(platform: Platform) -> None:
    platform.attach("team/chat", 4)
    assert _chat(platform, "alpha", "team/chat").status_code == 200
    assert _chat(platform, "alpha", "nope", **{MODEL_HEADER: "team/chat"}).status_code == 200
    _assert_refusal(_chat(platform, "alpha", None), 400, REASON_MODEL_MISSING)


def test_a_model_the_tenant_may_not_call_looks_like_one_that_does_not_exist(platform: Platform) -> None:
    platform.attach("beta-only", 2)
    assert _chat(platform, "beta", "beta-only").status_code == 200
    forbidden, absent = _chat(platform, "alpha", "beta-only"), _chat(platform, "alpha", "no-such-model")
    _assert_refusal(forbidden, 404, REASON_MODEL_NOT_FOUND)
    _assert_refusal(absent, 404, REASON_MODEL_NOT_FOUND)
    assert forbidden.json() == absent.json()


def test_the_models_list_is_the_tenants_own_attached_models(platform: Platform) -> None:
    platform.attach("team/chat", 4)
    platform.attach("beta-only", 2)
    platform.runtime.detach_model(MODELS["fleeting"][0], "fleeting")

    def listed(tenant: str) -> list[str]:
        response = httpx.get(platform.url + MODELS_PATH, headers=_headers(tenant), timeout=10)
        assert response.status_code == 200 and response.json()["object"] == "list"
        assert all(entry["object"] == "model" for entry in response.json()["data"])
        return [entry["id"] for entry in response.json()["data"]]

    assert "beta-only" in listed("beta") and "team/chat" in listed("beta")
    assert "beta-only" not in listed("alpha") and "team/chat" in listed("alpha")
    assert "fleeting" not in listed("alpha")  # may call it, but it is not attached


def test_a_tenant_over_its_requests_in_flight_is_refused_and_others_are_not(platform: Platform) -> None:
    platform.attach("team/chat", 8)

    async def load() -> tuple[list[int], int]:
        async with httpx.AsyncClient(base_url=platform.url, timeout=10) as client:
            hold = {HOLD_HEADER: "800"}
            body = {"model": "team/chat"}
            held = [client.post(CHAT_PATH, json=body, headers=_headers("capped", **hold)) for _ in range(2)]
            tasks = [asyncio.ensure_future(request) for request in held]
            await asyncio.sleep(0.3)
            third = await client.post(CHAT_PATH, json=body, headers=_headers("capped"))
            other = await client.post(CHAT_PATH, json=body, headers=_headers("alpha"))
            _assert_refusal(third, 429, REASON_TENANT_LIMIT)
            assert third.headers[RETRY_AFTER_HEADER] == "1"
            return [response.status_code for response in await asyncio.gather(*tasks)], other.status_code

    held, other = asyncio.run(load())
    assert held == [200, 200] and other == 200


def test_a_tenant_over_its_requests_per_minute_is_refused_and_others_are_not(platform: Platform) -> None:
    platform.attach("team/chat", 8)
    statuses = [_chat(platform, "metered").status_code for _ in range(5)]
    refused = _chat(platform, "metered")
    _assert_refusal(refused, 429, REASON_QUOTA_EXCEEDED)
    assert refused.headers[RETRY_AFTER_HEADER] == "60"
    assert statuses == [200] * 5 and _chat(platform, "alpha").status_code == 200


def _report(platform: Platform, tenant: str, tokens: int, credential: str = CREDENTIAL) -> int:
    """A replica's usage report to the platform's usage listener; its status."""
    headers = {INTERNAL_CREDENTIAL_HEADER: credential, TENANT_HEADER: tenant, TOKENS_HEADER: str(tokens)}
    url = f"http://{LOOPBACK}:{platform.settings.usage_port}{USAGE_PATH}"
    return httpx.post(url, headers=headers, timeout=10).status_code


def test_a_tenant_over_its_reported_tokens_per_minute_is_refused_and_another_is_not(platform: Platform) -> None:
    platform.attach("team/chat", 8)
    platform.team.seen.clear()
    assert _chat(platform, "counted").status_code == _chat(platform, "alpha").status_code == 200
    # The team gets the tenant and where to report for the quota's tenant only, with the cluster's credential.
    counted, alpha = platform.team.seen[-2:]
    assert counted[TENANT_HEADER] == "counted" and counted[INTERNAL_CREDENTIAL_HEADER] == CREDENTIAL
    assert counted[USAGE_URL_HEADER] == f"http://{LOOPBACK}:{platform.settings.usage_port}{USAGE_PATH}"
    assert TENANT_HEADER not in alpha and USAGE_URL_HEADER not in alpha
    # A report without the credential counts nothing.
    assert _report(platform, "counted", 500, credential="forged") == 403
    assert _chat(platform, "counted").status_code == 200
    assert _report(platform, "counted", 60) == 204
    assert _chat(platform, "counted").status_code == 200
    assert _report(platform, "counted", 40) == 204
    refused = _chat(platform, "counted")
    metrics = httpx.get(f"http://{LOOPBACK}:{platform.settings.prometheus_port}/sluice/metrics", timeout=10).text
    assert 'sluice_platform_tokens_total{tenant="counted"} 100' in metrics.splitlines()
    _assert_refusal(refused, 429, REASON_QUOTA_EXCEEDED)
    assert refused.headers[RETRY_AFTER_HEADER] == "60" and "100 tokens per minute" in refused.json()["error"]["message"]
    assert _chat(platform, "alpha").status_code == 200


def test_keys_and_access_are_replaced_at_run_time(platform: Platform) -> None:
    platform.attach("team/chat", 4)
    keys = {_digest(key): name for name, key in KEYS.items()}
    access = {(tenant, model) for model, (_, tenants) in MODELS.items() for tenant in tenants}
    platform.runtime.set_keys({digest: name for digest, name in keys.items() if name != "alpha"})
    platform.runtime.set_access(access - {("beta", "team/chat")})
    try:
        _assert_refusal(_chat(platform, "alpha"), 401, REASON_INVALID_API_KEY)
        _assert_refusal(_chat(platform, "beta"), 404, REASON_MODEL_NOT_FOUND)
    finally:
        platform.runtime.set_keys(keys)
        platform.runtime.set_access(access)
    assert _chat(platform, "alpha").status_code == 200 and _chat(platform, "beta").status_code == 200


def _pids(platform: Platform) -> tuple[int | None, str]:
    return platform.process.pid, platform.process.runtime.show_info()["Pid"]


def test_a_model_attaches_and_detaches_without_a_reload_and_its_stream_in_flight_finishes(platform: Platform) -> None:
    before = _pids(platform)
    _assert_refusal(_chat(platform, "alpha", "fleeting"), 404, REASON_MODEL_NOT_FOUND)
    platform.attach("fleeting", 2)
    assert _chat(platform, "alpha", "fleeting").status_code == 200

    with httpx.Client(base_url=platform.url, timeout=10) as client:
        headers = _headers("alpha", **{HOLD_HEADER: "1500"})
        with client.stream("POST", CHAT_PATH, json={"model": "fleeting"}, headers=headers) as stream:
            events = stream.iter_raw()
            first = next(events)
            platform.runtime.detach_model(MODELS["fleeting"][0], "fleeting")
            _assert_refusal(_chat(platform, "alpha", "fleeting"), 404, REASON_MODEL_NOT_FOUND)
            rest = b"".join(events)
    assert stream.status_code == 200
    assert (first + rest).count(b"data:") == CHUNKS
    assert _pids(platform) == before


def test_a_model_whose_team_is_down_is_503_model_unavailable(platform: Platform) -> None:
    platform.attach("down", 2, port=free_port())  # nothing listens there
    # Before its checks fail the connection is refused; after, the slot has no server: the same answer.
    _assert_refusal(_chat(platform, "alpha", "down"), 503, REASON_MODEL_UNAVAILABLE)
    backend = slot_backend(MODELS["down"][0])
    wait_until(
        10, lambda: platform.process.runtime.show_stat()[(backend, SLOT_SERVER)].status.startswith("DOWN"), "DOWN"
    )
    _assert_refusal(_chat(platform, "alpha", "down"), 503, REASON_MODEL_UNAVAILABLE)


def test_a_request_that_waits_out_the_queue_timeout_is_429(platform: Platform) -> None:
    platform.attach("solo", 1)

    async def load() -> tuple[httpx.Response, float, int]:
        async with httpx.AsyncClient(base_url=platform.url, timeout=15) as client:
            hold = {HOLD_HEADER: str(int((QUEUE_TIMEOUT_S + 1.5) * 1000))}
            held = asyncio.ensure_future(
                client.post(CHAT_PATH, json={"model": "solo"}, headers=_headers("alpha", **hold))
            )
            await asyncio.sleep(0.3)
            started = time.monotonic()
            waited = await client.post(CHAT_PATH, json={"model": "solo"}, headers=_headers("alpha"))
            return waited, time.monotonic() - started, (await held).status_code

    waited, elapsed, held = asyncio.run(load())
    _assert_refusal(waited, 429, REASON_QUEUE_TIMEOUT)
    assert waited.headers[RETRY_AFTER_HEADER] == str(QUEUE_TIMEOUT_RETRY_AFTER_S) and held == 200
    assert QUEUE_TIMEOUT_S - 0.2 <= elapsed < QUEUE_TIMEOUT_S + 1.0


def test_a_class_is_clamped_to_the_tenants_ceiling_and_an_unknown_one_is_its_default(platform: Platform) -> None:
    """Capacity 1, held: beta asks for interactive (its ceiling is batch), then alpha asks for an unknown class (its
    default, interactive). Alpha, queued later, is served first."""
    platform.attach("solo", 1)
    platform.team.seen.clear()

    async def load() -> None:
        async with httpx.AsyncClient(base_url=platform.url, timeout=15) as client:

            def send(tenant: str, name: str, asked: str | None) -> asyncio.Future[httpx.Response]:
                headers = _headers(tenant, **{HOLD_HEADER: "600", CLIENT_HEADER: name})
                if asked is not None:
                    headers[PRIORITY_HEADER] = asked
                return asyncio.ensure_future(client.post(CHAT_PATH, json={"model": "solo"}, headers=headers))

            holder = send("alpha", "holder", None)
            await asyncio.sleep(0.2)
            beta = send("beta", "beta", "interactive")
            await asyncio.sleep(0.2)
            alpha = send("alpha", "alpha", "urgent")
            assert [r.status_code for r in await asyncio.gather(holder, beta, alpha)] == [200, 200, 200]

    asyncio.run(load())
    assert [headers[CLIENT_HEADER] for headers in platform.team.seen] == ["holder", "alpha", "beta"]


@dataclass
class Tally:
    done: dict[str, int] = field(default_factory=dict)
    ttfts: dict[str, list[float]] = field(default_factory=dict)
    statuses: dict[int, int] = field(default_factory=dict)


async def _closed_loop(
    platform: Platform, clients: dict[str, tuple[int, str]], duration_s: float, hold_ms: int
) -> Tally:
    """Each tenant's clients send one request after another (`clients`: tenant -> (count, class asked)) for
    `duration_s`; hold times jitter +-50 % so that completions do not fall in step."""
    tally = Tally({name: 0 for name in clients}, {name: [] for name in clients})
    stop = time.monotonic() + duration_s

    async def client(http: httpx.AsyncClient, tenant: str, asked: str, index: int) -> None:
        sent = 0
        while time.monotonic() < stop and sent < 1000:
            sent += 1
            hold = int(hold_ms * (0.5 + ((index * 7 + sent * 13) % 11) / 10))
            headers = _headers(tenant, **{PRIORITY_HEADER: asked, HOLD_HEADER: str(hold)})
            started = time.monotonic()
            async with http.stream("POST", CHAT_PATH, json={"model": "share"}, headers=headers) as response:
                first = None
                async for _ in response.aiter_raw():
                    first = first or time.monotonic() - started
            tally.statuses[response.status_code] = tally.statuses.get(response.status_code, 0) + 1
            if response.status_code == 200 and first is not None:
                tally.done[tenant] += 1
                tally.ttfts[tenant].append(first)

    async with httpx.AsyncClient(base_url=platform.url, timeout=30, limits=httpx.Limits(max_connections=64)) as http:
        await asyncio.gather(
            *(client(http, tenant, asked, i) for tenant, (count, asked) in clients.items() for i in range(count))
        )
    return tally


def test_tenants_in_one_class_share_a_model_by_weight_not_by_their_clients(platform: Platform) -> None:
    """Capacity 4: alpha with 4 clients, beta with 16, both batch. FIFO gave alpha ~21 % of the completions
    (measured); the fair share gives it about half."""
    platform.attach("share", 4)
    platform.team.most_in_flight = 0
    tally = asyncio.run(_closed_loop(platform, {"alpha": (4, "batch"), "beta": (16, "batch")}, 6.0, 200))
    share = tally.done["alpha"] / (tally.done["alpha"] + tally.done["beta"])
    print(f"fair share: alpha {share:.3f} of {sum(tally.done.values())} completions, statuses {tally.statuses}")
    assert set(tally.statuses) == {200}
    assert share >= 0.40
    assert platform.team.most_in_flight <= 4


def test_the_interactive_class_is_served_before_batch(platform: Platform) -> None:
    """Capacity 4: alpha interactive with 2 clients, beta batch with 16."""
    platform.attach("share", 4)
    tally = asyncio.run(_closed_loop(platform, {"alpha": (2, "interactive"), "beta": (16, "batch")}, 6.0, 200))
    alpha, beta = statistics.median(tally.ttfts["alpha"]), statistics.median(tally.ttfts["beta"])
    print(f"priority: TTFT p50 alpha {alpha:.3f} s, beta {beta:.3f} s, statuses {tally.statuses}")
    assert set(tally.statuses) == {200}
    assert alpha * 4 < beta


def test_the_platforms_counters_count_by_tenant_and_reason(platform: Platform) -> None:
    platform.attach("team/chat", 4)
    _chat(platform, "alpha", "no-such-model")
    text = httpx.get(f"http://{LOOPBACK}:{platform.settings.prometheus_port}/sluice/metrics", timeout=10).text
    counts = {line.rsplit(" ", 1)[0]: int(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line[:1] != "#"}
    assert counts['sluice_platform_requests_total{tenant="alpha"}'] > 0
    # The same entry as `sluice status` reads it through the runtime API.
    entry = platform.runtime.api.show_table(TENANT_TABLE)["alpha"]
    assert (
        entry["http_req_cnt"] == counts['sluice_platform_requests_total{tenant="alpha"}'] and "http_req_rate" in entry
    )
    assert counts[f'sluice_platform_refusals_total{{tenant="alpha",reason="{REASON_MODEL_NOT_FOUND}"}}'] >= 1
    assert f'sluice_platform_refusals_total{{tenant="capped",reason="{REASON_MODEL_NOT_FOUND}"}}' not in counts
    # Which model each slot backend serves, to join HAProxy's own backend series with.
    backends = [key for key, value in counts.items() if key.startswith("sluice_platform_model_backend{") and value == 1]
    assert any(f'proxy="{SLOT_BACKEND_PREFIX}' in key and 'model="team/chat"' in key for key in backends), backends
    exporter = httpx.get(f"http://{LOOPBACK}:{platform.settings.prometheus_port}/metrics", timeout=10)
    # Every series the platform's dashboard reads is exported here.
    queried = set().union(*(metric_names(expr) for expr in load_dashboard(PLATFORM_DASHBOARD_PATH).exprs()))
    exported = {line.split("{")[0].split(" ")[0] for line in (text + exporter.text).splitlines() if line[:1] != "#"}
    assert queried and queried <= exported, sorted(queried - exported)
