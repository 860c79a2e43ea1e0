"""The frontend's ingress: the direct weight (the canary), connection-draining moves between the paths, and the
guard that rolls a canary back by itself.

A move reaches HAProxy at once (`set map`, no reload); a path that lost all its traffic drains up to a deadline; a
run-time weight survives a crash of the frontend replica (Ray's KV store). Details: services/frontend/README.md.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import Counter
from collections.abc import Callable

from pydantic import BaseModel, ConfigDict, Field

from base.contracts import DIRECT_PATH, DIRECT_WEIGHT_MAX, LEGACY_PATH
from base.waiting import WaitTimeout, async_wait_until
from infra.haproxy.canary import LEGACY_BACKEND, ROLLBACK_COUNTER, ROLLBACK_TABLE, weights_map
from infra.haproxy.config import REPLICA_BACKEND, HAProxySettings, is_internal_server
from infra.haproxy.runtime_api import RuntimeAPI
from services.frontend.canary_guard import AbortCriteria, Breach, PathMeasures, evaluate
from services.frontend.path_log import PathLog

logger = logging.getLogger(__name__)
GUARD_INTERVAL_S = 1.0
# Where a stack's run-time weight is kept in Ray's KV store: it outlives every frontend replica of the stack, and
# only deleting the stack (`forget_ingress`) drops it.
INGRESS_STORE_PREFIX = "sluice/ingress/"
# How long a move towards the legacy path waits for every app's legacy ingress to be UP in HAProxy.
LEGACY_WAIT_S = 60.0
DRAIN_POLL_S = 0.1
DRAIN_DEADLINE_S_DEFAULT = 120.0


class NoLegacyPath(RuntimeError):
    """A move towards the legacy path while an app has no legacy ingress replica UP."""


class IngressConfig(BaseModel):
    """The declared ingress of a stack (the Frontend deployment's `user_config`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    direct_weight: int = Field(DIRECT_WEIGHT_MAX, ge=0, le=DIRECT_WEIGHT_MAX)
    abort: AbortCriteria = AbortCriteria()
    drain_deadline_s: float = Field(DRAIN_DEADLINE_S_DEFAULT, gt=0)


class DrainReport(BaseModel):
    """How a path that lost its traffic emptied: done, or the servers still streaming at the deadline."""

    model_config = ConfigDict(extra="forbid")

    path: str
    waited_s: float = 0.0
    done: bool = False
    # Server (replica id) -> streams still running at the deadline.
    still_running: dict[str, int] = Field(default_factory=dict)


class CanaryAbort(BaseModel):
    model_config = ConfigDict(extra="forbid")

    at: float  # wall-clock time
    app: str
    weight_before: int
    breach: Breach

    def describe(self) -> str:
        return f"canary rolled back from weight {self.weight_before}: {self.app}: {self.breach.describe()}"


class AppMeasures(BaseModel):
    model_config = ConfigDict(extra="forbid")

    app: str
    direct: PathMeasures
    legacy: PathMeasures


class IngressStatus(BaseModel):
    model_config = ConfigDict(extra="forbid")

    direct_weight: int
    declared_weight: int
    drain: DrainReport | None = None
    abort: CanaryAbort | None = None
    # Over the abort criteria's window.
    measures: list[AppMeasures] = Field(default_factory=list)


class IngressController:
    def __init__(
        self,
        settings: HAProxySettings,
        runtime: Callable[[], RuntimeAPI | None],
        log: PathLog,
        live_replicas: Callable[[], dict[str, list[str]]],
        legacy_up: Callable[[], bool],
        store_key: str,
    ) -> None:
        self._legacy_up = legacy_up
        self.settings = settings
        self._runtime = runtime
        self._log = log
        self._live_replicas = live_replicas
        self._store_key = store_key
        self.config = IngressConfig(direct_weight=settings.direct_weight)
        self.weight = settings.direct_weight
        self.drain: DrainReport | None = None
        self.abort: CanaryAbort | None = None
        # Automatic rollbacks by the criterion breached, since this replica started.
        self.rollbacks: Counter[str] = Counter()
        self._drain_task: asyncio.Task[DrainReport] | None = None
        # When the weight last changed: the guard judges the weight in force on what happened since.
        self._weight_since = time.monotonic()

    # Declarations and moves.
    async def declare(self, config: IngressConfig) -> None:
        """Apply the declared ingress; a run-time weight set since this same declaration stays in force (a restarted
        or redeployed replica's, and when Serve applies the same `user_config` again, as it does after a rolling
        restart): only a new declaration replaces it."""
        stored = await asyncio.to_thread(self._load)
        self.config = config
        restored = stored is not None and stored.get("declared") == config.model_dump(mode="json")
        try:
            await self.shift(int(stored["weight"]) if restored and stored else config.direct_weight)
        except NoLegacyPath as error:
            logger.error("the declared ingress is not applied: %s", error)

    async def shift(self, weight: int) -> DrainReport | None:
        """Set the direct weight now; when a path lost all its traffic, start draining it (`wait_drained`)."""
        if not 0 <= weight <= DIRECT_WEIGHT_MAX:
            raise ValueError(f"direct weight {weight} is not within 0..{DIRECT_WEIGHT_MAX}")
        if weight < DIRECT_WEIGHT_MAX:
            await self._until_legacy_up()
        before = self.weight
        drained = DIRECT_PATH if weight == 0 else LEGACY_PATH if weight == DIRECT_WEIGHT_MAX else None
        starts_drain = drained is not None and not (weight == before and self._drain_task is not None)
        if starts_drain:
            if self._drain_task is not None:
                self._drain_task.cancel()
            self.drain = DrainReport(path=drained)
        self.weight = weight  # with its drain report: a reader never sees the new weight with an old drain
        if weight != before:
            self._weight_since = time.monotonic()
        await asyncio.to_thread(self._write_weight, weight)
        if weight != before:
            logger.info("direct weight %d -> %d", before, weight)
        if starts_drain and self.drain is not None:
            self._drain_task = asyncio.create_task(self._drain(self.drain, self.config.drain_deadline_s))
        return self.drain

    async def wait_drained(self) -> DrainReport | None:
        if self._drain_task is not None:
            await asyncio.shield(self._drain_task)
        return self.drain

    def status(self) -> IngressStatus:
        measures = [
            AppMeasures(app=app, direct=direct, legacy=legacy) for app, (_, direct, legacy) in self._evaluate().items()
        ]
        return IngressStatus(
            direct_weight=self.weight,
            declared_weight=self.config.direct_weight,
            drain=self.drain,
            abort=self.abort,
            measures=measures,
        )

    def _evaluate(self) -> dict[str, tuple[Breach | None, PathMeasures, PathMeasures]]:
        """Each app's breach (or None) and path measures over the window."""
        since = max(time.monotonic() - self.config.abort.window_s, self._weight_since)
        records = self._log.records_since(since)
        live = self._live_replicas()
        return {
            app.name: evaluate(self.config.abort, (r for r in records if r.app == app.name), live.get(app.name, []))
            for app in self.settings.apps
        }

    # The guard.
    async def guard(self) -> None:
        """Evaluate the abort criteria every `GUARD_INTERVAL_S` while a canary runs; roll back on a breach."""
        while True:
            await asyncio.sleep(GUARD_INTERVAL_S)
            if not 0 < self.weight < DIRECT_WEIGHT_MAX:
                continue
            for app, (breach, _, _) in self._evaluate().items():
                if breach is not None:
                    self.abort = CanaryAbort(at=time.time(), app=app, weight_before=self.weight, breach=breach)
                    logger.warning("%s", self.abort.describe())
                    await self.shift(0)
                    self.rollbacks[breach.criterion] += 1
                    await asyncio.to_thread(self.publish_rollbacks)
                    break

    def publish_rollbacks(self) -> None:
        """Set HAProxy's rollback table to the counts (a no-op while HAProxy is down: its restart publishes them)."""
        runtime = self._runtime()
        if runtime is not None:
            for criterion, count in self.rollbacks.items():
                runtime.set_table_counter(ROLLBACK_TABLE, criterion, ROLLBACK_COUNTER, count)

    # Internals.
    async def _until_legacy_up(self) -> None:
        async def legacy_up() -> bool:
            return await asyncio.to_thread(self._legacy_up)

        what = "every app's legacy ingress to be UP in HAProxy"
        try:
            await async_wait_until(LEGACY_WAIT_S, legacy_up, what, DRAIN_POLL_S, logger)
        except WaitTimeout:
            raise NoLegacyPath(
                f"no legacy ingress replica came UP within {LEGACY_WAIT_S:.0f} s: deploy the stack with "
                "ingress.mode both (or legacy) first"
            ) from None

    async def _drain(self, report: DrainReport, deadline_s: float) -> DrainReport:
        started = time.monotonic()
        while True:
            running = await asyncio.to_thread(self._streams_on, report.path)
            report.waited_s = round(time.monotonic() - started, 3)
            if not running:
                report.done = True
                return report
            if report.waited_s >= deadline_s:
                report.still_running = running
                logger.warning("drain of the %s path hit its deadline; still running: %s", report.path, running)
                return report
            await asyncio.sleep(DRAIN_POLL_S)

    def _streams_on(self, path: str) -> dict[str, int]:
        """Streams each server of `path` holds now (servers holding none left out)."""
        runtime = self._runtime()
        if runtime is None:
            return {}
        prefix = REPLICA_BACKEND if path == DIRECT_PATH else LEGACY_BACKEND
        return {
            name: stat.scur
            for (backend, name), stat in runtime.show_stat().items()
            if backend.startswith(prefix) and not is_internal_server(name) and stat.scur > 0
        }

    def _write_weight(self, weight: int) -> None:
        names = [app.name for app in self.settings.apps]
        self.settings.weights_map_path.write_text(weights_map(names, weight))
        runtime = self._runtime()
        if runtime is not None:
            for name in names:
                runtime.set_map(self.settings.weights_map_path, name, str(weight))
        self._store({"declared": self.config.model_dump(mode="json"), "weight": weight})

    def _load(self) -> dict[str, object] | None:
        from ray.experimental import internal_kv

        if not internal_kv._internal_kv_initialized():
            return None
        raw = internal_kv._internal_kv_get(self._store_key)
        return json.loads(raw) if raw else None

    def _store(self, value: dict[str, object]) -> None:
        from ray.experimental import internal_kv

        if internal_kv._internal_kv_initialized():
            internal_kv._internal_kv_put(self._store_key, json.dumps(value).encode(), overwrite=True)


def ingress_store_key(stack: str) -> str:
    return f"{INGRESS_STORE_PREFIX}{stack}"


def forget_ingress(stack: str) -> None:
    """Drop a deleted stack's run-time weight, so a stack deployed later under its name starts at its declaration."""
    from ray.experimental import internal_kv

    if internal_kv._internal_kv_initialized():
        internal_kv._internal_kv_del(ingress_store_key(stack))
