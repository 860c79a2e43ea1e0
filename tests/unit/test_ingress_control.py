"""The frontend's ingress controller against a recording stand-in for HAProxy's runtime API: weights go to the
map at once and to its file, a path that lost its traffic drains (or is listed at the deadline), the guard rolls a
breaching canary back, and a restarted replica keeps a run-time weight only under the same declaration."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import pytest

from base.contracts import DIRECT_PATH, DIRECT_WEIGHT_MAX, LEGACY_PATH, REASON_INJECTED_FAULT, REASON_ROUTER_UNREACHABLE
from infra.haproxy.apps import AppRoute
from infra.haproxy.canary import ROLLBACK_COUNTER, ROLLBACK_TABLE
from infra.haproxy.config import HAProxySettings
from infra.haproxy.runtime_api import ServerStat
from services.frontend import ingress_control
from services.frontend.canary_guard import AbortCriteria, RequestRecord
from services.frontend.ingress_control import IngressConfig, IngressController, NoLegacyPath
from services.frontend.path_log import PathLog


class RecordingRuntime:
    def __init__(self) -> None:
        self.maps: dict[str, str] = {}
        self.streams: dict[tuple[str, str], int] = {}
        self.tables: dict[tuple[str, str, str], int] = {}

    def set_map(self, path: Path, key: str, value: str) -> None:
        self.maps[key] = value

    def set_table_counter(self, table: str, key: str, counter: str, value: int) -> None:
        self.tables[(table, key, counter)] = value

    def show_stat(self) -> dict[tuple[str, str], ServerStat]:
        return {
            (backend, name): ServerStat(backend=backend, server=name, status="UP", scur=n, addr="127.0.0.1:1")
            for (backend, name), n in self.streams.items()
        }


def controller(tmp_path: Path, legacy_up: bool = True) -> tuple[IngressController, RecordingRuntime, PathLog]:
    settings = HAProxySettings(workdir=tmp_path, apps=[AppRoute(name="app", legacy_route_prefix="/app-legacy")])
    runtime, log = RecordingRuntime(), PathLog()
    made = IngressController(settings, lambda: runtime, log, lambda: {"app": ["r1", "r2"]}, lambda: legacy_up, "k")
    return made, runtime, log


def test_a_shift_reaches_haproxy_and_the_map_file_at_once(tmp_path: Path) -> None:
    ingress, runtime, _ = controller(tmp_path)
    assert asyncio.run(ingress.shift(30)) is None  # a partial move drains nothing
    assert runtime.maps == {"app": "30"}
    assert ingress.settings.weights_map_path.read_text() == "app 30\n"


def test_a_rollback_drains_the_direct_path_and_lists_what_runs_at_the_deadline(tmp_path: Path) -> None:
    ingress, runtime, _ = controller(tmp_path)
    ingress.config = IngressConfig(drain_deadline_s=0.3)
    runtime.streams = {("sluice_replicas", "r1"): 2, ("sluice_legacy", "l1"): 5}

    async def rollback_then_finish() -> tuple[object, object]:
        report = await ingress.shift(0)
        assert report is not None and report.path == DIRECT_PATH and not report.done
        drained = await ingress.wait_drained()
        return report, drained

    _, drained = asyncio.run(rollback_then_finish())
    assert not drained.done and drained.still_running == {"r1": 2}  # legacy streams are no concern of this drain

    # The legacy stream ends 0.15 s in; the deadline leaves a loaded machine 20 times that before the drain gives up.
    ingress.config = IngressConfig(drain_deadline_s=3.0)

    async def reverse() -> object:
        runtime.streams = {("sluice_legacy", "l1"): 1}
        await ingress.shift(100)
        await asyncio.sleep(0.15)
        runtime.streams = {}
        return await ingress.wait_drained()

    done = asyncio.run(reverse())
    assert done.path == LEGACY_PATH and done.done and done.still_running == {}


def test_a_move_to_the_legacy_path_without_a_legacy_replica_is_refused(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(ingress_control, "LEGACY_WAIT_S", 0.2)
    ingress, runtime, _ = controller(tmp_path, legacy_up=False)
    with pytest.raises(NoLegacyPath):
        asyncio.run(ingress.shift(0))
    assert ingress.weight == 100 and runtime.maps == {}


def _guard_a_canary(
    ingress: IngressController, runtime: RecordingRuntime, log: PathLog, weight: int, reason: str | None
) -> None:
    """A canary at `weight` whose direct path answered every other request 503 for `reason`, under the guard."""

    async def canary() -> None:
        ingress.abort = None  # as `sluice canary` does (the frontend's `shift`)
        await ingress.shift(weight)
        for i in range(10):
            status = 503 if i % 2 else 200
            log.add(
                RequestRecord(
                    time.monotonic(), "app", DIRECT_PATH, status, 0.01, "--", "r1", "r1", str(i),
                    reason=reason if status == 503 else None,
                )
            )  # fmt: skip
        rollbacks_before = sum(ingress.rollbacks.values())
        guard = asyncio.create_task(ingress.guard())
        for _ in range(40):
            await asyncio.sleep(0.05)
            if ingress.abort is not None:
                break
        # A rollback under way ends before the guard stops: the weight back to 0, the count published.
        for _ in range(200):
            if ingress.abort is None or (
                sum(ingress.rollbacks.values()) > rollbacks_before
                and all(
                    runtime.tables.get((ROLLBACK_TABLE, c, ROLLBACK_COUNTER)) == n for c, n in ingress.rollbacks.items()
                )
            ):
                break
            await asyncio.sleep(0.05)
        guard.cancel()

    asyncio.run(canary())


def test_the_guard_rolls_a_breaching_canary_back_names_the_criterion_and_counts_it(
    tmp_path: Path, monkeypatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(ingress_control, "GUARD_INTERVAL_S", 0.05)
    ingress, runtime, log = controller(tmp_path)
    ingress.config = IngressConfig(abort=AbortCriteria(min_requests=5))
    with caplog.at_level(logging.WARNING, logger=ingress_control.__name__):
        _guard_a_canary(ingress, runtime, log, 40, REASON_ROUTER_UNREACHABLE)
    assert ingress.abort is not None and ingress.abort.breach.criterion == "ratio_503"
    assert ingress.abort.weight_before == 40 and ingress.weight == 0 and runtime.maps == {"app": "0"}
    assert "ratio_503" in ingress.abort.describe()
    # Visible: a warning in the frontend's log, and `sluice_canary_rollbacks_total{reason="ratio_503"}` 1.
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert [r.getMessage() for r in warnings] == [ingress.abort.describe()]
    assert runtime.tables == {(ROLLBACK_TABLE, "ratio_503", ROLLBACK_COUNTER): 1}
    # A second rollback counts on; a restarted HAProxy (an empty table) gets the counts again.
    _guard_a_canary(ingress, runtime, log, 40, REASON_ROUTER_UNREACHABLE)
    assert runtime.tables == {(ROLLBACK_TABLE, "ratio_503", ROLLBACK_COUNTER): 2}
    runtime.tables.clear()
    ingress.publish_rollbacks()
    assert runtime.tables == {(ROLLBACK_TABLE, "ratio_503", ROLLBACK_COUNTER): 2}


def test_the_guard_leaves_a_canary_whose_only_503s_were_injected_faults(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(ingress_control, "GUARD_INTERVAL_S", 0.05)
    ingress, runtime, log = controller(tmp_path)
    ingress.config = IngressConfig(abort=AbortCriteria(min_requests=5))
    _guard_a_canary(ingress, runtime, log, 40, REASON_INJECTED_FAULT)
    assert ingress.abort is None and ingress.weight == 40 and runtime.maps == {"app": "40"}
    assert not ingress.rollbacks and not runtime.tables


@pytest.mark.parametrize(("declared_before", "expected"), [(30, 70), (20, 30)])
def test_a_restarted_replica_keeps_a_run_time_weight_only_under_the_same_declaration(
    tmp_path: Path, monkeypatch, declared_before: int, expected: int
) -> None:
    ingress, runtime, _ = controller(tmp_path)
    stored = {"declared": IngressConfig(direct_weight=declared_before).model_dump(mode="json"), "weight": 70}
    monkeypatch.setattr(ingress, "_load", lambda: stored)
    asyncio.run(ingress.declare(IngressConfig(direct_weight=30)))
    assert ingress.weight == expected and runtime.maps == {"app": str(expected)}


def test_the_same_declaration_applied_again_keeps_the_run_time_weight(tmp_path: Path, monkeypatch) -> None:
    """Serve applies a deployment's `user_config` again after a rolling restart: a rollback in force stays."""
    ingress, runtime, _ = controller(tmp_path)
    kv: dict[str, object] = {}
    monkeypatch.setattr(ingress, "_load", lambda: kv.get("value"))
    monkeypatch.setattr(ingress, "_store", lambda value: kv.__setitem__("value", value))
    declared = IngressConfig(direct_weight=DIRECT_WEIGHT_MAX)
    asyncio.run(ingress.declare(declared))
    asyncio.run(ingress.shift(0))  # `sluice rollback`
    asyncio.run(ingress.declare(declared))
    assert ingress.weight == 0 and runtime.maps == {"app": "0"}
    asyncio.run(ingress.declare(IngressConfig(direct_weight=50)))  # a new declaration wins
    assert ingress.weight == 50
