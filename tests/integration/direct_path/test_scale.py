"""Scaling the LLM deployment 2 -> 3 -> 2 under live streams: HAProxy follows through its runtime API alone, and
not one request fails or is cut. `SLUICE_SCALE_REPEATS=N` runs the cycle N times in one test (CI runs it once)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

from base.contracts import REPLICA_HEADER, SERVE_REASON_HEADER
from base.waiting import wait_until
from infra.haproxy.config import REPLICA_BACKEND
from services.serve_internals import wait_for_endpoints
from sluice.bench.stack_harness import DirectStreamStack
from tests.support.llm_cluster import LLMCluster, deploy_llm_app, direct_stack
from tests.support.sse import chunks, data_lines

pytestmark = pytest.mark.integration

STREAM = {"model": "sluice-tiny", "prompt": "ka lo", "max_tokens": 100, "ignore_eos": True, "stream": True}
STREAMERS = 8
REPEATS = int(os.environ.get("SLUICE_SCALE_REPEATS", "1"))


@pytest.fixture(scope="module")
def stack(llm_cluster: LLMCluster):
    with direct_stack(
        llm_cluster,
        routers=1,
        policy="power_of_two",
        check_inter_s=1.0,
    ) as started:
        yield started


class Streamers:
    """`STREAMERS` clients, each running one stream after another until stopped (bounded to 10 min)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.failures: list[str] = []
        self.served: list[str] = []  # replica id of every completed stream
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,)) for i in range(STREAMERS)]

    def _run(self, worker: int) -> None:
        deadline = time.monotonic() + 600
        with httpx.Client(timeout=120) as client:
            while not self._stop.is_set() and time.monotonic() < deadline:
                try:
                    with client.stream("POST", f"{self.url}/v1/completions", json=STREAM) as r:
                        if r.status_code != 200:
                            self.failures.append(
                                f"worker {worker}: {r.status_code} {r.headers.get(SERVE_REASON_HEADER)}"
                            )
                            continue
                        parsed = chunks(data_lines(r))
                        replica = r.headers[REPLICA_HEADER]
                    if parsed[-1]["choices"][0]["finish_reason"] != "length":
                        self.failures.append(f"worker {worker}: stream from {replica} ended early")
                    self.served.append(replica)
                except Exception as error:  # every failure is reported by the test's assertion
                    self.failures.append(f"worker {worker}: {error!r}")
                self._stop.wait(0.3)  # leaves a starting replica some CPU on 2 cores

    def __enter__(self) -> Streamers:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=120)


def _wait(predicate, timeout_s: float, what: str) -> None:
    wait_until(timeout_s, predicate, what, poll_s=0.2)


def test_scale_2_3_2_while_streams_run_without_a_reload(
    stack: DirectStreamStack, llm_cluster: LLMCluster, tiny_model_dir: Path
) -> None:
    assert stack.runtime is not None and stack.haproxy is not None
    before = stack.runtime.show_info()
    master_pid, worker_pid = stack.haproxy.pid, before["Pid"]
    with Streamers(stack.url) as streamers:
        _wait(lambda: len(streamers.served) >= STREAMERS, 120, "streams never got going")
        for cycle in range(REPEATS):
            original = {e.replica_id for e in llm_cluster.endpoints}
            # The session's app as it was deployed (its tracing too), but for the count: Serve scales, not restarts.
            three_replicas = llm_cluster.config.deployment.model_copy(update={"num_replicas": 3})
            deploy_llm_app(llm_cluster.app, tiny_model_dir, three_replicas, tracing=llm_cluster.config.tracing)
            three = {e.replica_id for e in wait_for_endpoints(llm_cluster.app, 3, timeout_s=300)}
            assert original < three, f"cycle {cycle}: scaling up restarted the running replicas instead of adding one"
            (added,) = three - original
            stack.wait_until_serving(replicas=3, routers=1, timeout_s=60)
            _wait(lambda: added in streamers.served, 60, "the new replica never received traffic")  # noqa: B023

            deploy_llm_app(
                llm_cluster.app, tiny_model_dir, llm_cluster.config.deployment, tracing=llm_cluster.config.tracing
            )
            llm_cluster.endpoints[:] = wait_for_endpoints(llm_cluster.app, 2, timeout_s=120)
            assert {e.replica_id for e in llm_cluster.endpoints} < three
            _wait(lambda: stack.up_servers(REPLICA_BACKEND) == 2, 60, "HAProxy still balances to the removed replica")
            served_at_two = len(streamers.served)
            _wait(
                lambda: len(streamers.served) >= served_at_two + STREAMERS,  # noqa: B023
                60,
                "streams stalled after scale-down",
            )
            assert streamers.failures == [], f"cycle {cycle}"
    assert streamers.failures == []
    after = stack.runtime.show_info()
    assert stack.haproxy.pid == master_pid and psutil.pid_exists(master_pid)
    assert after["Pid"] == worker_pid, "HAProxy was reloaded (a new worker process)"
    assert int(after["Uptime_sec"]) >= int(before["Uptime_sec"])
