"""The routing-semantics suite against the embedded default (its own name and ports): real vLLM replicas of the
tiny model, the suite deploying the variants and driving the scale changes, Locust for the multi-turn campaigns."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from sluice.bench.routing_suite import routing_suite
from tests.support.frontend_contract import register_frontend
from tests.support.ports import free_port

pytestmark = pytest.mark.integration

TEAMS = Path(__file__).resolve().parents[2] / "topologies" / "teams"


def test_the_routing_suite_measures_affinity_remapping_uniformity_buffers_fallbacks_and_prefix_cache_reuse(
    ray_cluster: None, tiny_model_dir: Path, tmp_path: Path
) -> None:
    data = yaml.safe_load((TEAMS / "local-cpu.yaml").read_text())
    port = free_port()
    data["name"] = "routing-suite"
    data["frontend"].update(port=port, metrics_port=free_port())
    spec = tmp_path / "stack.yaml"
    spec.write_text(yaml.safe_dump(data))
    register_frontend(port)
    figures = routing_suite(spec, tmp_path / "out", tiny_model_dir / "tokenizer.json", duration_s=15)
    print(json.dumps(figures, indent=2))
    assert figures["affinity"] >= 0.99
    assert 0.2 <= figures["remap_out_2_to_3"] <= 0.45
    assert sum(figures["headerless_per_replica"].values()) >= 600 and figures["headerless_cv"] <= 0.15
    rates = figures["prefix_cache_hit_rate"]
    assert rates["consistent_hash"] >= rates["round_robin"] + 0.15
    assert 0 < figures["prefix_cache_ideal_rate"]["consistent_hash"] <= 1
    assert figures["over_buffer"]["ok"] == figures["over_buffer"]["requests"] == 100
    assert figures["over_buffer"]["sessions_on_one_replica"] == 1.0
    assert {n: run["requests"] for n, run in figures["fallbacks"].items()} == {"2": 400, "0": 400}
    assert (tmp_path / "out" / "prefix_cache.png").stat().st_size > 0 and (tmp_path / "out" / "report.html").exists()
