"""`summary.json` carries the keys `vllm bench serve --save-result` writes (tests/support/vllm_keys.py), with vLLM's
definitions of the figures."""

from __future__ import annotations

import numpy as np
import pytest

from loadtests.metrics import SLO, summarize
from loadtests.sse_timing import StreamRow
from loadtests.vllm_result import vllm_result
from tests.support.vllm_keys import CLIENT_QUEUE_KEYS, VLLM_SAVE_RESULT_KEYS


def _rows() -> list[StreamRow]:
    rows = []
    for i in range(20):
        ok = i != 7
        rows.append(
            StreamRow(
                workload="mixed",
                session=f"s{i}",
                planned_at=i * 0.1,
                sent_at=i * 0.1 + 0.01 * (i % 3),
                status=200 if ok else 503,
                ttft_s=0.05 + 0.01 * i if ok else None,
                e2el_s=0.5 + 0.02 * i if ok else None,
                gaps_s=[0.01 * (1 + i % 4)] * 9 if ok else [],
                output_tokens=10 if ok else 0,
                prompt_tokens=100 + i,
            )
        )
    return rows


@pytest.mark.parametrize("closed_loop", [True, False], ids=["closed-loop", "open-loop"])
def test_the_keys_are_vllms_and_the_figures_its_definitions(closed_loop: bool) -> None:
    rows = _rows()
    summary = summarize(rows, SLO(), open_loop=not closed_loop)
    result = vllm_result(
        summary,
        rows,
        model="sluice-tiny",
        tokenizer="tokenizer.json",
        request_rate=None if closed_loop else 10.0,
        burstiness=1.0,
        max_concurrency=8 if closed_loop else None,
        slo_given=False,
    )
    assert set(result) == VLLM_SAVE_RESULT_KEYS | (CLIENT_QUEUE_KEYS if closed_loop else set())
    assert (result["completed"], result["failed"], result["num_prompts"]) == (19, 1, 20)
    assert result["request_rate"] == ("inf" if closed_loop else 10.0) and result["request_goodput"] is None
    ttfts = [r.ttft_s * 1000 for r in rows if r.ttft_s is not None]
    assert result["mean_ttft_ms"] == pytest.approx(np.mean(ttfts))
    assert result["median_ttft_ms"] == pytest.approx(np.median(ttfts))
    assert result["std_ttft_ms"] == pytest.approx(np.std(ttfts))
    assert result["p99_ttft_ms"] == pytest.approx(np.percentile(ttfts, 99))
    assert result["total_output_tokens"] == 190 and result["total_input_tokens"] == sum(
        r.prompt_tokens for r in rows if r.ok
    )
    # The most requests open at any request's start, counted one by one.
    spans = [(r.sent_at, r.sent_at + r.e2el_s) for r in rows if r.e2el_s is not None]
    assert result["max_concurrent_requests"] == max(sum(a <= t < b for a, b in spans) for t, _ in spans)
    assert result["max_output_tokens_per_s"] > 0 and len(result["latencies"]) == 19
