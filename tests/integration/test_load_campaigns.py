"""Every campaign workload against a direct-streaming stack (HAProxy, a round-robin router) in front of the session's
two real vLLM replicas of the tiny model: the embedded default's shape, whose deploy path the deploy, own-cluster and
`sluice serve` tests cover. Locust in processes of its own: rows, summary and an HTML report whose plots are real
images."""

from __future__ import annotations

import csv
import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from matplotlib.image import imread

from loadtests.campaign import Campaign, run
from loadtests.workloads import LONG_PROMPT, OPEN_LOOP_WORKLOADS, SHORT_PROMPT, WORKLOADS
from routers.round_robin import NAME as ROUND_ROBIN
from sluice.bench.stack_harness import DirectStreamStack
from tests.support.llm_cluster import LLMCluster, direct_stack
from tests.support.vllm_keys import VLLM_SAVE_RESULT_KEYS

pytestmark = pytest.mark.integration

# Long enough for every workload to send several requests on both replicas (a multi-turn session at least two turns).
DURATION_S = 4.0


@pytest.fixture(scope="module")
def stack(llm_cluster: LLMCluster) -> Iterator[DirectStreamStack]:
    with direct_stack(llm_cluster, policy=ROUND_ROBIN) as started:
        yield started


@pytest.mark.parametrize("workload", WORKLOADS)
def test_each_workload_writes_rows_a_summary_and_a_report_with_real_plots(
    stack: DirectStreamStack, workload: str, tmp_path: Path, tiny_model_dir: Path
) -> None:
    campaign = Campaign(
        workload=workload,
        target=stack.url,
        out=tmp_path,
        tokenizer=tiny_model_dir / "tokenizer.json",
        duration_s=DURATION_S,
        users=4,
        rate=3 if workload in OPEN_LOOP_WORKLOADS else None,  # the others keep their closed loop
    )
    summary, breached = run(campaign)
    assert not breached and summary.ok >= 3 and summary.ok == summary.requests, summary.errors
    with (tmp_path / "rows.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == summary.requests
    assert set(summary.per_replica) == {row["replica"] for row in rows} and len(summary.per_replica) == 2
    prompts = {int(row["prompt_tokens"]) for row in rows}
    if workload == "short_long":
        assert prompts == {SHORT_PROMPT}  # exact in the served model's tokens
    if workload == "long_short":
        assert prompts == {LONG_PROMPT}
    if workload == "multi_turn":  # a session resends its conversation: its prompts grow
        sessions: dict[str, list[int]] = {}
        for row in rows:
            sessions.setdefault(row["session"], []).append(int(row["prompt_tokens"]))
        assert any(len(p) >= 2 and p == sorted(p) and p[0] < p[-1] for p in sessions.values())
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["summary"]["ttft"]["p50_ms"] > 0 and saved["summary"]["itl"]["count"] > 0
    # vLLM's result keys beside sluice's, with the same figures.
    assert VLLM_SAVE_RESULT_KEYS <= set(saved) and saved["completed"] == saved["summary"]["ok"]
    assert saved["median_ttft_ms"] == saved["summary"]["ttft"]["p50_ms"] and saved["model_id"] == "sluice-tiny"
    page = (tmp_path / "report.html").read_text()
    images = re.findall(r'<img src="([^"]+)"', page)
    assert len(images) >= 4
    for image in images:
        pixels = imread(tmp_path / image)
        assert pixels.shape[0] > 100 and pixels.shape[1] > 100 and pixels.std() > 0  # drawn, not blank
