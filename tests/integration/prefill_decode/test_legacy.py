"""Prefill/decode with the retained legacy ingress (the package's stack: prefill-decode-cpu.yaml with `ingress.mode:
both`, staging on so `sluice check` runs every item) on the session's Ray cluster. The legacy path relays
to the decode replica through the handle path and chooses the prefill replica with the prefill deployment's request
router; `sluice check` passes (its legacy item: the same greedy texts on both paths); a rollback while 8 clients
stream cuts none and returns no non-2xx."""

from __future__ import annotations

import asyncio
import contextlib
import time

import httpx
import pytest

from base.contracts import (
    CHOSEN_REPLICA_HEADER,
    LEGACY_PATH,
    PREFILL_FALLBACK_HEADER,
    PREFILL_URL_HEADER,
    REPLICA_HEADER,
    SERVE_PATH_HEADER,
    SERVED_PREFILL_HEADER,
    SESSION_HEADER_DEFAULT,
)
from base.waiting import WaitTimeout, wait_until
from services.serve_internals import list_replica_endpoints
from sluice.deploy.check.checklist import CHECK_EXIT_PASS, LEGACY_SAME_TEXTS, report, run_checks, verdict
from tests.support.sse import DONE, data_payloads
from tests.support.streaming_users import Stream, streaming_users
from tests.support.team_stack import TeamStack

pytestmark = pytest.mark.integration

PROMPT = "ka lo mi tessa ren do ka lo mi tessa ren do ka lo"


@pytest.fixture(scope="module")
def stack(pd_stack: TeamStack) -> TeamStack:
    return pd_stack


def _chat(stack: TeamStack, stream: bool, max_tokens: int = 16) -> dict:
    return {
        "model": stack.plan.models[0].name,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
    }


def test_the_legacy_path_runs_prefill_on_the_prefill_replica_and_decodes_on_the_decode_replica(
    stack: TeamStack,
) -> None:
    stack.shift(0, wait=True)
    [model] = stack.plan.models
    assert model.prefill_app is not None
    [prefill] = asyncio.run(list_replica_endpoints(model.prefill_app))
    [decode] = asyncio.run(list_replica_endpoints(model.llm_app))
    forged = {PREFILL_URL_HEADER: "http://127.0.0.1:9/nowhere", SESSION_HEADER_DEFAULT: "legacy-pd"}
    with httpx.Client(timeout=120) as client:
        for stream in (False, True):
            response = client.post(f"{stack.url}/v1/chat/completions", json=_chat(stack, stream), headers=forged)
            assert response.status_code == 200, response.text
            assert response.headers[SERVE_PATH_HEADER] == LEGACY_PATH
            assert response.headers[REPLICA_HEADER] == response.headers[CHOSEN_REPLICA_HEADER] == decode.replica_id
            # The prefill replica the relay chose ran the prefill: no local fallback, the client's URL ignored.
            assert PREFILL_FALLBACK_HEADER not in response.headers, response.headers[PREFILL_FALLBACK_HEADER]
            assert response.headers.get(SERVED_PREFILL_HEADER) == prefill.replica_id
            if stream:
                assert data_payloads(response.text)[-1] == DONE


def test_sluice_check_passes_with_the_same_texts_on_the_legacy_path(stack: TeamStack) -> None:
    stack.shift(50, wait=True)
    items = run_checks(stack.spec, stack.plan, stack.url)
    code, found = report(items, as_json=False), verdict(items)
    outcome = {i["item"]: i["ok"] for i in found["items"]}
    assert outcome[f"{LEGACY_SAME_TEXTS} ({stack.plan.models[0].name})"] is True, found
    assert (code, found["verdict"]) == (CHECK_EXIT_PASS, "pass") and not found["skipped"], found


def test_a_rollback_while_8_clients_stream_cuts_none_and_answers_only_2xx(stack: TeamStack) -> None:
    stack.shift(100, wait=True)
    moments: dict[str, float] = {}

    async def run() -> list[Stream]:
        body = _chat(stack, stream=True, max_tokens=48)
        users = asyncio.create_task(streaming_users(f"{stack.url}/v1/chat/completions", body, 8, run_s=12))
        await asyncio.sleep(4)
        moments["began"] = time.monotonic()
        await asyncio.to_thread(stack.shift, 0)
        moments["returned"] = time.monotonic()
        return await users

    streams = asyncio.run(run())
    with contextlib.suppress(WaitTimeout):
        wait_until(60, lambda: (stack.ingress()["drain"] or {}).get("done"), "the drain to end", poll_s=0.1)
    drain = stack.ingress()["drain"]
    print(f"P/D rollback under 8 users: {len(streams)} streams, drained in {drain['waited_s']} s")
    assert streams and all(s.status == 200 for s in streams), sorted({s.status for s in streams})
    assert all(s.done for s in streams), f"{sum(not s.done for s in streams)} streams were cut"
    before = [s for s in streams if s.started < moments["began"]]
    after = [s for s in streams if s.started > moments["returned"]]
    assert before and all(s.path != LEGACY_PATH for s in before)
    assert after and all(s.path == LEGACY_PATH for s in after)
    assert drain["done"] and not drain["still_running"], drain
