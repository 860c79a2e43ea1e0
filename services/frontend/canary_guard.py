"""The canary's abort criteria, measured on both paths side by side from the frontend's request log.

Per path over a sliding window: 503 ratio, TTFT p99, stream-error ratio, replica imbalance. Only the direct path can
breach, and only with `min_requests` in the window; injected faults count nowhere. Each criterion's definition:
services/frontend/README.md (the canary).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

from base.contracts import CANARY_CRITERIA, DIRECT_PATH, LEGACY_PATH, REASON_INJECTED_FAULT
from base.quantiles import quantile
from base.spec_config import SPEC_SECTION_CONFIG


class AbortCriteria(BaseModel):
    """When a canary rolls back by itself: any threshold the direct path goes over, within `window_s`."""

    model_config = SPEC_SECTION_CONFIG

    max_503_ratio: float = Field(0.05, ge=0, le=1)
    """The direct path's share of 503 answers that rolls the canary back."""
    max_ttft_p99_s: float = Field(10.0, gt=0)
    """The direct path's time to first token (p99, seconds) that rolls the canary back."""
    max_stream_error_ratio: float = Field(0.02, ge=0, le=1)
    """The direct path's share of streams that end in error that rolls the canary back."""
    max_replica_imbalance: float = Field(4.0, ge=1)
    """The busiest replica's share of the path's requests over the mean share (1.0 is perfect balance)."""
    min_requests: int = Field(20, ge=1)
    """Requests the direct path must have served in the window before any threshold counts."""
    window_s: float = Field(60.0, gt=0)
    """The window (seconds) the thresholds are measured over."""

    def threshold(self, criterion: str) -> float:
        return {
            "ratio_503": self.max_503_ratio,
            "ttft_p99_s": self.max_ttft_p99_s,
            "stream_error_ratio": self.max_stream_error_ratio,
            "replica_imbalance": self.max_replica_imbalance,
        }[criterion]


@dataclass(frozen=True)
class RequestRecord:
    """One finished request as the frontend logged it."""

    at: float  # when the record arrived (monotonic seconds)
    app: str
    path: str
    status: int
    # Time to the response headers in seconds (None when no server answered).
    ttft_s: float | None
    # HAProxy's termination state: its first character says who ended the stream ('-' normally, 'C' the client).
    termination: str
    # The server HAProxy sent it to (the pinned replica on the direct path; `<NOSRV>` when none).
    server: str
    served_replica: str | None
    request_id: str
    # How long the route call took as HAProxy's Lua action saw it (None: no route call, e.g. the legacy path).
    route_s: float | None = None
    # Why it was not routed as ranked: the fail-closed 503's reason (or the fallback's); None when routed as ranked.
    reason: str | None = None

    @property
    def stream_error(self) -> bool:
        return 200 <= self.status < 300 and self.termination[:1] not in ("-", "C")


class PathMeasures(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    path: str
    requests: int
    ratio_503: float
    ttft_p99_s: float
    stream_error_ratio: float
    replica_imbalance: float


class Breach(BaseModel):
    """The criterion that rolled a canary back, what was measured and the threshold it went over."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    criterion: str
    value: float
    threshold: float
    direct: PathMeasures
    legacy: PathMeasures

    def describe(self) -> str:
        return (
            f"{self.criterion} on the direct path was {self.value:.3f} over the threshold {self.threshold:.3f} "
            f"({self.direct.requests} requests; legacy path: {getattr(self.legacy, self.criterion):.3f} over "
            f"{self.legacy.requests} requests)"
        )


def _p99(values: list[float]) -> float:
    """The 99th percentile (`base.quantiles`, as `sluice load` gates compute it); 0 for no values."""
    return quantile(values, 0.99) if values else 0.0


def measure(path: str, records: Iterable[RequestRecord], live_replicas: Iterable[str]) -> PathMeasures:
    """The path's measures over `records` (already narrowed to the window and the path)."""
    records = list(records)
    ok = [r for r in records if 200 <= r.status < 300]
    served = Counter(r.served_replica for r in records if r.served_replica)
    live = set(live_replicas) | set(served)
    imbalance = max(served.values()) / (sum(served.values()) / len(live)) if served else 1.0
    return PathMeasures(
        path=path,
        requests=len(records),
        ratio_503=sum(r.status == 503 for r in records) / len(records) if records else 0.0,
        ttft_p99_s=_p99([r.ttft_s for r in ok if r.ttft_s is not None]),
        stream_error_ratio=sum(r.stream_error for r in ok) / len(ok) if ok else 0.0,
        replica_imbalance=imbalance,
    )


def evaluate(
    criteria: AbortCriteria, records: Iterable[RequestRecord], live_replicas: Iterable[str]
) -> tuple[Breach | None, PathMeasures, PathMeasures]:
    """The first criterion the direct path breaches (None when it breaches none, or has too few requests), and
    both paths' measures; injected faults left out."""
    records = [r for r in records if r.reason != REASON_INJECTED_FAULT]
    live = list(live_replicas)
    direct = measure(DIRECT_PATH, (r for r in records if r.path == DIRECT_PATH), live)
    legacy = measure(LEGACY_PATH, (r for r in records if r.path == LEGACY_PATH), live)
    if direct.requests < criteria.min_requests:
        return None, direct, legacy
    for criterion in CANARY_CRITERIA:
        value = getattr(direct, criterion)
        if value > criteria.threshold(criterion):
            breach = Breach(
                criterion=criterion, value=value, threshold=criteria.threshold(criterion), direct=direct, legacy=legacy
            )
            return breach, direct, legacy
    return None, direct, legacy
