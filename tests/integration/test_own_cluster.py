"""sluice on a Ray cluster the user started: `ray start` as its own process (the README's command, on its own port
and temp folder), then the CLI the way a user runs it: a cluster whose Serve lacks sluice's settings is refused in
seconds with the fix; `deploy` returns and the stack serves after the CLI exited; `status` lists the stacks and shows
the running one's replicas, routers and server map; `check` on the embedded default is incomplete, naming what runs
each skipped item, and passes once the user allows the skips; Ray Serve's own gRPC ports on every interface refuse a
call without Ray's token; a SIGKILLed HAProxy is replaced without touching an LLM
replica, and HAProxy dies with its frontend replica and comes back with the next; `down STACK` removes every app and
HAProxy; a stack that cannot start ends `deploy` with exit 1 at its deadline, naming the stuck deployment, and one
Serve gave up on ends it with the replica's error, each removed by `down SPEC`. The cluster is stopped at the end, by
its PIDs."""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import jsonschema
import psutil
import pytest
import yaml

from base.contracts import REPLICA_HEADER
from base.route_wire import ComponentVersions
from base.waiting import WaitTimeout, wait_until
from infra.haproxy.process import pid_alive
from sluice.deploy.check.checklist import (
    CHECK_EXIT_INCOMPLETE,
    CHECK_EXIT_PASS,
    ENABLED_BY,
    FAULT_INJECTION,
    LEGACY_SAME_TEXTS,
    TIMEOUT_CLEANUP,
    VERSIONS,
)
from sluice.deploy.json_reports import check_schema, status_schema
from sluice.deploy.preflight import PREFLIGHT_EXIT_CODE
from tests.support.ports import free_port
from tests.support.sse import chunks, data_lines
from tests.support.user_ray import embedded_default_spec, sluice_cli, user_env, user_started_ray

pytestmark = [pytest.mark.integration, pytest.mark.own_ray]

STACK = "platform-own-cluster"
BODY = {"model": "sluice-tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
STREAM = {"model": "sluice-tiny", "prompt": "ka lo", "max_tokens": 8, "ignore_eos": True, "stream": True}
REFUSED_WITHIN_S = 30
# The stuck stack's deploy deadline: long enough for its router to say what it waits for, short of Serve giving up.
STUCK_DEADLINE_S = 10


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    with user_started_ray() as ray:
        yield ray.address


def _serve_driver(cluster: str, call: str) -> None:
    """Run `serve.<call>` from a plain driver of the user's (no sluice settings)."""
    code = f"import ray; ray.init(address='{cluster}'); from ray import serve; serve.{call}"
    env = {**user_env(), "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "token"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_a_serve_without_sluices_settings_is_refused_in_seconds(cluster: str, tmp_path: Path) -> None:
    _serve_driver(cluster, f"start(http_options={{'host': '127.0.0.1', 'port': {free_port()}}})")
    spec, _ = embedded_default_spec(tmp_path, "refused")
    began = time.monotonic()
    refused = sluice_cli("deploy", str(spec), "--address", cluster)
    took = time.monotonic() - began
    print(f"refused in {took:.1f} s")
    # A refusal takes a CLI's start and one question to the controller (3-4 s alone); a deploy that went ahead would
    # wait minutes. The bound is 10x the refusal's time: this module shares the cores with the session cluster's.
    assert refused.returncode == PREFLIGHT_EXIT_CODE and took < REFUSED_WITHIN_S, refused.stderr
    assert "RAY_SERVE_ENABLE_DIRECT_INGRESS" in refused.stderr and "serve shutdown -y" in refused.stderr
    assert sluice_cli("status", "--address", cluster).returncode == PREFLIGHT_EXIT_CODE
    _serve_driver(cluster, "shutdown()")
    assert "no sluice stack" in sluice_cli("status", "--address", cluster).stdout, "the refused deploy left a stack"


@dataclass
class Deployed:
    spec: Path
    url: str
    apps: list[str]


@pytest.fixture(scope="module")
def deployed(cluster: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployed]:
    spec, port = embedded_default_spec(tmp_path_factory.mktemp("own"), "own-cluster")
    result = sluice_cli("deploy", str(spec), "--address", cluster, timeout_s=700)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "INFO" not in result.stdout + result.stderr, "Ray's own lines leaked into deploy's output"
    assert f"http://127.0.0.1:{port}" in result.stdout
    yield Deployed(spec, f"http://127.0.0.1:{port}", [f"{STACK}-{app}" for app in ("llm", "router", "frontend")])
    sluice_cli("down", STACK, "--address", cluster)


def _status(cluster: str) -> dict:
    """`sluice status STACK --json`, checked against its published schema."""
    report = json.loads(sluice_cli("status", STACK, "--address", cluster, "--json").stdout)
    jsonschema.validate(report, status_schema())
    return report


def _replica_ids(report: dict) -> set[str]:
    return {replica["id"] for replica in report["apps"][f"{STACK}-llm"]["replicas"]}


def _stream(client: httpx.Client, url: str) -> str:
    with client.stream("POST", f"{url}/v1/completions", json=STREAM) as response:
        assert response.status_code == 200, response.read()
        assert chunks(data_lines(response))[-1]["choices"][0]["finish_reason"] == "length"
        return response.headers[REPLICA_HEADER]


def _serving_again(url: str, since: float, within_s: float) -> float:
    with httpx.Client(timeout=10) as client:
        while True:
            try:
                _stream(client, url)
                return time.monotonic() - since
            except (httpx.TransportError, AssertionError):
                assert time.monotonic() - since < within_s, f"not serving again within {within_s} s"
                time.sleep(0.2)


def test_the_deployed_stack_serves_after_the_cli_exited(cluster: str, deployed: Deployed) -> None:
    replicas = _replica_ids(_status(cluster))
    with httpx.Client(timeout=60) as client:
        served = [_stream(client, deployed.url) for _ in range(50)]
        chat = client.post(f"{deployed.url}/v1/chat/completions", json=BODY)
    assert set(served) == replicas and len(replicas) == 2
    assert chat.status_code == 200 and chat.headers[REPLICA_HEADER] in replicas


def test_a_second_stack_on_the_running_frontends_port_is_refused_in_seconds_naming_both(
    cluster: str, deployed: Deployed, tmp_path: Path
) -> None:
    port = int(deployed.url.rsplit(":", 1)[1])
    path, _ = embedded_default_spec(tmp_path, "clash")
    clash = yaml.safe_load(path.read_text())
    clash["frontend"]["port"] = port
    path.write_text(yaml.safe_dump(clash))
    replicas = _replica_ids(_status(cluster))
    began = time.monotonic()
    refused = sluice_cli("deploy", str(path), "--address", cluster)
    took = time.monotonic() - began
    print(f"refused in {took:.1f} s")
    assert refused.returncode == PREFLIGHT_EXIT_CODE and took < REFUSED_WITHIN_S, refused.stdout + refused.stderr
    assert f"port {port} (frontend.port) is held by stack {STACK!r}" in refused.stderr, refused.stderr
    # Nothing of the running stack touched: the same replicas serve on its port, and no record of the refused one.
    with httpx.Client(timeout=60) as client:
        assert {_stream(client, deployed.url) for _ in range(8)} <= replicas
    assert _replica_ids(_status(cluster)) == replicas


def test_status_lists_the_stacks_and_reads_the_running_one(cluster: str, deployed: Deployed) -> None:
    listed = sluice_cli("status", "--address", cluster, "--json")
    assert [stack["stack"] for stack in json.loads(listed.stdout)["stacks"]] == [STACK]
    jsonschema.validate(json.loads(listed.stdout), status_schema())
    by_name = sluice_cli("status", STACK, "--address", cluster, "--json")
    report = json.loads(by_name.stdout)
    jsonschema.validate(report, status_schema())
    assert by_name.returncode == 0 and report["state"] == "ready", report["state"]
    assert report["models"]["sluice-tiny"]["routers"]["policy"] == "round_robin"
    assert report["ingress"]["direct_weight"] == 100 and report["differences"] == []
    llm, router, frontend = (report["apps"][app] for app in deployed.apps)
    assert len(llm["replicas"]) == 2 and len(router["replicas"]) == 1 and frontend["status"].endswith("RUNNING")
    servers = report["frontend"]["servers"]
    replicas = {s["server"] for s in servers if s["backend"] == "sluice_replicas" and s["status"] == "UP"}
    assert replicas == _replica_ids(report)
    assert len([s for s in servers if s["backend"] == "sluice_routers" and s["status"] == "UP"]) == 1


def test_check_on_the_embedded_default_is_incomplete_naming_what_runs_the_skipped_items(
    cluster: str, deployed: Deployed
) -> None:
    expect = ["--expect-ray", ComponentVersions.installed().ray]
    result = sluice_cli("check", str(deployed.spec), "--address", cluster, "--json", *expect)
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
    result = sluice_cli("check", str(deployed.spec), "--address", cluster, "--json", *allow)
    verdict = json.loads(result.stdout)
    assert result.returncode == CHECK_EXIT_PASS and verdict["verdict"] == "pass", verdict
    assert len(verdict["skipped"]) == 3 and all(s["allowed"] for s in verdict["skipped"])


def _serve_wildcard_ports() -> dict[int, tuple[int, str]]:
    """Each TCP port a Serve replica of this stack or a Serve proxy listens on at a wildcard address: {port: (pid,
    process title)}. Ray Serve binds these itself (a replica's inter-deployment gRPC server: `[::]:0`)."""
    found = {}
    for process in psutil.process_iter(["cmdline"]):
        title = " ".join(process.info["cmdline"] or []).strip()
        if not title.startswith((f"ray::ServeReplica:{STACK}-", "ray::ProxyActor")):
            continue
        with contextlib.suppress(psutil.Error):
            for listening in process.net_connections("tcp"):
                if listening.status == psutil.CONN_LISTEN and ipaddress.ip_address(listening.laddr.ip).is_unspecified:
                    found[listening.laddr.port] = (process.pid, title)
    return found


def _grpc_answer(port: int, metadata: tuple[tuple[str, str], ...]) -> grpc.StatusCode:
    """The status of Serve's inter-deployment call (`ASGIService/HandleRequest`, an empty request) at `port`."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            channel.unary_unary("/ray.serve.ASGIService/HandleRequest")(b"", timeout=10, metadata=metadata)
        except grpc.RpcError as error:
            return error.code()
    return grpc.StatusCode.OK


def test_serves_own_grpc_ports_on_every_interface_reach_no_app_without_rays_token(
    cluster: str, deployed: Deployed
) -> None:
    """Nothing reachable past the frontend (review #10) where sluice cannot choose the address: each Serve replica's
    inter-deployment gRPC port listens on every interface, and Ray's token refuses a call without it there. With the
    token the same call reaches the replica's servicer (which cannot read an empty request): the token is the guard."""
    token = os.environ.get("RAY_AUTH_TOKEN") or (Path.home() / ".ray" / "auth_token").read_text().strip()
    ports = _serve_wildcard_ports()
    without = {port: _grpc_answer(port, ()) for port in ports}
    print({port: (ports[port][1], answer.name) for port, answer in without.items()})
    assert set(without.values()) <= {grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.UNIMPLEMENTED}, without
    guarded = [port for port, answer in without.items() if answer == grpc.StatusCode.UNAUTHENTICATED]
    replicas = _replica_ids(_status(cluster))
    # One guarded port for each Serve replica of the stack: 2 LLM replicas, its router and its frontend.
    assert len({ports[port][0] for port in guarded}) == len(replicas) + 2, ports
    with_token = {port: _grpc_answer(port, (("authorization", f"Bearer {token}"),)) for port in guarded}
    assert grpc.StatusCode.UNAUTHENTICATED not in with_token.values(), with_token


def test_a_killed_haproxy_is_replaced_without_touching_a_replica(cluster: str, deployed: Deployed) -> None:
    before = _status(cluster)
    os.kill(before["frontend"]["master_pid"], signal.SIGKILL)
    print(f"serving again {_serving_again(deployed.url, time.monotonic(), 10):.1f} s after HAProxy was killed")
    after = _status(cluster)
    assert after["frontend"]["restarts"] == before["frontend"]["restarts"] + 1
    assert after["frontend"]["master_pid"] != before["frontend"]["master_pid"]
    assert _replica_ids(after) == _replica_ids(before)


def test_haproxy_dies_with_its_replica_and_comes_back_with_the_next(cluster: str, deployed: Deployed) -> None:
    before = _status(cluster)
    os.kill(before["frontend"]["replica_pid"], signal.SIGKILL)
    killed = time.monotonic()
    with contextlib.suppress(WaitTimeout):
        wait_until(5, lambda: not pid_alive(before["frontend"]["master_pid"]), "HAProxy to end", poll_s=0.1)
    assert not pid_alive(before["frontend"]["master_pid"]), "HAProxy outlived its frontend replica"
    print(f"Serve's new frontend replica serving after {_serving_again(deployed.url, killed, 90):.1f} s")
    assert _replica_ids(_status(cluster)) == _replica_ids(before)


def test_down_by_name_removes_every_app_and_haproxy(cluster: str, deployed: Deployed) -> None:
    haproxy = _status(cluster)["frontend"]
    result = sluice_cli("down", STACK, "--address", cluster)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "no sluice stack" in sluice_cli("status", "--address", cluster).stdout
    with contextlib.suppress(WaitTimeout):
        wait_until(10, lambda: not pid_alive(haproxy["master_pid"]), "HAProxy to end", poll_s=0.2)
    assert not pid_alive(haproxy["master_pid"]) and not pid_alive(haproxy["worker_pid"])
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{deployed.url}/v1/models", timeout=2)


def test_a_stack_that_cannot_start_ends_deploy_at_its_deadline(cluster: str, tmp_path: Path) -> None:
    # A folder without weights: each replica fails only in vLLM, after its imports, so Serve takes 6 failed starts to
    # give up: 18 s on an idle machine with warm caches (it once beat a 20 s deadline), 35 s or more under load. The
    # deadline is inside that: the stack is still starting when it passes.
    weightless = tmp_path / "weightless-model"
    weightless.mkdir()
    spec, _ = embedded_default_spec(tmp_path, "stuck", source=str(weightless))
    began = time.monotonic()
    result = sluice_cli("deploy", str(spec), "--address", cluster, "--timeout", str(STUCK_DEADLINE_S), timeout_s=180)
    took = time.monotonic() - began
    removed = sluice_cli("down", str(spec), "--address", cluster)
    assert removed.returncode == 0 and "no sluice stack" in sluice_cli("status", "--address", cluster).stdout
    # The message says the deadline ended it; the bound only catches a deploy that hung on past it.
    assert result.returncode == 1 and took < 120, result.stderr
    assert "deploy timed out" in result.stderr and "platform-stuck-llm/LLMReplica" in result.stderr
    # The router says in its replica log what it waits for, and deploy shows it.
    assert "platform-stuck-router/Router" in result.stderr
    assert "for a running replica of app 'platform-stuck-llm'" in result.stderr, result.stderr


def test_a_deployment_serve_gives_up_on_ends_deploy_with_its_error(cluster: str, tmp_path: Path) -> None:
    # One replica: Serve gives up after its 3 failed starts instead of 6; what deploy says does not depend on the count.
    # A model folder the node lacks fails each start before vLLM is imported.
    spec, _ = embedded_default_spec(tmp_path, "failing", source=str(tmp_path / "no-such-model"), replicas=1)
    result = sluice_cli("deploy", str(spec), "--address", cluster, "--timeout", "400", timeout_s=500)
    removed = sluice_cli("down", str(spec), "--address", cluster)
    assert removed.returncode == 0 and "no sluice stack" in sluice_cli("status", "--address", cluster).stdout
    assert result.returncode == 1 and "deploy failed: Serve gave up" in result.stderr, result.stderr
    # The replica's own error (the model folder it could not find) and the tail of its log, not only Serve's summary.
    assert "platform-failing-llm/LLMReplica" in result.stderr and "no-such-model" in result.stderr
    assert "last lines of its replica log" in result.stderr
