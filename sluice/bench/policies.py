"""`sluice bench policies`: every routing policy on every workload at 8, 32 and 64 replicas of the simulator engine,
through sluice's own HAProxy, router and KV event subscriber (`sim_stack.py`), one fresh stack per row.

The replicas are the simulator (`services/replica/sim/`, a stand-in: no model runs; its timing model is stated in
`SimModel`), because policies barely differ on 3 replicas of the tiny model and 64 real engines do not fit on one
machine; the tokenizer and chat template are the tiny model's, so prompts are rendered and cut into blocks as vLLM
would. capacity_queue is not run: its tokens are released by the replicas' middleware to the ledger actor, which the
simulator's replicas do not have. Seeds are fixed: the same command sends the same requests.

Output: a table on stdout and `policies.json` in `--out` with `rows` (`policy_runs.PolicyRow`) and, with kv_aware
live at `SHADOW_REPLICAS` replicas on each workload, `shadow`: what each policy was predicted to hit beside what
the engines counted and what that policy measured live on its own row (those rows: `shadow_rows`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from base.tiny_model import SERVED_MODEL_NAME
from loadtests.workloads import PromptMaker
from routers.prompt_tokens import PromptTokens
from services.replica.sim.model import SimModel
from services.replica.sim.openai_app import ANSWER_WORDS
from services.router.settings import RouterSettings
from sluice.bench.policy_runs import PolicyRow, run_once
from sluice.bench.policy_workloads import (
    ANSWER_TOKENS,
    BENCH_POLICIES,
    DEFAULT_REPLICAS,
    POLICY_WORKLOADS,
    WorkloadPlan,
    plan_workload,
)
from sluice.bench.sim_stack import APP, SimPolicyStack

SHADOW_REPLICAS = 16
SHADOW_POLICIES = ("round_robin", "consistent_hash")
SEED = 20261207
# A run's bound beyond its plan: the plan ends first on every workload here (about 10-20 s at 64 replicas).
RUN_MAX_S = 180.0


def router_settings(policy: str, model_path: str, shadows: tuple[str, ...] = ()) -> RouterSettings:
    return RouterSettings(
        target_app=APP,
        policy=policy,
        model_path=model_path,
        target_capacity=SimModel().max_num_seqs,
        shadow_policies=list(shadows),
    )


def _table(rows: list[PolicyRow]) -> str:
    header = (
        f"{'replicas':>8} {'workload':<14}{'policy':<16}{'hit':>6}{'ideal':>7}{'TTFT p50':>10}{'p90 ms':>8}"
        f"{'max/mean':>9}{'dec p99 ms':>11}{'non-2xx':>8}"
    )
    lines = [header]
    for row in rows:
        lines.append(
            f"{row.replicas:>8} {row.workload:<14}{row.policy:<16}{row.hit_rate:>6.3f}{row.ideal_hit_rate:>7.3f}"
            f"{row.ttft_p50_ms:>10.1f}{row.ttft_p90_ms:>8.1f}{row.max_mean_load:>9.2f}{row.decision_p99_ms:>11.3f}"
            f"{row.non_2xx:>8}"
        )
    return "\n".join(lines)


class PolicyBench:
    def __init__(self, model_path: Path, out: Path) -> None:
        self.model_path = str(model_path)
        self.out = out
        self.maker = PromptMaker(model_path / "tokenizer.json", SEED)
        self.tokens = PromptTokens(self.model_path)
        self.answer_ids = self.tokens.text_tokens(ANSWER_WORDS[0]) * ANSWER_TOKENS
        self.block_size = SimModel().block_size
        self._plans: dict[tuple[str, int], WorkloadPlan] = {}

    def plan(self, workload: str, replicas: int) -> WorkloadPlan:
        key = (workload, replicas)
        if key not in self._plans:
            self._plans[key] = plan_workload(workload, replicas, self.maker, SERVED_MODEL_NAME, ANSWER_WORDS[0], SEED)
        return self._plans[key]

    def row(self, replicas: int, workload: str, policy: str, shadows: tuple[str, ...] = ()) -> tuple[PolicyRow, Any]:
        """One row, and the router's shadow report when it ran shadows."""
        workdir = self.out / "haproxy"
        stack = SimPolicyStack(
            replicas, router_settings(policy, self.model_path, shadows), self.model_path, SERVED_MODEL_NAME, workdir
        ).start()
        try:
            row = run_once(
                stack, self.plan(workload, replicas), self.tokens, self.answer_ids, self.block_size, RUN_MAX_S
            )
            report = stack.shadow_report() if shadows else None
        finally:
            stack.stop()
        print(_table([row]).splitlines()[1], flush=True)
        return row, report


def run_policy_bench(
    model_path: Path,
    out: Path,
    replica_counts: tuple[int, ...] = DEFAULT_REPLICAS,
    workloads: tuple[str, ...] = POLICY_WORKLOADS,
    policies: tuple[str, ...] = BENCH_POLICIES,
    shadow: bool = True,
    shadow_replicas: int = SHADOW_REPLICAS,
    shadow_policies: tuple[str, ...] = SHADOW_POLICIES,
) -> dict[str, Any]:
    """Every row, then the shadow runs (`shadow_policies` at `shadow_replicas`); writes `policies.json` into `out`
    and returns it."""
    out.mkdir(parents=True, exist_ok=True)
    bench = PolicyBench(model_path, out)
    print(_table([]), flush=True)
    rows = [
        bench.row(count, workload, policy)[0]
        for count in replica_counts
        for workload in workloads
        for policy in policies
    ]
    shadows, shadow_rows = [], []
    if shadow:
        for workload in workloads:
            live_rows = {policy: bench.row(shadow_replicas, workload, policy)[0] for policy in shadow_policies}
            row, report = bench.row(shadow_replicas, workload, "kv_aware", shadow_policies)
            live_rows["kv_aware"] = row
            shadows.append(shadow_entry(workload, report, live_rows))
            shadow_rows += [row.as_json() for row in live_rows.values()]
    result = {"rows": [row.as_json() for row in rows], "shadow": shadows, "shadow_rows": shadow_rows}
    (out / "policies.json").write_text(json.dumps(result, indent=2) + "\n")
    print(_table(rows))
    return result


def shadow_entry(workload: str, report: dict[str, Any], live_rows: dict[str, PolicyRow]) -> dict[str, Any]:
    """One workload's shadow comparison: the live policy's predicted and engine-counted hits, each shadow's predicted
    hit, and each policy's hit measured live on its own row."""
    return {
        "workload": workload,
        "live_predicted_hit": {report["live"]: report["predicted_hit"][report["live"]]},
        "live_engine_hit": {report["live"]: live_rows[report["live"]].hit_rate},
        "shadow_predicted_hit": {name: report["predicted_hit"][name] for name in report["shadows"]},
        "measured_live_hit": {name: row.hit_rate for name, row in live_rows.items()},
    }
