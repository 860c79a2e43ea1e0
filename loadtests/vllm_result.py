"""A campaign's results under the keys `vllm bench serve --save-result` writes (without `--save-detailed`), so a
tool that reads vLLM's result JSON reads `sluice load`'s `summary.json` unchanged: its flat keys sit at the top level,
sluice's own (`campaign`, `summary`, `breached`) beside them.

What each key holds, where sluice's measure differs from vLLM's setup:
- `backend` is `sluice` (Locust users, not one of vLLM's request functions); `label` is None.
- `request_rate` is the open loop's rate, `"inf"` for closed-loop users, as vLLM writes an unlimited rate;
  `max_concurrency` is the closed loop's user count (None open loop), and with it come vLLM's `client_queue_time`
  figures.
- `queue_times` are 0 for closed-loop users (each sends when its previous request ends) and the schedule lag (actual
  minus planned send time) open loop, the nearest thing to vLLM's time waiting for its concurrency limit.
- `request_goodput` is None unless an SLO was given (`--slo-*-ms`), as vLLM leaves it without `--goodput`.
- Latency figures are vLLM's: mean, median, population std and p99 of TTFT, TPOT, ITL (every gap, pooled) and E2EL
  in ms, over the requests that succeeded; `latencies` are the E2EL seconds of those.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from loadtests.metrics import Distribution, Summary, distribution
from loadtests.sse_timing import StreamRow

# The latency figures, in vLLM's order and names.
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
BACKEND = "sluice"


def _latency_keys(name: str, found: Distribution | None) -> dict[str, float]:
    """vLLM's figures of one latency: mean, median, std and its default percentile, p99 (0 with no values, as
    vLLM's np.mean of nothing)."""
    mean, median, std, p99 = (found.mean_ms, found.p50_ms, found.std_ms, found.p99_ms) if found else (0.0,) * 4
    return {f"mean_{name}_ms": mean, f"median_{name}_ms": median, f"std_{name}_ms": std, f"p99_{name}_ms": p99}


def _max_concurrent(rows: Sequence[StreamRow]) -> int:
    """The most requests open at one moment (an end at the same instant as a start closes first)."""
    steps = sorted(step for r in rows if r.e2el_s is not None for step in ((r.sent_at, 1), (r.sent_at + r.e2el_s, -1)))
    now = peak = 0
    for _, step in steps:
        now += step
        peak = max(peak, now)
    return peak


def _max_output_tokens_per_s(rows: Sequence[StreamRow]) -> float:
    """The most output tokens received in one whole second of the campaign (vLLM's one-second buckets)."""
    start = min((r.sent_at for r in rows), default=0.0)
    buckets: dict[int, int] = {}
    for row in rows:
        if not row.ok or row.ttft_s is None:
            continue
        at = row.sent_at + row.ttft_s
        for gap in [0.0, *row.gaps_s]:
            at += gap
            second = int(at - start)
            buckets[second] = buckets.get(second, 0) + 1
    return float(max(buckets.values(), default=0))


def vllm_result(
    summary: Summary,
    rows: Sequence[StreamRow],
    model: str,
    tokenizer: str,
    request_rate: float | None,
    burstiness: float,
    max_concurrency: int | None,
    slo_given: bool,
) -> dict[str, Any]:
    """The campaign under `vllm bench serve --save-result`'s keys (see the module docstring); `request_rate` None
    for a closed loop."""
    ok = [r for r in rows if r.ok]
    output_tokens = sum(r.output_tokens for r in ok)
    input_tokens = sum(r.prompt_tokens for r in ok)
    closed_loop = request_rate is None
    result: dict[str, Any] = {
        "date": time.strftime("%Y%m%d-%H%M%S"),
        "endpoint_type": BACKEND,
        "backend": BACKEND,
        "label": None,
        "model_id": model,
        "tokenizer_id": tokenizer,
        "num_prompts": summary.requests,
        "request_rate": "inf" if closed_loop else request_rate,
        "burstiness": burstiness,
        "max_concurrency": max_concurrency,
        "duration": summary.duration_s,
        "completed": summary.ok,
        "failed": summary.requests - summary.ok,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": summary.request_throughput,
        "request_goodput": summary.goodput if slo_given else None,
        "output_throughput": summary.output_throughput,
        "total_token_throughput": (input_tokens + output_tokens) / summary.duration_s,
        "latencies": [r.e2el_s for r in ok if r.e2el_s is not None],
        "queue_times": [0.0 if closed_loop else r.schedule_lag_s for r in ok],
        "max_output_tokens_per_s": _max_output_tokens_per_s(rows),
        "max_concurrent_requests": _max_concurrent(ok),
    }
    for name in LATENCY_METRICS:
        result |= _latency_keys(name, getattr(summary, name))
    if max_concurrency is not None:
        # vLLM adds the time requests waited for the concurrency limit when one was set.
        result |= _latency_keys("client_queue_time", distribution(result["queue_times"]))
    return result
