"""sluice on a Ray cluster the user started: `ray start` as its own process (the README's command, on its own port
and temp folder), then the CLI the way a user runs it: a cluster whose Serve lacks sluice's settings is refused in
seconds with the fix; `deploy` returns and the stack serves after the CLI exited; `status` lists and reads the
running stack; `check` ends pass or incomplete; `down STACK` removes it; a stack that cannot start ends `deploy`
with exit 1 at its deadline, naming the stuck deployment, and one Serve gave up on ends it with the replica's error.
The cluster is stopped at the end, by its PIDs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import psutil
import pytest
import yaml

from base.contracts import REPLICA_HEADER
from base.runtime import COMPATIBLE_RAY_START
from base.waiting import wait_until
from sluice.deploy.check import CHECK_EXIT_FAIL
from sluice.deploy.json_reports import status_schema
from sluice.deploy.preflight import PREFLIGHT_EXIT_CODE
from tests.support.frontend_contract import register_frontend
from tests.support.ports import free_port

pytestmark = [pytest.mark.integration, pytest.mark.own_ray]

ROOT = Path(__file__).resolve().parents[2]
STACK = "platform-own-cluster"
BODY = {"model": "sluice-tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


def _user_env() -> dict[str, str]:
    """A user's shell: none of sluice's process environment (the test process has it applied)."""
    from base.runtime import process_env

    return {key: value for key, value in os.environ.items() if key not in process_env() and key != "RAY_ADDRESS"}


def _sluice(*args: str, timeout_s: float = 300) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "sluice.cli.main", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, cwd=ROOT, env=_user_env())


def _ours(folder: str) -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter(["cmdline"]):
        if any(folder in part for part in process.info["cmdline"] or []):
            found.append(process)
    return found


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    """`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 ray start --head --node-ip-address 127.0.0.1` in the foreground."""
    port = free_port()
    folder = tempfile.mkdtemp(prefix="sluice-ray-", dir="/tmp")
    env_part, command = COMPATIBLE_RAY_START.split(" ", 1)
    key, value = env_part.split("=")
    argv = [str(Path(sys.executable).parent / "ray"), *command.split()[1:]]
    argv += ["--block", "--port", str(port), "--temp-dir", folder, "--include-dashboard=false"]
    argv += ["--disable-usage-stats"]
    # Token authentication on, as Ray 2.60's `ray start` turns it on wherever a token exists (`~/.ray/auth_token`).
    env = {**_user_env(), key: value, "RAY_AUTH_MODE": "token"}
    ray_start = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    address = f"127.0.0.1:{port}"
    try:

        def up() -> bool:
            assert ray_start.poll() is None, "ray start exited"
            return _sluice("status", "--address", address, timeout_s=60).returncode == 0

        wait_until(60, up, "ray start to come up", poll_s=1)
        yield address
    finally:
        ray_start.send_signal(signal.SIGTERM)
        try:
            ray_start.wait(timeout=60)
        except subprocess.TimeoutExpired:
            ray_start.kill()
        _, alive = psutil.wait_procs(_ours(folder), timeout=20)
        for process in alive:
            process.kill()


def _spec(tmp: Path, name: str, **model: object) -> tuple[Path, int]:
    spec = yaml.safe_load((ROOT / "topologies" / "teams" / "local-cpu.yaml").read_text())
    port = free_port()
    spec["name"] = name
    spec["frontend"].update(port=port, metrics_port=free_port())
    spec["models"][0].update(model)
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    register_frontend(port)
    return path, port


def _serve_driver(cluster: str, call: str) -> None:
    """Run `serve.<call>` from a plain driver of the user's (no sluice settings)."""
    code = f"import ray; ray.init(address='{cluster}'); from ray import serve; serve.{call}"
    env = {**_user_env(), "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "token"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_a_serve_without_sluices_settings_is_refused_in_seconds(cluster: str, tmp_path: Path) -> None:
    _serve_driver(cluster, f"start(http_options={{'host': '127.0.0.1', 'port': {free_port()}}})")
    spec, _ = _spec(tmp_path, "refused")
    began = time.monotonic()
    refused = _sluice("deploy", str(spec), "--address", cluster)
    took = time.monotonic() - began
    print(f"refused in {took:.1f} s")
    assert refused.returncode == PREFLIGHT_EXIT_CODE and took < 10, refused.stderr
    assert "RAY_SERVE_ENABLE_DIRECT_INGRESS" in refused.stderr and "serve shutdown -y" in refused.stderr
    assert _sluice("status", "--address", cluster).returncode == PREFLIGHT_EXIT_CODE
    _serve_driver(cluster, "shutdown()")
    assert "no sluice stack" in _sluice("status", "--address", cluster).stdout, "the refused deploy left a stack"


@pytest.fixture(scope="module")
def deployed(cluster: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, str]]:
    spec, port = _spec(tmp_path_factory.mktemp("own"), "own-cluster")
    result = _sluice("deploy", str(spec), "--address", cluster, timeout_s=700)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "INFO" not in result.stdout + result.stderr, "Ray's own lines leaked into deploy's output"
    yield spec, f"http://127.0.0.1:{port}"
    _sluice("down", STACK, "--address", cluster)


def test_the_deployed_stack_serves_after_the_cli_exited(deployed: tuple[Path, str]) -> None:
    _, url = deployed
    with httpx.Client(timeout=60) as client:
        served = {client.post(f"{url}/v1/chat/completions", json=BODY).headers[REPLICA_HEADER] for _ in range(6)}
    assert len(served) == 2


def test_status_lists_the_stacks_and_reads_the_running_one(cluster: str, deployed: tuple[Path, str]) -> None:
    listed = _sluice("status", "--address", cluster, "--json")
    assert [stack["stack"] for stack in json.loads(listed.stdout)["stacks"]] == [STACK]
    jsonschema.validate(json.loads(listed.stdout), status_schema())
    by_name = _sluice("status", STACK, "--address", cluster, "--json")
    report = json.loads(by_name.stdout)
    jsonschema.validate(report, status_schema())
    assert by_name.returncode == 0 and report["state"] == "ready", report["state"]
    assert report["models"]["sluice-tiny"]["routers"]["policy"] == "round_robin"
    assert report["ingress"]["direct_weight"] == 100 and report["differences"] == []


def test_check_passes_or_names_what_it_skipped(cluster: str, deployed: tuple[Path, str]) -> None:
    spec, _ = deployed
    result = _sluice("check", str(spec), "--address", cluster, "--json")
    verdict = json.loads(result.stdout)
    assert result.returncode != CHECK_EXIT_FAIL and verdict["verdict"] in ("pass", "incomplete"), verdict
    assert (result.returncode == 0) == (verdict["verdict"] == "pass")


def test_down_by_name_removes_the_stack(cluster: str, deployed: tuple[Path, str]) -> None:
    _, url = deployed
    assert _sluice("down", STACK, "--address", cluster).returncode == 0
    assert "no sluice stack" in _sluice("status", "--address", cluster).stdout
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/v1/models", timeout=2)


def test_a_stack_that_cannot_start_ends_deploy_at_its_deadline(cluster: str, tmp_path: Path) -> None:
    # A deadline well inside the time Serve takes to give up on a replica that fails (6 failed starts, about 35 s or
    # more): the stack is still starting when it passes.
    spec, _ = _spec(tmp_path, "stuck", source=str(tmp_path / "no-such-model"))
    began = time.monotonic()
    result = _sluice("deploy", str(spec), "--address", cluster, "--timeout", "20", timeout_s=120)
    took = time.monotonic() - began
    _sluice("down", "platform-stuck", "--address", cluster)
    assert result.returncode == 1 and took < 60, result.stderr
    assert "deploy timed out" in result.stderr and "platform-stuck-llm/LLMReplica" in result.stderr
    # The router says in its replica log what it waits for, and deploy shows it.
    assert "platform-stuck-router/Router" in result.stderr
    assert "for a running replica of app 'platform-stuck-llm'" in result.stderr, result.stderr


def test_a_deployment_serve_gives_up_on_ends_deploy_with_its_error(cluster: str, tmp_path: Path) -> None:
    # One replica: Serve gives up after its 3 failed starts instead of 6; what deploy says does not depend on the count.
    spec, _ = _spec(tmp_path, "failing", source=str(tmp_path / "no-such-model"), replicas=1)
    result = _sluice("deploy", str(spec), "--address", cluster, "--timeout", "400", timeout_s=500)
    _sluice("down", "platform-failing", "--address", cluster)
    assert result.returncode == 1 and "deploy failed: Serve gave up" in result.stderr, result.stderr
    # The replica's own error (the model folder it could not find) and the tail of its log, not only Serve's summary.
    assert "platform-failing-llm/LLMReplica" in result.stderr and "no-such-model" in result.stderr
    assert "last lines of its replica log" in result.stderr
