"""A replica SIGKILLed mid-stream costs its session nothing but that stream: real HAProxy, real routers
(consistent hash) and the session's real vLLM replicas; Serve replaces the killed replica afterwards, and the
replacement is discovered on its own new port."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import psutil
import pytest

from base.contracts import FALLBACK_RANK_HEADER, REPLICA_HEADER, ROUTE_PATH, SESSION_HEADER_DEFAULT
from base.waiting import wait_until
from services.internal_credential import internal_headers
from services.serve_internals import list_replica_endpoints, wait_for_endpoints
from sluice.bench.stack_harness import DirectStreamStack
from tests.support.llm_cluster import LLMCluster, direct_stack
from tests.support.sse import stream_lines

pytestmark = pytest.mark.integration

SESSION = {SESSION_HEADER_DEFAULT: "failover-session"}
LONG_STREAM = {"model": "sluice-tiny", "prompt": "ka lo", "max_tokens": 1000, "ignore_eos": True, "stream": True}
COMPLETION = {"model": "sluice-tiny", "prompt": "ka lo", "max_tokens": 2}
FOLLOW_UP_S = 10.0
INTERVAL_S = 0.1


@pytest.fixture(scope="module")
def stack(llm_cluster: LLMCluster):
    with direct_stack(llm_cluster, routers=2, policy="consistent_hash", check_inter_s=1.0) as started:
        yield started


def _router_primary(client: httpx.Client, stack: DirectStreamStack) -> str:
    """What a router ranks first for the session now (asked directly: what every frontend can serve)."""
    router = asyncio.run(list_replica_endpoints(stack.spec.router_app))[0]
    route_url = f"{router.url}{stack.spec.router_route_prefix}{ROUTE_PATH}"
    reply = client.post(route_url, headers={**SESSION, **internal_headers()})
    assert reply.status_code == 200, reply.text
    return reply.json()["replica_id"]


def _listening(port: int) -> bool:
    return any(c.laddr.port == port and c.status == psutil.CONN_LISTEN for c in psutil.net_connections("tcp"))


def _listening_pid(port: int) -> int:
    (pid,) = {c.pid for c in psutil.net_connections("tcp") if c.laddr.port == port and c.status == psutil.CONN_LISTEN}
    return pid


def test_a_killed_replica_costs_the_session_nothing(
    stack: DirectStreamStack, llm_cluster: LLMCluster, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"{stack.url}/v1/completions"
    with httpx.Client(timeout=30) as client:
        primary = _router_primary(client, stack)
        replica = next(e for e in llm_cluster.endpoints if e.replica_id == primary)
        survivor = next(e.replica_id for e in llm_cluster.endpoints if e.replica_id != primary)
        pid = _listening_pid(replica.port)

        with client.stream("POST", url, json=LONG_STREAM, headers=SESSION) as response:
            assert response.status_code == 200 and response.headers[REPLICA_HEADER] == primary
            lines = stream_lines(response)
            for _ in range(5):
                next(lines)
            os.kill(pid, signal.SIGKILL)
            killed_at = time.monotonic()
            try:
                for _ in lines:
                    assert time.monotonic() - killed_at < 2.0, "the killed replica's stream still runs"
            except httpx.HTTPError:
                pass  # cut: an error is a fine way for it to end
        stream_ended_s = time.monotonic() - killed_at
        assert stream_ended_s < 2.0, "the killed replica's stream did not end within 2 s"
        # The follow-ups start once the dead replica's port is closed: a request the kernel still accepted for the
        # dying process is lost with it (502 by design: the frontend never resends what a replica may have acted on).
        wait_until(5, lambda: not _listening(replica.port), "the killed replica's port to close", poll_s=0.01)

        # The session's next requests, every 100 ms for 10 s: every one served, never by the killed replica.
        results: list[tuple[int, str | None, str | None, str, float]] = []
        router_stopped_at: float | None = None
        while (elapsed := time.monotonic() - killed_at) < FOLLOW_UP_S:
            response = client.post(url, json=COMPLETION, headers=SESSION)
            choice = _router_primary(client, stack)
            if router_stopped_at is None and choice != primary:
                router_stopped_at = elapsed
            results.append(
                (
                    response.status_code,
                    response.headers.get(REPLICA_HEADER),
                    response.headers.get(FALLBACK_RANK_HEADER),
                    choice,
                    elapsed,
                )
            )
            time.sleep(max(0.0, INTERVAL_S - (time.monotonic() - killed_at - elapsed)))
    assert len(results) >= FOLLOW_UP_S / INTERVAL_S / 2
    assert [r for r in results if r[0] != 200] == []
    assert primary not in {served for _, served, _, _, _ in results}
    # The router stops ranking the dead replica first within a second of the kill.
    assert router_stopped_at is not None and router_stopped_at < 1.0, router_stopped_at
    # First the ring's next replica (the survivor); after Serve's replacement joins, wherever the new ring puts the
    # session: each request was served by what the router ranked first around it, or by its ranked fallback.
    for i, (_, served, rank, choice, _) in enumerate(results):
        previous = results[i - 1][3] if i else primary
        if rank is None:
            assert served in (choice, previous), results[i]
        else:  # passed over the dead primary the router still named: the ring's next replica
            assert primary in (choice, previous) and served == survivor, results[i]
    # Serve replaces the killed replica; the session cluster is whole again for the modules after this one.
    wait_until(
        180,
        lambda: primary not in {e.replica_id for e in wait_for_endpoints(llm_cluster.app, 2, timeout_s=180)},
        "Serve to replace the killed replica",
        poll_s=0.5,
    )
    llm_cluster.endpoints[:] = wait_for_endpoints(llm_cluster.app, 2, timeout_s=180)
    # The replacement is discovered where it listens now and answers there as itself.
    [new] = [e for e in llm_cluster.endpoints if e.replica_id not in (primary, survivor)]
    answered = httpx.get(f"{new.url}/v1/models", timeout=30, headers=internal_headers())
    assert answered.status_code == 200 and answered.headers[REPLICA_HEADER] == new.replica_id
    stack.wait_until_serving(replicas=2, routers=2, timeout_s=120)
    with capsys.disabled():
        fallbacks = sum(1 for r in results if r[2] is not None)
        print(
            f"\nSIGKILL mid-stream: stream ended after {stream_ended_s:.3f} s; router stopped ranking the dead replica"
            f" first after {router_stopped_at:.3f} s; {len(results)} follow-ups over {FOLLOW_UP_S:.0f} s all 200,"
            f" {fallbacks} served by a ranked fallback; replaced after {time.monotonic() - killed_at:.1f} s"
        )
