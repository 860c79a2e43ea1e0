"""The data plane's priority: HAProxy started from a thread at Ray's worker niceness runs at the default one where
the process may lower it (root here and in CI), at the inherited one where it may not; every thread alike."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from infra.haproxy.apps import AppRoute
from infra.haproxy.config import HAProxySettings
from infra.haproxy.process import DATA_PLANE_NICENESS, HAProxyProcess
from tests.support.ports import free_port

pytestmark = pytest.mark.integration

# Ray's `worker_niceness`: what the frontend replica's threads run at.
RAY_WORKER_NICENESS = 15


def thread_niceness(pid: int) -> set[int]:
    return {os.getpriority(os.PRIO_PROCESS, int(tid)) for tid in os.listdir(f"/proc/{pid}/task")}


def start_from_a_ray_worker_thread(settings: HAProxySettings) -> HAProxyProcess:
    """Start HAProxy from a thread at Ray's worker niceness (Linux keeps a niceness per thread; the fork inherits
    the starting thread's)."""
    started: list[HAProxyProcess] = []

    def start() -> None:
        os.setpriority(os.PRIO_PROCESS, 0, RAY_WORKER_NICENESS)
        started.append(HAProxyProcess(settings).start())

    thread = threading.Thread(target=start)
    thread.start()
    thread.join(60)
    assert started, "HAProxy did not start"
    return started[0]


def test_haproxy_runs_at_the_data_plane_niceness_not_ray_workers(tmp_path: Path) -> None:
    settings = HAProxySettings(
        workdir=tmp_path, apps=[AppRoute(name="priority-llm")], port=free_port(), prometheus_port=free_port()
    )
    haproxy = start_from_a_ray_worker_thread(settings)
    try:
        assert haproxy.worker_pid is not None and haproxy.pid is not None
        expected = DATA_PLANE_NICENESS if os.geteuid() == 0 else RAY_WORKER_NICENESS
        assert haproxy.niceness == expected
        assert thread_niceness(haproxy.worker_pid) == thread_niceness(haproxy.pid) == {expected}
    finally:
        haproxy.stop()
    # The caller's own thread is untouched.
    assert os.getpriority(os.PRIO_PROCESS, 0) == 0
