"""Why each routing decision went the way it did, counted per policy and exported to Prometheus; and the capacity
ledger's tokens (`LEDGER_METRICS`, the last snapshot a capacity-metered router read at its scrape, per app), and a
kv_aware router's replicas by where their scores come from (`KV_REPLICAS`), and the CPU time of each decision on the
route agent (`DECISION_SECONDS`).

Reasons are a small fixed vocabulary per policy, so the label set stays low-cardinality. Every router of an app
exports the same ledger: aggregate across routers with `max`, never `sum`. More: routers/README.md#metrics.
"""

from __future__ import annotations

from collections import Counter as Tally
from collections.abc import Iterator

from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

DECISIONS_TOTAL = Counter(
    "sluice_router_decisions",
    "Routing decisions by policy and reason.",
    ["policy", "reason"],
)
EVENTS_TOTAL = Counter(
    "sluice_router_events",
    "Noteworthy routing events (double releases, reaped tokens, ledger faults) by policy.",
    ["policy", "event"],
)

# A decision takes 5-150 µs of CPU on these machines (docs/design.md §5): buckets from 25 µs to 25 ms.
DECISION_SECONDS = Histogram(
    "sluice_router_decision_seconds",
    "CPU time of each routing decision answered on the route agent, its frame decoded and answer encoded.",
    ["app", "policy"],
    buckets=(25e-6, 50e-6, 100e-6, 200e-6, 400e-6, 700e-6, 1e-3, 2e-3, 5e-3, 10e-3, 25e-3),
)
# Shadow policies (`routers.shadows`): each policy's predicted prefix hit ratio and pick spread, live or shadow,
# beside the hit ratio the engines report, as of the router's last scrape.
PREDICTED_HIT_RATIO = Gauge(
    "sluice_router_predicted_hit_ratio",
    "Prefix cache hits each policy's picks were predicted to get (cached over prompt tokens), live or shadow.",
    ["app", "policy", "role"],
)
PICK_SPREAD = Gauge(
    "sluice_router_pick_spread",
    "The most picked replica's share of a policy's last picks over the mean share, live or shadow.",
    ["app", "policy", "role"],
)
ENGINE_HIT_RATIO = Gauge(
    "sluice_router_engine_prefix_hit_ratio",
    "The target replicas' prefix cache hits over queries (tokens), as their engines report them.",
    ["app"],
)
KV_REPLICAS = Gauge(
    "sluice_router_kv_replicas",
    "A kv_aware router's target replicas by where their scores come from (events, approximate, lost).",
    ["app", "source"],
)


class DecisionCounts:
    """Per-policy-instance tallies (what tests read) mirrored into the process-wide counters."""

    def __init__(self, policy: str, exported: bool = True) -> None:
        """`exported` False: tallies only (a shadow policy's decisions are not the router's)."""
        self.policy = policy
        self.exported = exported
        self.decisions: Tally[str] = Tally()
        self.events: Tally[str] = Tally()
        self.last_reason = ""
        self._decision_children: dict[str, object] = {}

    def record(self, reason: str) -> None:
        self.decisions[reason] += 1
        self.last_reason = reason
        if not self.exported:
            return
        child = self._decision_children.get(reason)
        if child is None:
            child = self._decision_children[reason] = DECISIONS_TOTAL.labels(self.policy, reason)
        child.inc()

    def event(self, name: str, amount: int = 1) -> None:
        self.events[name] += amount
        if self.exported:
            EVENTS_TOTAL.labels(self.policy, name).inc(amount)


# The ledger snapshot's counters (`CapacityLedger.snapshot`) -> the `event` label of `sluice_ledger_token_events`.
LEDGER_EVENTS = {
    "granted": "granted",
    "released": "released",
    "reaped": "reaped",
    "double_releases": "double_release",
    "unknown_releases": "unknown_release",
    "late_releases": "late_release",
    "rejected": "rejected",
}


class LedgerMetrics:
    """A Prometheus collector of the last ledger snapshot of each app (none: nothing exported)."""

    def __init__(self) -> None:
        self._snapshots: dict[str, dict] = {}

    def update(self, app: str, snapshot: dict | None) -> None:
        """The app's ledger as read for this scrape; None (the ledger did not answer) exports nothing for it."""
        if snapshot is None:
            self._snapshots.pop(app, None)
        else:
            self._snapshots[app] = snapshot

    def collect(self) -> Iterator[Metric]:
        if not self._snapshots:
            return
        tokens = GaugeMetricFamily(
            "sluice_ledger_tokens",
            "Capacity tokens per replica: held (requests in flight) and free (capacity left).",
            labels=["app", "replica", "state"],
        )
        waiting = GaugeMetricFamily("sluice_ledger_waiting", "Requests queued for a capacity token.", labels=["app"])
        events = CounterMetricFamily(
            "sluice_ledger_token_events",
            "Capacity tokens by what became of them (since the ledger started).",
            labels=["app", "event"],
        )
        for app, snapshot in sorted(self._snapshots.items()):
            for replica, held in sorted(snapshot["replicas"].items()):
                tokens.add_metric([app, replica, "held"], held["in_flight"])
                tokens.add_metric([app, replica, "free"], max(held["capacity"] - held["in_flight"], 0))
            waiting.add_metric([app], snapshot["waiting"])
            for key, event in LEDGER_EVENTS.items():
                events.add_metric([app, event], snapshot[key])
        yield from (tokens, waiting, events)


LEDGER_METRICS = LedgerMetrics()
REGISTRY.register(LEDGER_METRICS)
