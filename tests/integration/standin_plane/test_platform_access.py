"""A platform's HAProxy, real, in front of a stand-in team frontend: tenants from keys, the access check, the models
list, quotas (requests in flight, per minute, reported tokens), keys and access replaced at run time, and the
counters. One HAProxy for the module; each test attaches the models it needs."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest

from base.contracts import (
    AUTHORIZATION_HEADER,
    DATA_PARALLEL_RANK_HEADER,
    INTERNAL_CREDENTIAL_HEADER,
    MODEL_HEADER,
    MODELS_PATH,
    REASON_INVALID_API_KEY,
    REASON_MODEL_MISSING,
    REASON_MODEL_NOT_FOUND,
    REASON_QUOTA_EXCEEDED,
    REASON_TENANT_LIMIT,
    RETRY_AFTER_HEADER,
    TENANT_HEADER,
    TOKENS_HEADER,
    USAGE_PATH,
    USAGE_URL_HEADER,
)
from infra.haproxy.platform_settings import (
    SLOT_BACKEND_PREFIX,
    TENANT_TABLE,
)
from infra.observability import PLATFORM_DASHBOARD_PATH
from infra.observability.dashboard import load_dashboard, metric_names
from tests.support.platform_standin import (
    CHAT_PATH,
    CLIENT_HEADER,
    CREDENTIAL,
    HOLD_HEADER,
    KEYS,
    LOOPBACK,
    MODELS,
    Platform,
    assert_refusal,
    chat,
    digest,
    key_headers,
    running_platform,
)

pytestmark = pytest.mark.integration


@pytest.fixture(autouse=True)
def reset_behavior() -> None:
    """The package's stand-in stack plane is not used here: no reset of it (nor its start)."""


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    with running_platform(tmp_path_factory.mktemp("platform")) as started:
        yield started


def test_a_request_without_a_valid_key_is_refused_401(platform: Platform) -> None:
    platform.attach("team/chat", 4)
    for headers in ({}, {AUTHORIZATION_HEADER: "Bearer sk-nobody"}):
        response = httpx.post(platform.url + CHAT_PATH, json={"model": "team/chat"}, headers=headers, timeout=10)
        assert_refusal(response, 401, REASON_INVALID_API_KEY)
        assert response.headers["www-authenticate"] == "Bearer"


def test_the_team_gets_neither_the_key_nor_internal_headers_a_client_sent(platform: Platform) -> None:
    platform.attach("team/chat", 4)
    forged = {"x-serve-replica": "r1", "x-sluice-capacity-token": "t", DATA_PARALLEL_RANK_HEADER: "1"}
    response = chat(platform, "alpha", None, **{MODEL_HEADER: "team/chat", CLIENT_HEADER: "stripped", **forged})
    assert response.status_code == 200, response.text
    seen = next(headers for headers in reversed(platform.team.seen) if headers.get(CLIENT_HEADER) == "stripped")
    assert AUTHORIZATION_HEADER not in seen
    assert not [
        name for name in seen if name.startswith(("x-serve-", "x-sluice-")) or name == DATA_PARALLEL_RANK_HEADER
    ]


def test_a_model_comes_from_the_header_or_the_body_and_none_is_400(platform: Platform) -> None:
    platform.attach("team/chat", 4)
    assert chat(platform, "alpha", "team/chat").status_code == 200
    assert chat(platform, "alpha", "nope", **{MODEL_HEADER: "team/chat"}).status_code == 200
    assert_refusal(chat(platform, "alpha", None), 400, REASON_MODEL_MISSING)


def test_a_model_the_tenant_may_not_call_looks_like_one_that_does_not_exist(platform: Platform) -> None:
    platform.attach("beta-only", 2)
    assert chat(platform, "beta", "beta-only").status_code == 200
    forbidden, absent = chat(platform, "alpha", "beta-only"), chat(platform, "alpha", "no-such-model")
    assert_refusal(forbidden, 404, REASON_MODEL_NOT_FOUND)
    assert_refusal(absent, 404, REASON_MODEL_NOT_FOUND)
    assert forbidden.json() == absent.json()


def test_the_models_list_is_the_tenants_own_attached_models(platform: Platform) -> None:
    platform.attach("team/chat", 4)
    platform.attach("beta-only", 2)
    platform.runtime.detach_model(MODELS["fleeting"][0], "fleeting")

    def listed(tenant: str) -> list[str]:
        response = httpx.get(platform.url + MODELS_PATH, headers=key_headers(tenant), timeout=10)
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
            held = [client.post(CHAT_PATH, json=body, headers=key_headers("capped", **hold)) for _ in range(2)]
            tasks = [asyncio.ensure_future(request) for request in held]
            await asyncio.sleep(0.3)
            third = await client.post(CHAT_PATH, json=body, headers=key_headers("capped"))
            other = await client.post(CHAT_PATH, json=body, headers=key_headers("alpha"))
            assert_refusal(third, 429, REASON_TENANT_LIMIT)
            assert third.headers[RETRY_AFTER_HEADER] == "1"
            return [response.status_code for response in await asyncio.gather(*tasks)], other.status_code

    held, other = asyncio.run(load())
    assert held == [200, 200] and other == 200


def test_a_tenant_over_its_requests_per_minute_is_refused_and_others_are_not(platform: Platform) -> None:
    platform.attach("team/chat", 8)
    statuses = [chat(platform, "metered").status_code for _ in range(5)]
    refused = chat(platform, "metered")
    assert_refusal(refused, 429, REASON_QUOTA_EXCEEDED)
    assert refused.headers[RETRY_AFTER_HEADER] == "60"
    assert statuses == [200] * 5 and chat(platform, "alpha").status_code == 200


def _report(platform: Platform, tenant: str, tokens: int, credential: str = CREDENTIAL) -> int:
    """A replica's usage report to the platform's usage listener; its status."""
    headers = {INTERNAL_CREDENTIAL_HEADER: credential, TENANT_HEADER: tenant, TOKENS_HEADER: str(tokens)}
    url = f"http://{LOOPBACK}:{platform.settings.usage_port}{USAGE_PATH}"
    return httpx.post(url, headers=headers, timeout=10).status_code


def test_a_tenant_over_its_reported_tokens_per_minute_is_refused_and_another_is_not(platform: Platform) -> None:
    platform.attach("team/chat", 8)
    platform.team.seen.clear()
    assert chat(platform, "counted").status_code == chat(platform, "alpha").status_code == 200
    # The team gets the tenant and where to report for the quota's tenant only, with the cluster's credential.
    counted, alpha = platform.team.seen[-2:]
    assert counted[TENANT_HEADER] == "counted" and counted[INTERNAL_CREDENTIAL_HEADER] == CREDENTIAL
    assert counted[USAGE_URL_HEADER] == f"http://{LOOPBACK}:{platform.settings.usage_port}{USAGE_PATH}"
    assert TENANT_HEADER not in alpha and USAGE_URL_HEADER not in alpha
    # A report without the credential counts nothing.
    assert _report(platform, "counted", 500, credential="forged") == 403
    assert chat(platform, "counted").status_code == 200
    assert _report(platform, "counted", 60) == 204
    assert chat(platform, "counted").status_code == 200
    assert _report(platform, "counted", 40) == 204
    refused = chat(platform, "counted")
    metrics = httpx.get(f"http://{LOOPBACK}:{platform.settings.prometheus_port}/sluice/metrics", timeout=10).text
    assert 'sluice_platform_tokens_total{tenant="counted"} 100' in metrics.splitlines()
    assert_refusal(refused, 429, REASON_QUOTA_EXCEEDED)
    assert refused.headers[RETRY_AFTER_HEADER] == "60" and "100 tokens per minute" in refused.json()["error"]["message"]
    assert chat(platform, "alpha").status_code == 200


def test_keys_and_access_are_replaced_at_run_time(platform: Platform) -> None:
    platform.attach("team/chat", 4)
    keys = {digest(key): name for name, key in KEYS.items()}
    access = {(tenant, model) for model, (_, tenants) in MODELS.items() for tenant in tenants}
    platform.runtime.set_keys({digest: name for digest, name in keys.items() if name != "alpha"})
    platform.runtime.set_access(access - {("beta", "team/chat")})
    try:
        assert_refusal(chat(platform, "alpha"), 401, REASON_INVALID_API_KEY)
        assert_refusal(chat(platform, "beta"), 404, REASON_MODEL_NOT_FOUND)
    finally:
        platform.runtime.set_keys(keys)
        platform.runtime.set_access(access)
    assert chat(platform, "alpha").status_code == 200 and chat(platform, "beta").status_code == 200


def test_the_platforms_counters_count_by_tenant_and_reason(platform: Platform) -> None:
    platform.attach("team/chat", 4)
    chat(platform, "alpha", "no-such-model")
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
