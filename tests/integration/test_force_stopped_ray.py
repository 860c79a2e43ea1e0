"""Nothing outlives its node's Ray: with the embedded default deployed on a Ray the user started, `ray stop --force`
(done here to this cluster alone: SIGKILL at once to its raylet, its other daemons and its workers, as `ray stop
--force` sends every Ray process of the machine) leaves none of the stack's vLLM engines (`VLLM::EngineCore`) nor its
HAProxy within 10 s. Without `services.orphan_guard` the engines were re-parented to init and ran on, 1.6 GB each:
Ray reaps a worker's children from its raylet, killed too. (A raylet killed alone leaves none either way: its
workers exit by themselves, and vLLM's shutdown ends the engine.)"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from base.waiting import WaitTimeout, wait_until
from tests.support.user_ray import UserRay, embedded_default_spec, processes_naming, sluice_cli, user_started_ray

pytestmark = [pytest.mark.integration, pytest.mark.own_ray]

ENGINE_TITLE = "VLLM::EngineCore"
RAY_WORKER_TITLE = "ray::"
RAY_PACKAGE = "/site-packages/ray/"
GONE_WITHIN_S = 10


@pytest.fixture(scope="module")
def ray() -> Iterator[UserRay]:
    with user_started_ray() as started:
        yield started


def _alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _title(process: psutil.Process) -> str:
    try:
        return " ".join(process.cmdline())
    except psutil.Error:
        return ""


def test_a_force_stopped_ray_leaves_no_engine_and_no_haproxy(ray: UserRay, tmp_path: Path) -> None:
    spec, _ = embedded_default_spec(tmp_path, "force-stopped")
    deployed = sluice_cli("deploy", str(spec), "--address", ray.address, timeout_s=700)
    assert deployed.returncode == 0, deployed.stdout + deployed.stderr
    (raylet,) = [p for p in psutil.process_iter(["name"]) if p.info["name"] == "raylet" and ray.folder in _title(p)]
    tree = raylet.children(recursive=True)
    engines = [p for p in tree if _title(p).startswith(ENGINE_TITLE)]
    haproxies = [p for p in tree if "haproxy" in _title(p)]
    assert len(engines) == 2 and len(haproxies) == 2, [_title(p) for p in tree]  # HAProxy: master and worker
    # What `ray stop --force` kills: Ray's own processes (its workers titled `ray::...`), not what they started.
    workers = [p for p in tree if _title(p).startswith(RAY_WORKER_TITLE) or RAY_PACKAGE in _title(p)]
    assert len(workers) >= 3, [_title(p) for p in tree]  # at least the two LLM replicas' and the frontend's
    for process in [*processes_naming(ray.folder), *workers]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, signal.SIGKILL)

    def gone() -> bool:
        return not any(_alive(p) for p in engines + haproxies)

    with contextlib.suppress(WaitTimeout):
        wait_until(GONE_WITHIN_S, gone, "the stack's engines and HAProxy to end", poll_s=0.2)
    left = [p for p in engines + haproxies if _alive(p)]
    for process in left:
        process.kill()
    assert not left, f"outlived their Ray by {GONE_WITHIN_S} s: {[_title(p) for p in left]}"
