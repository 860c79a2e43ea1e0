"""`sluice deploy` end to end: the local-cpu team file (own name and ports) deployed by the CLI as a subprocess onto
the session's Ray cluster; the stack keeps serving after the CLI exits, `sluice status` shows it, a SIGKILLed
HAProxy is replaced without touching an LLM replica, and `sluice down` removes it all."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import jsonschema
import pytest
import ray
import yaml
from ray import serve

from base.contracts import REPLICA_HEADER
from base.route_wire import ComponentVersions
from base.waiting import WaitTimeout, wait_until
from infra.haproxy.process import pid_alive
from services.serve_internals import list_replica_endpoints
from sluice.deploy.apply import delete_apps
from sluice.deploy.check import (
    CHECK_EXIT_INCOMPLETE,
    CHECK_EXIT_PASS,
    ENABLED_BY,
    FAULT_INJECTION,
    LEGACY_SAME_TEXTS,
    TIMEOUT_CLEANUP,
    VERSIONS,
)
from sluice.deploy.json_reports import check_schema, status_schema
from tests.support.frontend_contract import register_frontend
from tests.support.ports import free_port
from tests.support.sse import chunks, data_lines

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
SLUICE = [sys.executable, "-m", "sluice.cli.main"]
STREAM = {"model": "sluice-tiny", "prompt": "ka lo", "max_tokens": 8, "ignore_eos": True, "stream": True}


@dataclass
class Deployed:
    spec: Path
    address: str
    url: str
    llm_app: str
    apps: list[str]


def _sluice(*args: str, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*SLUICE, *args], capture_output=True, text=True, timeout=timeout_s, cwd=ROOT)


def _status(stack: Deployed) -> dict:
    """`sluice status --json`, checked against its published schema."""
    result = _sluice("status", str(stack.spec), "--address", stack.address, "--json")
    report = json.loads(result.stdout)
    jsonschema.validate(report, status_schema())
    return report


@pytest.fixture(scope="module")
def stack(ray_cluster: None, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    spec = yaml.safe_load((ROOT / "topologies" / "teams" / "local-cpu.yaml").read_text())
    port = free_port()
    spec["name"] = "deploy-test"
    spec["frontend"].update(port=port, metrics_port=free_port())
    path = tmp_path_factory.mktemp("deploy") / "stack.yaml"
    path.write_text(yaml.safe_dump(spec))
    register_frontend(port)
    address = ray.get_runtime_context().gcs_address
    deployed = _sluice("deploy", str(path), "--address", address, timeout_s=600)
    assert deployed.returncode == 0, deployed.stdout + deployed.stderr
    assert f"http://127.0.0.1:{port}" in deployed.stdout
    name = "platform-deploy-test"
    apps = [f"{name}-{app}" for app in ("llm", "router", "frontend")]
    yield Deployed(path, address, f"http://127.0.0.1:{port}", apps[0], apps)
    delete_apps(apps)  # whatever a failed test left behind


def _stream(client: httpx.Client, url: str) -> str:
    with client.stream("POST", f"{url}/v1/completions", json=STREAM) as response:
        assert response.status_code == 200, response.read()
        assert chunks(data_lines(response))[-1]["choices"][0]["finish_reason"] == "length"
        return response.headers[REPLICA_HEADER]


def test_the_stack_serves_after_the_cli_exited(stack: Deployed) -> None:
    replicas = {e.replica_id for e in asyncio.run(list_replica_endpoints(stack.llm_app))}
    with httpx.Client(timeout=60) as client:
        served = [_stream(client, stack.url) for _ in range(50)]
    assert set(served) == replicas and len(replicas) == 2


def test_status_shows_replicas_routers_and_the_server_map(stack: Deployed) -> None:
    report = _status(stack)
    assert report["state"] == "ready"
    llm, router, frontend = (report["apps"][app] for app in stack.apps)
    assert len(llm["replicas"]) == 2 and len(router["replicas"]) == 1 and frontend["status"].endswith("RUNNING")
    servers = report["frontend"]["servers"]
    replica_ids = {replica["id"] for replica in llm["replicas"]}
    assert {s["server"] for s in servers if s["backend"] == "sluice_replicas" and s["status"] == "UP"} == replica_ids
    assert len([s for s in servers if s["backend"] == "sluice_routers" and s["status"] == "UP"]) == 1


def test_sluice_check_on_the_embedded_default_is_incomplete_naming_what_runs_the_skipped_items(stack: Deployed) -> None:
    expect = ["--expect-ray", ComponentVersions.installed().ray]
    result = _sluice("check", str(stack.spec), "--address", stack.address, "--json", *expect, timeout_s=300)
    verdict = json.loads(result.stdout)
    jsonschema.validate(verdict, check_schema())
    assert result.returncode == CHECK_EXIT_INCOMPLETE and verdict["verdict"] == "incomplete", verdict
    outcome = {item["item"]: item["ok"] for item in verdict["items"]}
    assert outcome["server map"] and outcome["API contract"] and outcome["disconnect frees the engine"]
    # Asked on each replica's own port, against the version the user expects.
    detail = next(item["detail"] for item in verdict["items"] if item["item"] == VERSIONS)
    assert outcome[VERSIONS] and "2 replicas (ray, vllm)" in detail and "as expected (ray)" in detail
    # Not a staging stack, no legacy path retained: those items are skipped, not passed, each naming its setting.
    skipped = {s["item"]: s["enable_with"] for s in verdict["skipped"]}
    assert skipped == {
        FAULT_INJECTION: ENABLED_BY[FAULT_INJECTION],
        TIMEOUT_CLEANUP: ENABLED_BY[TIMEOUT_CLEANUP],
        f"{LEGACY_SAME_TEXTS} (sluice-tiny)": ENABLED_BY[LEGACY_SAME_TEXTS],
    }
    assert not verdict["failed"] and not any(s["allowed"] for s in verdict["skipped"])
    # The user accepts the skips: the verdict passes, the skips still reported.
    allow = [flag for item in (FAULT_INJECTION, TIMEOUT_CLEANUP, LEGACY_SAME_TEXTS) for flag in ("--allow-skip", item)]
    result = _sluice("check", str(stack.spec), "--address", stack.address, "--json", *allow, timeout_s=300)
    verdict = json.loads(result.stdout)
    assert result.returncode == CHECK_EXIT_PASS and verdict["verdict"] == "pass", verdict
    assert len(verdict["skipped"]) == 3 and all(s["allowed"] for s in verdict["skipped"])


def test_a_killed_haproxy_is_replaced_without_touching_a_replica(stack: Deployed) -> None:
    before = _status(stack)
    replicas = before["apps"][stack.llm_app]["replicas"]
    os.kill(before["frontend"]["master_pid"], signal.SIGKILL)
    print(f"serving again {_serving_again(stack.url, time.monotonic(), 10):.1f} s after HAProxy was killed")
    after = _status(stack)
    assert after["frontend"]["restarts"] == before["frontend"]["restarts"] + 1
    assert after["frontend"]["master_pid"] != before["frontend"]["master_pid"]
    assert after["apps"][stack.llm_app]["replicas"] == replicas


def _serving_again(url: str, since: float, within_s: float) -> float:
    with httpx.Client(timeout=10) as client:
        while True:
            try:
                _stream(client, url)
                return time.monotonic() - since
            except (httpx.TransportError, AssertionError):
                assert time.monotonic() - since < within_s, f"not serving again within {within_s} s"
                time.sleep(0.2)


def test_haproxy_dies_with_its_replica_and_comes_back_with_the_next(stack: Deployed) -> None:
    before = _status(stack)
    os.kill(before["frontend"]["replica_pid"], signal.SIGKILL)
    killed = time.monotonic()
    with contextlib.suppress(WaitTimeout):
        wait_until(5, lambda: not pid_alive(before["frontend"]["master_pid"]), "HAProxy to end", poll_s=0.1)
    assert not pid_alive(before["frontend"]["master_pid"]), "HAProxy outlived its frontend replica"
    print(f"Serve's new frontend replica serving after {_serving_again(stack.url, killed, 90):.1f} s")
    assert _status(stack)["apps"][stack.llm_app]["replicas"] == before["apps"][stack.llm_app]["replicas"]


def test_down_removes_every_app_and_haproxy(stack: Deployed) -> None:
    haproxy = _status(stack)["frontend"]
    result = _sluice("down", str(stack.spec), "--address", stack.address)
    assert result.returncode == 0, result.stdout + result.stderr
    assert not set(stack.apps) & set(serve.status().applications)
    with contextlib.suppress(WaitTimeout):
        wait_until(10, lambda: not pid_alive(haproxy["master_pid"]), "HAProxy to end", poll_s=0.2)
    assert not pid_alive(haproxy["master_pid"]) and not pid_alive(haproxy["worker_pid"])
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{stack.url}/v1/models", timeout=2)
