"""A campaign's metrics, computed from its raw rows and named as `vllm bench serve` names them.

TTFT, TPOT, ITL and E2EL (mean, p50, p90, p99 in ms), time to headers, stalls, chunks per token, goodput and, open
loop, schedule lag flagged per window. Definitions: loadtests/README.md (metrics and gates).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict, Field

from base.quantiles import quantile
from loadtests.sse_timing import StreamRow

LAG_WINDOW_S = 1.0


class Distribution(BaseModel):
    model_config = ConfigDict(frozen=True)

    count: int
    mean_ms: float
    # The population standard deviation, as `vllm bench serve`'s `std_*_ms` (np.std).
    std_ms: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    max_ms: float


def distribution(seconds: Sequence[float]) -> Distribution | None:
    if not seconds:
        return None
    ms = [s * 1000 for s in seconds]
    return Distribution(
        count=len(ms),
        mean_ms=statistics.fmean(ms),
        std_ms=statistics.pstdev(ms),
        p50_ms=quantile(ms, 0.5),
        p90_ms=quantile(ms, 0.9),
        p99_ms=quantile(ms, 0.99),
        max_ms=max(ms),
    )


class SLO(BaseModel):
    """Service-level objectives a request must meet to count as goodput (None: not judged)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    ttft_ms: float | None = Field(None, gt=0)
    tpot_ms: float | None = Field(None, gt=0)
    e2el_ms: float | None = Field(None, gt=0)

    def met(self, row: StreamRow) -> bool:
        tpot = tpot_s(row)
        return row.ok and all(
            limit is None or (value is not None and value * 1000 <= limit)
            for limit, value in ((self.ttft_ms, row.ttft_s), (self.tpot_ms, tpot), (self.e2el_ms, row.e2el_s))
        )


def tpot_s(row: StreamRow) -> float | None:
    if row.ttft_s is None or row.e2el_s is None or row.output_tokens < 2:
        return None
    return (row.e2el_s - row.ttft_s) / (row.output_tokens - 1)


class LagWindow(BaseModel):
    start_s: float
    p99_lag_ms: float


class Summary(BaseModel):
    requests: int
    ok: int
    errors: dict[str, int]
    duration_s: float
    request_throughput: float
    output_throughput: float
    ttft: Distribution | None
    tpot: Distribution | None
    itl: Distribution | None
    e2el: Distribution | None
    time_to_headers: Distribution | None
    stalls: int
    stall_s: float
    chunks_per_token: float | None
    goodput: float
    slo: SLO
    schedule_lag: Distribution | None
    lag_windows_flagged: list[LagWindow]
    per_replica: dict[str, int]
    per_path: dict[str, int]
    cached_prompt_tokens: int
    prompt_tokens: int


def summarize(
    rows: Sequence[StreamRow],
    slo: SLO | None = None,
    stall_s: float = 0.5,
    lag_flag_s: float = 0.05,
    open_loop: bool = False,
) -> Summary:
    slo = slo or SLO()
    ok = [r for r in rows if r.ok]
    start = min((r.sent_at for r in rows), default=0.0)
    end = max((r.sent_at + (r.e2el_s or 0.0) for r in rows), default=0.0)
    duration = max(end - start, 1e-9)
    errors: dict[str, int] = {}
    for row in rows:
        if not row.ok:
            key = f"{row.status} {row.reason or row.error}".strip()
            errors[key] = errors.get(key, 0) + 1
    gaps = [gap for r in ok for gap in r.gaps_s]
    tokens = sum(r.output_tokens for r in ok)
    chunks = sum(r.chunks for r in ok)
    lag_windows: list[LagWindow] = []
    if open_loop and rows:
        by_window: dict[int, list[float]] = {}
        for row in rows:
            by_window.setdefault(int((row.planned_at - start) // LAG_WINDOW_S), []).append(row.schedule_lag_s)
        for index, lags in sorted(by_window.items()):
            p99 = quantile(lags, 0.99)
            if p99 > lag_flag_s:
                lag_windows.append(LagWindow(start_s=index * LAG_WINDOW_S, p99_lag_ms=p99 * 1000))
    count: dict[str, dict[str, int]] = {"replica": {}, "path": {}}
    for row in ok:
        for key, value in (("replica", row.replica), ("path", row.path)):
            if value:
                count[key][value] = count[key].get(value, 0) + 1
    return Summary(
        requests=len(rows),
        ok=len(ok),
        errors=errors,
        duration_s=duration,
        request_throughput=len(ok) / duration,
        output_throughput=tokens / duration,
        ttft=distribution([r.ttft_s for r in ok if r.ttft_s is not None]),
        tpot=distribution([t for r in ok if (t := tpot_s(r)) is not None]),
        itl=distribution(gaps),
        e2el=distribution([r.e2el_s for r in ok if r.e2el_s is not None]),
        time_to_headers=distribution([r.headers_s for r in ok if r.headers_s is not None]),
        stalls=sum(gap > stall_s for gap in gaps),
        stall_s=stall_s,
        chunks_per_token=chunks / tokens if tokens else None,
        goodput=sum(slo.met(r) for r in rows) / duration,
        slo=slo,
        schedule_lag=distribution([r.schedule_lag_s for r in rows]) if open_loop else None,
        lag_windows_flagged=lag_windows,
        per_replica=count["replica"],
        per_path=count["path"],
        cached_prompt_tokens=sum(r.cached_tokens for r in ok),
        prompt_tokens=sum(r.prompt_tokens for r in ok),
    )
