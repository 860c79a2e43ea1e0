"""A 3-node stack in containers (head + 2 workers, one tiny-model replica on each), on a private Docker network.

Needs a Docker engine (`.ci/run` installs and starts one, and says when it cannot); builds the CPU node image from
the locally made base (its size is printed), brings the stack up with `sluice stack up`, and removes exactly what it
created with `sluice stack down`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from base.contracts import REPLICA_HEADER, SERVE_REASON_HEADER
from sluice.deploy.container_stack import RunningStack, stack_down, stack_status, stack_up
from tests.support.sse import DONE, data_lines

docker = pytest.importorskip("docker")

REQUESTS = 50
CONCURRENCY = 5
REQUEST_TIMEOUT_S = 60.0
# After a worker dies: requests sent one after another until the last CAUGHT_UP in a row succeed, bounded.
AFTER_KILL_MAX_REQUESTS = 60
AFTER_KILL_MAX_S = 120.0
CAUGHT_UP = 8
SPEC = {
    "kind": "openai",
    "team": "ci",
    "name": "nodes",
    "routing": {"policy": "round_robin"},
    "models": [{"name": "sluice-tiny", "source": "tiny", "replicas": 2, "resources": {"cpus": 1}}],
}


def _engine() -> Any:
    try:
        client = docker.from_env()
        client.ping()
        return client
    except Exception as error:  # no socket, no daemon, no permission
        pytest.skip(f"no Docker engine here ({error}): the container stack test did not run")


@pytest.fixture(scope="module")
def stack(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[tuple[RunningStack, Path]]:
    from infra.container_images import build_image, image_size_bytes

    _engine()
    started = time.monotonic()
    tag = build_image("cpu")
    _say(request, f"{tag}: {image_size_bytes(tag) / 2**30:.2f} GiB, built in {time.monotonic() - started:.0f} s")
    spec = tmp_path_factory.mktemp("spec") / "ci-nodes.yaml"
    spec.write_text(yaml.safe_dump(SPEC))
    stack_down("ci-nodes", say=lambda _: None)  # what a killed earlier run left
    try:
        yield stack_up(str(spec), nodes=2, image=tag, worker_cpus=1), spec
    finally:
        stack_down("ci-nodes")


def _say(request: pytest.FixtureRequest, line: str) -> None:
    """A line on the terminal even when pytest captures output (the image's size, what the kill cost)."""
    plugins = request.config.pluginmanager
    with plugins.getplugin("capturemanager").global_and_fixture_disabled():
        plugins.getplugin("terminalreporter").write_line(line)


def _chat(url: str, content: str) -> dict[str, Any]:
    body = {"model": "sluice-tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 16}
    with httpx.stream(
        "POST", f"{url}/v1/chat/completions", json={**body, "stream": True}, timeout=REQUEST_TIMEOUT_S
    ) as r:
        payloads = data_lines(r) if r.status_code == 200 else [r.read().decode()]
        return {
            "status": r.status_code,
            "replica": r.headers.get(REPLICA_HEADER),
            "reason": r.headers.get(SERVE_REASON_HEADER),
            "done": payloads[-1:] == [DONE],
        }


def _status(spec: Path) -> dict[str, Any]:
    code, output = stack_status(str(spec), as_json=True)
    assert code == 0, output
    return json.loads(output[output.index("{") :])


def test_both_workers_serve_50_streams_through_the_head(stack: tuple[RunningStack, Path]) -> None:
    running, spec = stack
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        results = list(pool.map(lambda i: _chat(running.url, f"stream {i}"), range(REQUESTS)))
    assert [r["status"] for r in results] == [200] * REQUESTS
    assert all(r["done"] for r in results)
    served = {r["replica"] for r in results}
    report = _status(spec)
    replica_host = {replica["id"]: replica["host"] for replica in report["apps"]["ci-nodes-llm"]["replicas"]}
    worker_addresses = {w.address for w in running.workers}
    assert {replica_host[r] for r in served} == worker_addresses, (served, replica_host)
    haproxy_hosts = {s["addr"].rsplit(":", 1)[0] for s in report["frontend"]["servers"] if s["status"] == "UP"}
    assert worker_addresses <= haproxy_hosts, report["frontend"]["servers"]
    assert running.head.address in haproxy_hosts  # the router, on the head


def test_killing_a_worker_leaves_the_other_serving_with_only_fail_closed_503s(
    stack: tuple[RunningStack, Path], request: pytest.FixtureRequest
) -> None:
    running, spec = stack
    replica_host = {replica["id"]: replica["host"] for replica in _status(spec)["apps"]["ci-nodes-llm"]["replicas"]}
    killed, survivor = running.workers
    docker.from_env().containers.get(killed.container).kill(signal="SIGKILL")
    results: list[dict[str, Any]] = []
    deadline = time.monotonic() + AFTER_KILL_MAX_S
    while len(results) < AFTER_KILL_MAX_REQUESTS and time.monotonic() < deadline:
        results.append(_chat(running.url, f"after the kill {len(results)}"))
        if len(results) >= CAUGHT_UP and all(r["status"] == 200 for r in results[-CAUGHT_UP:]):
            break
    assert {r["status"] for r in results} <= {200, 503}, results
    assert all(r["reason"] for r in results if r["status"] == 503), results
    assert all(r["done"] for r in results if r["status"] == 200), results
    assert all(r["status"] == 200 for r in results[-CAUGHT_UP:]), results
    assert {replica_host.get(r["replica"]) for r in results if r["status"] == 200} == {survivor.address}, results
    _say(
        request,
        f"after SIGKILL of {killed.container}: {len(results)} requests, "
        f"{sum(r['status'] == 503 for r in results)} fail-closed 503s "
        f"({sorted({r['reason'] for r in results if r['reason']})})",
    )
