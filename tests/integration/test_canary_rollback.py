"""The canary between the direct path and the retained legacy ingress, on a real stack (canary-cpu: the tiny model's
two vLLM replicas, a router, the legacy ingress, HAProxy): `sluice check` passing twice on the live canary and
leaving it as it was (its injected fault counts nowhere), sticky weighted split, connection-draining rollback and its
reverse under streaming load, automatic rollback on a real router fault (counted on the frontend's metrics), one
generation per request id on either path, `sluice check` failing by name when a router is broken or a replica is
out of HAProxy's map, and, last, a redeploy of the frontend's settings under 12 streaming users handing over to a new
frontend with no stream cut, no connection refused and the rollback in force kept, also by the frontend after it."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from ray import serve

from base.contracts import (
    DIRECT_PATH,
    FAULT_PATH,
    LEGACY_PATH,
    REASON_DUPLICATE_REQUEST,
    REASON_INJECTED_FAULT,
    REASON_ROUTER_UNREACHABLE,
    REQUEST_ID_HEADER,
    SERVE_PATH_HEADER,
    SERVE_REASON_HEADER,
    SESSION_HEADER_DEFAULT,
)
from base.waiting import WaitTimeout, wait_until
from infra.haproxy.runtime_api import RuntimeAPI
from services.frontend.ingress_control import GUARD_INTERVAL_S
from services.internal_credential import internal_headers
from services.serve_internals import list_replica_endpoints
from sluice.deploy.check.checklist import (
    CHECK_EXIT_PASS,
    FAULT_INJECTION,
    LEGACY_SAME_TEXTS,
    STARTUP_PATH,
    TIMEOUT_CLEANUP,
    VERSIONS,
    report,
    run_checks,
    verdict,
)
from tests.support.frontend_metrics import frontend_counts
from tests.support.sse import DONE, data_payloads, stream_lines
from tests.support.streaming_users import Stream, streaming_users
from tests.support.team_stack import TeamStack, team_stack
from tests.support.vllm_metrics import engine_requests

pytestmark = pytest.mark.integration

COMPLETION = {"model": "sluice-tiny", "prompt": "ka lo", "max_tokens": 2, "temperature": 0}
STREAM = {"model": "sluice-tiny", "prompt": "ka lo", "max_tokens": 48, "ignore_eos": True, "stream": True}


@pytest.fixture(scope="module")
def stack(ray_cluster: None, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TeamStack]:
    with team_stack("canary-cpu.yaml", "canary-test", tmp_path_factory.mktemp("canary")) as deployed:
        yield deployed


def _frontend(stack: TeamStack):
    return serve.get_app_handle(stack.plan.frontend_app)


def _routers(stack: TeamStack) -> list[str]:
    """Each router replica's fault endpoint, on Serve's port (HAProxy's route calls go to the route agents)."""
    model = stack.plan.models[0]
    return [f"{e.url}/{model.router_app}{FAULT_PATH}" for e in asyncio.run(list_replica_endpoints(model.router_app))]


@contextlib.contextmanager
def _router_fault(stack: TeamStack, seconds: float = 120) -> Iterator[None]:
    urls = _routers(stack)
    assert urls
    for url in urls:
        assert httpx.post(url, json={"seconds": seconds}, headers=internal_headers()).status_code == 204
    try:
        yield
    finally:
        for url in urls:
            httpx.post(url, json={"seconds": 0}, headers=internal_headers())


def _completion(client: httpx.Client, url: str, session: str, request_id: str | None = None) -> httpx.Response:
    headers = {SESSION_HEADER_DEFAULT: session}
    if request_id is not None:
        headers[REQUEST_ID_HEADER] = request_id
    return client.post(f"{url}/v1/completions", json=COMPLETION, headers=headers)


def _rollbacks(stack: TeamStack) -> dict[str, int]:
    return frontend_counts(stack.spec.frontend.metrics_port, "sluice_canary_rollbacks_total")


def test_sluice_check_twice_on_the_live_canary_passes_both_times_and_leaves_it_as_it_was(stack: TeamStack) -> None:
    before = stack.ingress()
    assert before["direct_weight"] == stack.spec.ingress.canary_weight == 30 and before["abort"] is None  # as declared
    runs = []
    for _ in range(2):
        items = run_checks(stack.spec, stack.plan, stack.url)
        runs.append((report(items, as_json=False), verdict(items)))
    time.sleep(3 * GUARD_INTERVAL_S)  # the guard has looked at every request the checks sent
    (first_code, first), (second_code, second) = runs
    assert (first_code, first["verdict"]) == (second_code, second["verdict"]) == (CHECK_EXIT_PASS, "pass"), runs
    for run in (first, second):
        outcome = {i["item"]: i["ok"] for i in run["items"]}
        assert outcome[FAULT_INJECTION] is True  # its 503s reached the guard and counted nowhere
        assert outcome[TIMEOUT_CLEANUP] is True and outcome[STARTUP_PATH] is True and outcome[VERSIONS] is True
        assert outcome[f"{LEGACY_SAME_TEXTS} (sluice-tiny)"] is True and not run["skipped"]
    after = stack.ingress()
    assert after["abort"] is None and after["direct_weight"] == 30, after
    status = _frontend(stack).status.remote().result(timeout_s=30)
    assert status["haproxy_weights"] == {stack.plan.models[0].llm_app: 30}  # HAProxy's own map, read back
    assert set(_rollbacks(stack).values()) == {0}


@contextlib.contextmanager
def _routers_unreachable(stack: TeamStack) -> Iterator[None]:
    """Every router out of HAProxy's pool (maintenance): the frontend fails direct requests closed, a real fault
    (unlike an injected one, which the guard leaves out)."""
    status = _frontend(stack).status.remote().result(timeout_s=30)
    runtime = RuntimeAPI(status["runtime_socket"])
    backend = stack.plan.models[0].router_backend
    routers = [s["server"] for s in status["servers"] if s["backend"] == backend]
    assert routers
    for router in routers:
        runtime.set_server_state(backend, router, "maint")
    try:
        yield
    finally:
        for router in routers:
            runtime.set_server_state(backend, router, "ready")


def test_a_router_fault_rolls_the_canary_back_naming_the_criterion_and_counting_it(stack: TeamStack) -> None:
    stack.shift(50)
    paths = []
    with _routers_unreachable(stack), httpx.Client(timeout=60) as client:
        for i in range(60):
            response = _completion(client, stack.url, f"fault-{i}")
            paths.append((response.headers.get(SERVE_PATH_HEADER), response.status_code))
            if response.status_code == 503:
                assert response.headers[SERVE_REASON_HEADER] == REASON_ROUTER_UNREACHABLE
        with contextlib.suppress(WaitTimeout):
            wait_until(15, lambda: stack.ingress()["abort"], "the guard to roll back", poll_s=0.2)
    assert (LEGACY_PATH, 200) in paths and any(status == 503 for _, status in paths)
    ingress = stack.ingress()
    abort = ingress["abort"]
    assert abort is not None, ingress
    print(
        f"auto rollback: {abort['breach']['criterion']} {abort['breach']['value']:.3f} > {abort['breach']['threshold']}"
    )
    assert abort["breach"]["criterion"] == "ratio_503"
    assert abort["breach"]["value"] > abort["breach"]["threshold"] == stack.spec.ingress.abort.max_503_ratio
    assert abort["weight_before"] == 50
    assert ingress["direct_weight"] == 0
    assert _rollbacks(stack) == {"ratio_503": 1, "ttft_p99_s": 0, "stream_error_ratio": 0, "replica_imbalance": 0}
    with httpx.Client(timeout=60) as client:  # rolled back: every session is served by the legacy path
        answers = [_completion(client, stack.url, f"after-{i}") for i in range(10)]
    assert {(r.headers[SERVE_PATH_HEADER], r.status_code) for r in answers} == {(LEGACY_PATH, 200)}


async def _session(client: httpx.AsyncClient, url: str, session: str, requests: int) -> list[str]:
    paths = []
    for _ in range(requests):
        response = await client.post(
            f"{url}/v1/completions", json=COMPLETION, headers={SESSION_HEADER_DEFAULT: session}
        )
        assert response.status_code == 200, response.text
        paths.append(response.headers[SERVE_PATH_HEADER])
    return paths


async def _sessions(url: str, sessions: list[str], requests: int) -> dict[str, list[str]]:
    limits = httpx.Limits(max_connections=16)
    semaphore = asyncio.Semaphore(16)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:

        async def one(session: str) -> list[str]:
            async with semaphore:
                return await _session(client, url, session, requests)

        results = await asyncio.gather(*(one(s) for s in sessions))
    return dict(zip(sessions, results, strict=True))


def test_a_canary_at_weight_30_sends_30_percent_of_600_sessions_direct_each_on_one_path(stack: TeamStack) -> None:
    stack.shift(30)
    status = _frontend(stack).status.remote().result(timeout_s=30)
    assert status["haproxy_weights"] == {stack.plan.models[0].llm_app: 30}  # HAProxy's own map, read back
    # Seeded: the split hashes each session, so the same 600 names land the same way on every run (unseeded, a run
    # fell outside the bounds about once in 130: 600 draws at 0.3 have a standard deviation of 0.019).
    names = random.Random(600)
    sessions = [f"user-{names.getrandbits(64):016x}" for _ in range(600)]
    seen = asyncio.run(_sessions(stack.url, sessions, requests=2))
    assert all(len(set(paths)) == 1 for paths in seen.values()), "a session saw both paths"
    direct = sum(paths[0] == DIRECT_PATH for paths in seen.values()) / len(seen)
    print(f"canary at weight 30: {direct:.1%} of {len(seen)} sessions on the direct path")
    assert 0.25 <= direct <= 0.35, direct
    # Moving the weight moves only the sessions between the two weights: every direct session stays direct.
    stack.shift(60)
    was_direct = [s for s, paths in seen.items() if paths[0] == DIRECT_PATH][:50]
    again = asyncio.run(_sessions(stack.url, was_direct, requests=1))
    assert all(paths == [DIRECT_PATH] for paths in again.values())


def _move_under_load(stack: TeamStack, weight: int) -> tuple[list[Stream], float, float, dict]:
    """16 streaming users; the weight moves 3 s in. (streams, when the move began, when it returned, drain)."""
    moments: dict[str, float] = {}

    async def run() -> list[Stream]:
        users = asyncio.create_task(streaming_users(f"{stack.url}/v1/completions", STREAM, 16, run_s=9))
        await asyncio.sleep(3)
        moments["began"] = time.monotonic()
        await asyncio.to_thread(stack.shift, weight)
        moments["returned"] = time.monotonic()
        return await users

    streams = asyncio.run(run())
    with contextlib.suppress(WaitTimeout):
        wait_until(60, lambda: (stack.ingress()["drain"] or {}).get("done"), "the drain to end", poll_s=0.1)
    return streams, moments["began"], moments["returned"], stack.ingress()["drain"]


@pytest.mark.parametrize(
    ("start", "to", "old_path", "new_path"),
    [(100, 0, DIRECT_PATH, LEGACY_PATH), (0, 100, LEGACY_PATH, DIRECT_PATH)],
    ids=["rollback", "reverse"],
)
def test_a_move_under_16_streaming_users_cuts_nothing(stack: TeamStack, start, to, old_path, new_path) -> None:
    stack.shift(start, wait=True)
    streams, began, returned, drain = _move_under_load(stack, to)
    print(f"{old_path} -> {new_path} under 16 users: {len(streams)} streams, drained in {drain['waited_s']} s")
    assert streams and all(s.status == 200 for s in streams), {s.status for s in streams}
    assert all(s.done for s in streams), f"{sum(not s.done for s in streams)} streams were cut"
    assert all(s.path == new_path for s in streams if s.started > returned)
    before = [s for s in streams if s.started < began]
    assert before and all(s.path == old_path for s in before)
    assert drain["path"] == old_path and drain["done"] and not drain["still_running"]


def _generation(stack: TeamStack, weight: int, request_id: str) -> tuple[float, httpx.Response, httpx.Response]:
    """While a stream with `request_id` runs, a retry with the same id; (engine requests added, retry, retry after)."""
    stack.shift(weight, wait=True)
    model = stack.plan.models[0]
    before = engine_requests(model.llm_app, f"/{model.llm_app}")
    long_stream = {**STREAM, "max_tokens": 256}
    headers = {REQUEST_ID_HEADER: request_id}
    with httpx.Client(timeout=120) as client:
        with client.stream("POST", f"{stack.url}/v1/completions", json=long_stream, headers=headers) as first:
            assert first.status_code == 200
            lines = stream_lines(first)
            next(line for line in lines if line.startswith("data: "))
            retry = client.post(f"{stack.url}/v1/completions", json=COMPLETION, headers=headers)
            assert data_payloads("\n".join(lines))[-1] == DONE
        time.sleep(1)
        after = engine_requests(model.llm_app, f"/{model.llm_app}")
        again = client.post(f"{stack.url}/v1/completions", json=COMPLETION, headers=headers)
    return after - before, retry, again


@pytest.mark.parametrize(("weight", "path"), [(100, DIRECT_PATH), (0, LEGACY_PATH)])
def test_a_retry_with_a_running_request_id_starts_no_second_generation(stack: TeamStack, weight, path) -> None:
    request_id = f"retry-{path}-{random.getrandbits(32):08x}"
    generated, retry, again = _generation(stack, weight, request_id)
    assert generated == 1
    assert retry.status_code == 409
    assert retry.headers[SERVE_REASON_HEADER] == REASON_DUPLICATE_REQUEST
    assert request_id in retry.json()["error"]["message"]
    assert again.status_code == 200 and again.headers[SERVE_PATH_HEADER] == path  # the first one has ended


def _verdict(stack: TeamStack) -> tuple[int, dict]:
    """`sluice check --json`'s exit code and document (printed to stdout by the CLI; here Ray's forwarded worker logs
    share this process's stdout, so the document is taken as built)."""
    items = run_checks(stack.spec, stack.plan, stack.url)
    return report(items, as_json=False), verdict(items)


def test_sluice_check_fails_naming_the_item_when_a_router_is_broken(stack: TeamStack) -> None:
    stack.shift(100, wait=True)
    with _router_fault(stack):
        code, verdict = _verdict(stack)
    assert code == 1 and verdict["verdict"] == "fail"
    assert "direct streaming (sluice-tiny)" in verdict["failed"]
    item = next(i for i in verdict["items"] if i["item"] == "direct streaming (sluice-tiny)")
    assert REASON_INJECTED_FAULT in item["detail"]


def test_sluice_check_fails_naming_the_item_when_a_replica_is_missing_from_haproxys_map(stack: TeamStack) -> None:
    status = _frontend(stack).status.remote().result(timeout_s=30)
    runtime = RuntimeAPI(status["runtime_socket"])
    model = stack.plan.models[0]
    replica = next(s["server"] for s in status["servers"] if s["backend"] == model.replica_backend)
    runtime.set_server_state(model.replica_backend, replica, "maint")
    try:
        code, verdict = _verdict(stack)
    finally:
        runtime.set_server_state(model.replica_backend, replica, "ready")
    assert code == 1 and verdict["failed"] == ["server map"]
    item = next(i for i in verdict["items"] if i["item"] == "server map")
    assert replica in item["detail"]


REDEPLOY_USERS = 12
REDEPLOY_STREAM = {**STREAM, "max_tokens": 200}
# The users stream until the hand-over is over, this long at most.
REDEPLOY_LOAD_S = 120
PROBE_INTERVAL_S = 0.05


@contextlib.contextmanager
def _probes(url: str) -> Iterator[list[str]]:
    """A request on a new connection every `PROBE_INTERVAL_S` until the block ends: what failed, each said."""
    failures: list[str] = []
    stop = threading.Event()

    def probe() -> None:
        while not stop.is_set():
            try:
                response = httpx.get(f"{url}/v1/models", timeout=10)
                if response.status_code != 200:
                    failures.append(f"{response.status_code} {response.headers.get(SERVE_REASON_HEADER)}")
            except httpx.HTTPError as error:
                failures.append(repr(error))
            stop.wait(PROBE_INTERVAL_S)

    prober = threading.Thread(target=probe, daemon=True)
    prober.start()
    try:
        yield failures
    finally:
        stop.set()
        prober.join(timeout=15)


def _listens(pid: int, port: int) -> bool:
    try:
        return any(
            c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in psutil.Process(pid).net_connections()
        )
    except psutil.NoSuchProcess:
        return False


def _frontend_status(stack: TeamStack) -> dict[str, Any]:
    return _frontend(stack).status.remote().result(timeout_s=30)


def test_a_frontend_redeploy_under_12_streaming_users_cuts_nothing_refuses_nothing_and_keeps_the_rollback(
    stack: TeamStack, tmp_path: Path
) -> None:
    """The frontend's settings changed while 12 users stream 200-token completions and a request arrives every 50 ms
    on a new connection: the new frontend runs before the old one stops, whose HAProxy serves what it holds to the
    end. A rollback in force (weight 0 over the declared 30) is kept by the new frontend and by the one after it."""
    stack.shift(0, wait=True)
    before = _frontend_status(stack)
    port = stack.spec.frontend.port
    moments: dict[str, float] = {}

    def longer_urls(data: dict[str, Any]) -> None:
        protection = data["frontend"].setdefault("protection", {})
        protection["max_url_bytes"] = 2 * stack.spec.frontend.protection.max_url_bytes

    def hand_over() -> TeamStack:
        moments["redeploy"] = time.monotonic()
        redeployed = stack.redeploy(longer_urls, tmp_path)
        # The old frontend's HAProxy closed its listeners (soft stop): the new one takes every new connection.
        wait_until(60, lambda: not _listens(before["worker_pid"], port), "the old HAProxy to stop listening", 0.1)
        moments["handed_over"] = time.monotonic()
        return redeployed

    async def run() -> tuple[list[Stream], TeamStack]:
        done = asyncio.Event()
        url = f"{stack.url}/v1/completions"
        users = asyncio.create_task(streaming_users(url, REDEPLOY_STREAM, REDEPLOY_USERS, REDEPLOY_LOAD_S, done))
        await asyncio.sleep(2)
        try:
            redeployed = await asyncio.to_thread(hand_over)
            await asyncio.sleep(2)
        finally:
            done.set()
        return await users, redeployed

    with _probes(stack.url) as failures:
        streams, redeployed = asyncio.run(run())
    took = moments["handed_over"] - moments["redeploy"]
    print(f"{len(streams)} streams across a frontend redeploy, handed over {took:.1f} s after it began")
    assert streams and all(s.status == 200 for s in streams), {s.status for s in streams}
    assert all(s.done for s in streams), f"{sum(not s.done for s in streams)} streams were cut"
    assert any(s.started < moments["redeploy"] for s in streams)
    assert any(s.started > moments["handed_over"] for s in streams)
    assert failures == [], failures
    after = _frontend_status(redeployed)
    assert after["replica_pid"] != before["replica_pid"] and after["direct_weight"] == 0
    # The rollback is kept by the frontend after that one too: Serve replaces a killed frontend replica.
    os.kill(after["replica_pid"], signal.SIGKILL)

    def replaced() -> dict[str, Any] | None:
        with contextlib.suppress(Exception):
            status = _frontend_status(redeployed)
            return status if status["running"] and status["replica_pid"] != after["replica_pid"] else None
        return None

    assert wait_until(90, replaced, "Serve to replace the killed frontend", 0.5)["direct_weight"] == 0
