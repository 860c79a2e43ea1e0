"""Why each routing decision went the way it did, counted per policy and exported to Prometheus.

Reasons are a small fixed vocabulary per policy (`primary`, `fallback_1`, `no_session_header`,
`bound_exceeded`, `ledger_fault_fallback`, `waited`, ...), so the label set stays low-cardinality.
"""

from __future__ import annotations

from collections import Counter as Tally

from prometheus_client import Counter

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


class DecisionCounts:
    """Per-policy-instance tallies (what tests read) mirrored into the process-wide counters."""

    def __init__(self, policy: str) -> None:
        self.policy = policy
        self.decisions: Tally[str] = Tally()
        self.events: Tally[str] = Tally()
        self.last_reason = ""
        self._decision_children: dict[str, object] = {}

    def record(self, reason: str) -> None:
        self.decisions[reason] += 1
        self.last_reason = reason
        child = self._decision_children.get(reason)
        if child is None:
            child = self._decision_children[reason] = DECISIONS_TOTAL.labels(self.policy, reason)
        child.inc()

    def event(self, name: str, amount: int = 1) -> None:
        self.events[name] += amount
        EVENTS_TOTAL.labels(self.policy, name).inc(amount)
