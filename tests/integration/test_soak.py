"""The soak's five-minute version (`make soak` runs 30): the mixed campaign with leaving clients, a replica killed and
a scale 2 -> 3 -> 2 on a real stack; the invariants, not the figures: no ledger token left once the load is over,
HAProxy's servers the live replicas, every non-2xx with its reason, no request without a response but those in flight
at the killed replica."""

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
SOAK_S = 300


def test_five_minutes_of_mixed_load_kills_and_scaling_leave_no_token_and_no_stale_server(
    ray_cluster: None, tiny_model_dir: Path, tmp_path: Path
) -> None:
    data = yaml.safe_load((TEAMS / "local-cpu.yaml").read_text())
    port = free_port()
    data["name"] = "soak"
    data["frontend"].update(port=port, metrics_port=free_port())
    spec = tmp_path / "stack.yaml"
    spec.write_text(yaml.safe_dump(data))
    register_frontend(port)
    figures = soak(spec, tmp_path / "out", tiny_model_dir / "tokenizer.json", SOAK_S)
    print(json.dumps(figures, indent=2))
    assert not broken_invariants(figures), figures
    assert figures["requests"] > 100 and figures["clients_left"] > 100, figures
    assert [event["action"].split()[0] for event in figures["events"]] == ["killed", "scale", "scale"]
    assert {"haproxy"} < set(figures["rss_mb"]) and any(name.startswith("router:") for name in figures["rss_mb"])
