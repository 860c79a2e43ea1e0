"""Nothing outlives its node's Ray: with the embedded default deployed on a Ray the user started, a SIGKILLed raylet
(what a hung node's operator or the OOM killer does; `ray stop --force` kills it the same way) leaves none of the
stack's vLLM engines (`VLLM::EngineCore`) nor its HAProxy within 10 s. Without `services.orphan_guard` the engines
were re-parented to init and ran on, 1.6 GB each."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from base.waiting import WaitTimeout, wait_until
from tests.support.user_ray import UserRay, embedded_default_spec, sluice_cli, user_started_ray

pytestmark = [pytest.mark.integration, pytest.mark.own_ray]

ENGINE_TITLE = "VLLM::EngineCore"
GONE_WITHIN_S = 10


@pytest.fixture(scope="module")
def ray() -> Iterator[UserRay]:
    with user_started_ray() as started:
        yield started


def _title(process: psutil.Process) -> str:
    try:
        return " ".join(process.cmdline())
    except psutil.Error:
        return ""


def test_a_killed_raylet_leaves_no_engine_and_no_haproxy(ray: UserRay, tmp_path: Path) -> None:
    spec, _ = embedded_default_spec(tmp_path, "force-stopped")
    deployed = sluice_cli("deploy", str(spec), "--address", ray.address, timeout_s=700)
    assert deployed.returncode == 0, deployed.stdout + deployed.stderr
    (raylet,) = [p for p in psutil.process_iter(["name"]) if p.info["name"] == "raylet" and ray.folder in _title(p)]
    tree = raylet.children(recursive=True)
    engines = [p for p in tree if _title(p).startswith(ENGINE_TITLE)]
    haproxies = [p for p in tree if "haproxy" in _title(p)]
    assert len(engines) == 2 and len(haproxies) == 2, [_title(p) for p in tree]  # HAProxy: master and worker
    os.kill(raylet.pid, signal.SIGKILL)

    def gone() -> bool:
        return not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in engines + haproxies)

    with contextlib.suppress(WaitTimeout):
        wait_until(GONE_WITHIN_S, gone, "the stack's engines and HAProxy to end", poll_s=0.2)
    left = [p for p in engines + haproxies if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    for process in left:
        process.kill()
    assert not left, f"outlived the raylet by {GONE_WITHIN_S} s: {[_title(p) for p in left]}"
