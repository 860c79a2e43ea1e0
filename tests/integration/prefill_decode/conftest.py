"""One prefill/decode stack for both modules of this package: prefill-decode-cpu.yaml (own name and ports) with the
retained legacy ingress (`ingress.mode: both`) and staging on, so `sluice check` runs every item. The legacy path's
module runs first and leaves the weight on the legacy path; the transfer module moves it back to the direct path and
kills the prefill replica last."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.team_stack import TeamStack, team_stack

# The canary's criteria as canary-cpu.yaml sets them: the tests move the weight themselves.
INGRESS = {
    "mode": "both",
    "canary_weight": 50,
    "drain_deadline_s": 60,
    "abort": {"max_ttft_p99_s": 10, "max_replica_imbalance": 4, "min_requests": 10, "window_s": 10},
}


@pytest.fixture(scope="package")
def pd_stack(ray_cluster: None, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TeamStack]:
    folder = tmp_path_factory.mktemp("prefill-decode")
    with team_stack("prefill-decode-cpu.yaml", "pd-test", folder, staging=True, ingress=INGRESS) as deployed:
        yield deployed
