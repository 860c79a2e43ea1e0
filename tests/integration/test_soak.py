"""The soak's 90-second version (`make soak` runs 30 minutes): the mixed campaign with leaving clients, a replica
killed and a scale 2 -> 3 -> 2 on a real stack; the invariants, not the figures: no ledger token left once the load is
over, HAProxy's servers the live replicas, every non-2xx with its reason, no request without a response but those in
flight at the killed replica."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from sluice.bench.soak import broken_invariants, soak
from tests.support.frontend_contract import register_frontend
from tests.support.ports import free_port

pytestmark = pytest.mark.integration

TEAMS = Path(__file__).resolve().parents[2] / "topologies" / "teams"
# Long enough for every disturbance to land: the kill at 22 s; the scale to 3, asked at 40 s, done once the killed
# replica's replacement and the third replica run (78 s in a CI-like run); then back to 2. What only minutes show is
# `make soak`'s.
SOAK_S = 90
# Requests and leaving clients per second of soak at least: what the 5-minute version asked (100 in 300 s). Measured
# in 90 s (2026-12-06): 516 requests and 170 clients that left.
MIN_PER_S = 0.33


def test_mixed_load_kills_and_scaling_leave_no_token_and_no_stale_server(
    ray_cluster: None, tiny_model_dir: Path, tmp_path: Path
) -> None:
    data = yaml.safe_load((TEAMS / "local-cpu.yaml").read_text())
    port = free_port()
    data["name"] = "soak"
    data["frontend"].update(port=port, metrics_port=free_port())
    spec = tmp_path / "stack.yaml"
    spec.write_text(yaml.safe_dump(data))
    register_frontend(port)
    figures = soak(spec, tmp_path / "out", tiny_model_dir / "tokenizer.json", SOAK_S, wait_for_delete=False)
    print(json.dumps(figures, indent=2))
    assert not broken_invariants(figures), figures
    least = MIN_PER_S * SOAK_S
    assert figures["requests"] > least and figures["clients_left"] > least, figures
    assert [event["action"].split()[0] for event in figures["events"]] == ["killed", "scale", "scale"]
    assert {"haproxy"} < set(figures["rss_mb"]) and any(name.startswith("router:") for name in figures["rss_mb"])
    assert any(name.startswith("frontend:") for name in figures["rss_mb"]) and figures["rss_mb"]["haproxy"]["warm"]
