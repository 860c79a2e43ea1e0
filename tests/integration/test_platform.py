"""One platform for two teams, end to end on the session's Ray cluster: a platform (own name and ports, generated
keys) and two team stacks attached to it, each with one real tiny vLLM replica of capacity 4. Each tenant's key
reaches its own models through the platform's one port; admission shares a full model fairly between tenants and
serves an interactive tenant ahead of a batch one; a quota refuses one tenant, not the other; a team going down and
coming back cuts nothing of another team's streams."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from base.contracts import (
    MODELS_PATH,
    REASON_INVALID_API_KEY,
    REASON_MODEL_NOT_FOUND,
    REASON_QUOTA_EXCEEDED,
    RETRY_AFTER_HEADER,
    SERVE_REASON_HEADER,
)
from sluice.deploy.apply import delete_plan
from sluice.deploy.platforms import platform_handle_status, wait_attached
from tests.support.platform_stack import Platform, platform_stack
from tests.support.sse import chunks, data_lines
from tests.support.team_stack import TeamStack, team_stack
from tests.support.tenant_load import Clients, TenantLoad, tenant_load

pytestmark = pytest.mark.integration

ALPHA_MODEL, BETA_MODEL = "alpha-tiny", "beta-tiny"
CAPACITY = 4
# Long enough for each run to hold about a hundred streams per tenant at the tiny model's speed on 2 cores.
RUN_S = 12.0
# Alpha streams while beta goes down and comes back (the redeploy takes about 25 s).
DOWN_AND_UP_S = 30.0
GAMMA_REQUESTS_PER_MINUTE = 5
DELTA_TOKENS_PER_MINUTE = 2000
# Delta's requests until its quota refuses one: about 30 of 70 tokens each; a bound, never reached.
MAX_DELTA_REQUESTS = 100


@dataclass
class PlatformWithTeams:
    platform: Platform
    alpha: TeamStack
    beta: TeamStack


@pytest.fixture(scope="module")
def stacks(
    ray_cluster: None, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[PlatformWithTeams]:
    tenants = [
        {"team": "alpha", "priority": "interactive"},
        {"team": "beta", "priority": "batch", "models": [BETA_MODEL, ALPHA_MODEL]},
        {"team": "gamma", "models": [ALPHA_MODEL], "limits": {"requests_per_minute": GAMMA_REQUESTS_PER_MINUTE}},
        {"team": "delta", "models": [ALPHA_MODEL], "limits": {"tokens_per_minute": DELTA_TOKENS_PER_MINUTE}},
    ]
    model = {"replicas": 1, "max_ongoing_requests": CAPACITY}
    with (
        platform_stack("plat", tmp_path_factory.mktemp("platform"), tenants) as platform,
        team_stack(
            "local-cpu.yaml",
            "chat",
            tmp_path_factory.mktemp("alpha"),
            platform="plat",
            team="alpha",
            models={**model, "name": ALPHA_MODEL},
        ) as alpha,
        team_stack(
            "local-cpu.yaml",
            "chat",
            tmp_path_factory.mktemp("beta"),
            platform="plat",
            team="beta",
            models={**model, "name": BETA_MODEL},
        ) as beta,
    ):
        assert alpha.url == beta.url == platform.url
        yield PlatformWithTeams(platform, alpha, beta)


def _stream(client: httpx.Client, url: str, model: str, headers: dict[str, str]) -> httpx.Response:
    body = {"model": model, "prompt": "hello", "max_tokens": 8, "stream": True}
    with client.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as response:
        response.read()
        return response


def test_each_key_streams_its_own_model_through_one_port_and_nothing_else(stacks: PlatformWithTeams) -> None:
    platform = stacks.platform
    with httpx.Client(timeout=60) as client:
        for team, model in (("alpha", ALPHA_MODEL), ("beta", BETA_MODEL)):
            served = _stream(client, platform.url, model, platform.headers(team))
            assert served.status_code == 200, served.text
            assert chunks(data_lines(served))[-1]["choices"][0]["finish_reason"] == "length"
        keyless = _stream(client, platform.url, ALPHA_MODEL, {})
        assert keyless.status_code == 401 and keyless.headers[SERVE_REASON_HEADER] == REASON_INVALID_API_KEY
        # Another team's model and a model nobody attached: the same refusal, no hint that the first exists.
        others = _stream(client, platform.url, BETA_MODEL, platform.headers("alpha"))
        nowhere = _stream(client, platform.url, "no-such-model", platform.headers("alpha"))
        assert others.status_code == nowhere.status_code == 404
        assert others.headers[SERVE_REASON_HEADER] == nowhere.headers[SERVE_REASON_HEADER] == REASON_MODEL_NOT_FOUND
        assert others.json()["error"]["message"].replace(BETA_MODEL, "M") == nowhere.json()["error"]["message"].replace(
            "no-such-model", "M"
        )
        listed = client.get(f"{platform.url}{MODELS_PATH}", headers=platform.headers("alpha"))
        assert [entry["id"] for entry in listed.json()["data"]] == [ALPHA_MODEL]
        listed = client.get(f"{platform.url}{MODELS_PATH}", headers=platform.headers("beta"))
        assert sorted(entry["id"] for entry in listed.json()["data"]) == [ALPHA_MODEL, BETA_MODEL]


def _every_refusal_is_a_429_with_retry_after_and_nothing_was_cut(load: TenantLoad) -> None:
    for refused in load.refusals():
        assert refused.status == 429 and refused.retry_after and refused.reason, refused
    assert not load.cut(), load.cut()


def test_a_full_model_is_shared_fairly_between_two_batch_tenants(stacks: PlatformWithTeams) -> None:
    """Capacity 4; alpha 4 clients, beta 16, both batch: arrival order would give alpha about 20 %."""
    platform = stacks.platform
    groups = [
        Clients("alpha", platform.keys["alpha"], ALPHA_MODEL, 4, priority="batch"),
        Clients("beta", platform.keys["beta"], ALPHA_MODEL, 16, priority="batch"),
    ]
    load = asyncio.run(tenant_load(platform.url, groups, RUN_S))
    print(f"alpha {load.completed('alpha')}, beta {load.completed('beta')}: alpha's share {load.share('alpha'):.2f}")
    assert load.completed("alpha") + load.completed("beta") >= 40
    assert load.share("alpha") >= 0.40
    _every_refusal_is_a_429_with_retry_after_and_nothing_was_cut(load)


def test_an_interactive_tenant_starts_ahead_of_a_batch_flood(stacks: PlatformWithTeams) -> None:
    platform = stacks.platform
    groups = [
        Clients("alpha", platform.keys["alpha"], ALPHA_MODEL, 2),
        # Beta's ceiling is batch: asking for interactive gets batch.
        Clients("beta", platform.keys["beta"], ALPHA_MODEL, 16, priority="interactive"),
    ]
    load = asyncio.run(tenant_load(platform.url, groups, RUN_S))
    alpha, beta = load.ttft_p50("alpha"), load.ttft_p50("beta")
    print(f"TTFT p50 alpha {alpha * 1000:.0f} ms, beta {beta * 1000:.0f} ms: x{alpha / beta:.2f}")
    assert alpha <= 0.25 * beta
    _every_refusal_is_a_429_with_retry_after_and_nothing_was_cut(load)


def test_a_tenant_over_its_requests_per_minute_is_refused_and_another_is_not(stacks: PlatformWithTeams) -> None:
    platform = stacks.platform
    with httpx.Client(timeout=60) as client:
        answers = [_stream(client, platform.url, ALPHA_MODEL, platform.headers("gamma")) for _ in range(8)]
        alpha = _stream(client, platform.url, ALPHA_MODEL, platform.headers("alpha"))
    statuses = [answer.status_code for answer in answers]
    assert statuses[:GAMMA_REQUESTS_PER_MINUTE] == [200] * GAMMA_REQUESTS_PER_MINUTE and set(statuses[-2:]) == {429}
    over = answers[-1]
    assert over.headers[SERVE_REASON_HEADER] == REASON_QUOTA_EXCEEDED and int(over.headers[RETRY_AFTER_HEADER]) > 0
    assert over.json()["error"]["type"] == "rate_limit_error"
    assert alpha.status_code == 200
    # `sluice status` shows each tenant's live usage.
    status = platform_handle_status(platform.spec.stack)
    assert status is not None
    gamma = next(tenant for tenant in status["tenants"] if tenant["team"] == "gamma")
    assert gamma["models"] == [ALPHA_MODEL] and gamma["usage"]["requests_last_minute"] >= len(answers)


def test_a_tenant_past_its_tokens_per_minute_is_refused_and_another_is_not(stacks: PlatformWithTeams) -> None:
    """Its replica reports each answer's usage (a stream's too, its usage event not shown to a client that did not
    ask); the platform refuses the tenant once the last minute's tokens reach its quota."""
    platform = stacks.platform
    counted, refused = 0, None
    with httpx.Client(timeout=60) as client:
        streamed = _stream(client, platform.url, ALPHA_MODEL, platform.headers("delta"))
        assert streamed.status_code == 200 and all(chunk["choices"] for chunk in chunks(data_lines(streamed)))
        counted += 8  # its completion; its prompt's few tokens are the slack below
        body = {"model": ALPHA_MODEL, "prompt": "hello", "max_tokens": 64}
        for _ in range(MAX_DELTA_REQUESTS):
            answer = client.post(f"{platform.url}/v1/completions", json=body, headers=platform.headers("delta"))
            if answer.status_code != 200:
                refused = answer
                break
            counted += answer.json()["usage"]["total_tokens"]
        alpha = _stream(client, platform.url, ALPHA_MODEL, platform.headers("alpha"))
    assert refused is not None and refused.status_code == 429, f"no refusal after {counted} tokens"
    assert refused.headers[SERVE_REASON_HEADER] == REASON_QUOTA_EXCEEDED and refused.headers[RETRY_AFTER_HEADER]
    # Refused once the quota is used up: a report lands just after its answer, so a request or two may pass first.
    print(f"delta refused after {counted} tokens (quota {DELTA_TOKENS_PER_MINUTE})")
    assert DELTA_TOKENS_PER_MINUTE - 16 <= counted <= DELTA_TOKENS_PER_MINUTE + 3 * 80
    assert alpha.status_code == 200
    status = platform_handle_status(platform.spec.stack)
    assert status is not None
    delta = next(tenant for tenant in status["tenants"] if tenant["team"] == "delta")
    assert delta["usage"]["tokens_last_minute"] >= DELTA_TOKENS_PER_MINUTE


def test_a_team_going_down_and_coming_back_cuts_nothing_of_another_teams_streams(stacks: PlatformWithTeams) -> None:
    platform, beta = stacks.platform, stacks.beta
    groups = [Clients("alpha", platform.keys["alpha"], ALPHA_MODEL, 8)]

    async def meanwhile() -> TenantLoad:
        streaming = asyncio.create_task(tenant_load(platform.url, groups, DOWN_AND_UP_S))
        await asyncio.to_thread(delete_plan, beta.plan)
        with httpx.Client(timeout=30) as client:
            gone = await asyncio.to_thread(_stream, client, platform.url, BETA_MODEL, platform.headers("beta"))
        assert gone.status_code == 404 and gone.headers[SERVE_REASON_HEADER] == REASON_MODEL_NOT_FOUND
        await asyncio.to_thread(beta.redeploy, lambda data: None, Path(beta.path).parent)
        await asyncio.to_thread(wait_attached, beta.spec)
        return await streaming

    load = asyncio.run(meanwhile())
    assert load.completed("alpha") > 0 and not load.refusals() and not load.cut(), load.refusals() or load.cut()
    status = platform_handle_status(platform.spec.stack)
    assert status is not None and BETA_MODEL in {model["model"] for model in status["models"]}
