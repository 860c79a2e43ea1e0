"""`sluice bench policies` end to end on a few simulated replicas (the stand-in engine, no Ray): each row measured
through sluice's HAProxy, router and KV subscriber with no failed request; kv_aware keeps a conversation where its
prefix is; the shadows' predictions stand beside what the engines counted and what each policy measured live."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sluice.bench.policies import run_policy_bench

pytestmark = pytest.mark.integration

# Within what the issue asks of a prediction: 0.05 of what the engines (or the policy, live) counted.
PREDICTION_TOLERANCE = 0.05


def test_the_policy_bench_measures_every_row_and_the_shadows_predict_what_the_engines_count(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    # The shadow runs alone: consistent_hash live on its own, then kv_aware with it as its shadow (two stacks of four
    # simulated replicas: about 30 s).
    result = run_policy_bench(
        tiny_model_dir,
        tmp_path,
        replica_counts=(4,),
        workloads=("multi_turn",),
        policies=(),
        shadow_replicas=4,
        shadow_policies=("consistent_hash",),
    )
    assert json.loads((tmp_path / "policies.json").read_text()) == result
    rows = {row["policy"]: row for row in result["shadow_rows"]}
    assert set(rows) == {"consistent_hash", "kv_aware"} and result["rows"] == []
    for row in rows.values():
        assert row["non_2xx"] == 0 and row["requests"] == 120 and row["ttft_p90_ms"] > 0
        assert row["hit_rate"] <= row["ideal_hit_rate"] + 0.01, row
    kv_aware = rows["kv_aware"]
    assert kv_aware["hit_rate"] >= 0.8 * kv_aware["ideal_hit_rate"] and kv_aware["decision_p99_ms"] > 0, kv_aware
    (shadow,) = result["shadow"]
    assert shadow["workload"] == "multi_turn"
    live = shadow["live_predicted_hit"]["kv_aware"]
    assert abs(live - shadow["live_engine_hit"]["kv_aware"]) <= PREDICTION_TOLERANCE, shadow
    predicted, measured = shadow["shadow_predicted_hit"], shadow["measured_live_hit"]
    assert abs(predicted["consistent_hash"] - measured["consistent_hash"]) <= PREDICTION_TOLERANCE, shadow
