"""A Ray the user started, for the modules that test sluice on one (`own_ray`): `ray start --head` as its own
process (the README's command, with its own port and temp folder), the CLI run as a user's shell runs it, and a
team file of the embedded default on ports of its own. The cluster is stopped at the end, by its PIDs."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psutil
import yaml

from base.runtime import COMPATIBLE_RAY_START
from base.waiting import wait_until
from tests.support.frontend_contract import register_frontend
from tests.support.ports import free_port

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class UserRay:
    address: str
    # Ray's temp folder: every process of this cluster names it on its command line.
    folder: str


def user_env() -> dict[str, str]:
    """A user's shell: none of sluice's process environment (the test process has it applied)."""
    from base.runtime import process_env

    return {key: value for key, value in os.environ.items() if key not in process_env() and key != "RAY_ADDRESS"}


def sluice_cli(*args: str, timeout_s: float = 300) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "sluice.cli.main", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, cwd=ROOT, env=user_env())


def processes_naming(folder: str) -> list[psutil.Process]:
    """The processes whose command line names `folder`."""
    found = []
    for process in psutil.process_iter(["cmdline"]):
        if any(folder in part for part in process.info["cmdline"] or []):
            found.append(process)
    return found


@contextmanager
def user_started_ray() -> Iterator[UserRay]:
    """`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 ray start --head --node-ip-address 127.0.0.1` in the foreground."""
    port = free_port()
    folder = tempfile.mkdtemp(prefix="sluice-ray-", dir="/tmp")
    env_part, command = COMPATIBLE_RAY_START.split(" ", 1)
    key, value = env_part.split("=")
    argv = [str(Path(sys.executable).parent / "ray"), *command.split()[1:]]
    argv += ["--block", "--port", str(port), "--temp-dir", folder, "--include-dashboard=false"]
    argv += ["--disable-usage-stats"]
    # Token authentication on, as Ray 2.60's `ray start` turns it on wherever a token exists (`~/.ray/auth_token`).
    # The test's own stop at the end is immediate: on SIGTERM, Ray 2.60's `ray start --block` first waits up to
    # 30 s (`RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S`) for the node to drain, which a head with Serve's controller
    # never does.
    env = {**user_env(), key: value, "RAY_AUTH_MODE": "token", "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}
    ray_start = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    address = f"127.0.0.1:{port}"
    try:

        def up() -> bool:
            assert ray_start.poll() is None, "ray start exited"
            return sluice_cli("status", "--address", address, timeout_s=60).returncode == 0

        wait_until(60, up, "ray start to come up", poll_s=1)
        yield UserRay(address, folder)
    finally:
        ray_start.send_signal(signal.SIGTERM)
        try:
            ray_start.wait(timeout=60)
        except subprocess.TimeoutExpired:
            ray_start.kill()
        _, alive = psutil.wait_procs(processes_naming(folder), timeout=20)
        for process in alive:
            process.kill()
        psutil.wait_procs(alive, timeout=10)
        shutil.rmtree(folder, ignore_errors=True)


def embedded_default_spec(tmp: Path, name: str, **model: object) -> tuple[Path, int]:
    """`local-cpu.yaml` as the stack `name` on free ports, `model` over its model's fields; (its path, its port)."""
    spec = yaml.safe_load((ROOT / "topologies" / "teams" / "local-cpu.yaml").read_text())
    port = free_port()
    spec["name"] = name
    spec["frontend"].update(port=port, metrics_port=free_port())
    spec["models"][0].update(model)
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    register_frontend(port)
    return path, port
