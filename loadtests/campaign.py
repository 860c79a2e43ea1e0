"""`sluice load WORKLOAD --target URL`: one campaign, Locust in processes of its own, then the rows, the summary,
the report and the gates.

Locust runs headless as one process, as a master and `workers` workers on 127.0.0.1, or as a master that waits for
`master.expect_workers` workers started elsewhere (`sluice load-worker`); an open-loop rate is split evenly between
the workers, and the master sends them the campaign's settings. A breached gate (`GATES`, from the command line or
the spec's `ingress.abort`) names its value and limit and exits 1. Details: loadtests/README.md.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Annotated

import httpx
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    field_serializer,
    field_validator,
    model_validator,
)

from base.runtime import LOOPBACK, free_port
from loadtests.lengths import Lengths
from loadtests.metrics import SLO, Summary, summarize
from loadtests.report import GateVerdict, write_report
from loadtests.sse_timing import StreamRow, write_rows
from loadtests.vllm_result import vllm_result
from loadtests.workloads import WORKLOADS, arrival_rate

LOCUSTFILE = Path(__file__).with_name("locustfile.py")
GATES = ("ttft_p99_ms", "tpot_p99_ms", "itl_p99_ms", "e2el_p99_ms", "error_ratio", "ratio_503", "min_goodput")
# Locust's own outputs in the campaign's folder: `locust_stats.csv` (and its siblings) and its HTML report.
LOCUST_CSV_PREFIX = "locust"
LOCUST_HTML = "locust.html"
# Seconds Locust may take beyond the run time to stop its users and write its rows.
STOP_TIMEOUT_S = 30
# Locust's own default port for a master's workers.
LOCUST_MASTER_PORT = 5557
# What a campaign's summary and report say of a header's value: an API key is no figure to keep in a report.
HIDDEN_HEADER_VALUE = "(set)"


class RemoteMaster(BaseModel):
    """A master for workers on other machines: where it listens and how many it waits for, and how long."""

    model_config = ConfigDict(extra="forbid")

    bind_host: str = "127.0.0.1"
    port: int = Field(LOCUST_MASTER_PORT, ge=1, le=65535)
    expect_workers: int = Field(1, ge=1)
    wait_s: float = Field(60.0, gt=0, le=3600)


# The longest campaign: a day, so a soak of hours runs and a mistyped duration cannot load a stack for ever.
MAX_DURATION_S = 86_400.0
LoadSeconds = Annotated[float, Field(gt=0, le=MAX_DURATION_S)]


def load_seconds(text: str) -> float:
    """A campaign's length from the command line, checked as `Campaign.duration_s` is; ValueError says why not."""
    try:
        return TypeAdapter(LoadSeconds).validate_python(text)
    except ValidationError as error:
        raise ValueError(f"{text!r}: {error.errors()[0]['msg']}") from None


class Campaign(BaseModel):
    model_config = ConfigDict(extra="forbid")

    workload: str
    target: str
    out: Path
    tokenizer: Path
    duration_s: LoadSeconds = 60.0
    users: int = Field(8, ge=1)
    # Requests per second, opening the loop of any workload; None: the workload's own loop (`arrival_rate`).
    rate: float | None = Field(None, gt=0, allow_inf_nan=False)
    burstiness: float = Field(1.0, gt=0)
    workers: int = Field(0, ge=0)
    master: RemoteMaster | None = None
    model: str | None = None
    session_header: str = "x-session-id"
    slo: SLO = SLO()
    gates: dict[str, float] = Field(default_factory=dict)
    seed: int = 0
    # Headers every request carries (`--api-key`, `--header`); written out by name only, never their values.
    headers: dict[str, str] = Field(default_factory=dict)
    lengths: Lengths = Lengths()
    # Prompts from a file (`loadtests.dataset`); a remote worker reads it at the same path on its machine.
    dataset: Path | None = None

    @field_validator("workload")
    @classmethod
    def _known_workload(cls, workload: str) -> str:
        if workload not in WORKLOADS:
            raise ValueError(f"unknown workload {workload!r}: one of {', '.join(WORKLOADS)}")
        return workload

    @field_validator("gates")
    @classmethod
    def _known_gates(cls, gates: dict[str, float]) -> dict[str, float]:
        """Checked before any load is sent: a campaign is not run to find its gate misspelt."""
        unknown = sorted(set(gates) - set(GATES))
        if unknown:
            raise ValueError(f"unknown gate {', '.join(map(repr, unknown))}: one of {', '.join(GATES)}")
        return gates

    @model_validator(mode="after")
    def _one_kind_of_workers(self) -> Campaign:
        if self.workers and self.master is not None:
            raise ValueError("local workers (--workers) and a master for remote ones (--master) exclude each other")
        return self

    @field_serializer("headers")
    def _header_names(self, headers: dict[str, str]) -> dict[str, str]:
        return dict.fromkeys(headers, HIDDEN_HEADER_VALUE)

    @property
    def worker_count(self) -> int:
        return self.master.expect_workers if self.master is not None else self.workers

    @property
    def arrival_rate(self) -> float | None:
        """Requests per second of an open loop; None for a closed one."""
        return arrival_rate(self.workload, self.rate)


def gates_from_spec(path: Path) -> dict[str, float]:
    """The abort criteria of a stack's spec as gates."""
    from builders.specs import load_spec

    abort = load_spec(path).ingress.abort
    return {"ratio_503": abort.max_503_ratio, "ttft_p99_ms": abort.max_ttft_p99_s * 1000}


def measured(summary: Summary, gate: str) -> float:
    distributions = {"ttft": summary.ttft, "tpot": summary.tpot, "itl": summary.itl, "e2el": summary.e2el}
    if gate.endswith("_p99_ms"):
        found = distributions[gate.removesuffix("_p99_ms")]
        return found.p99_ms if found is not None else float("inf")
    if gate == "error_ratio":
        return (summary.requests - summary.ok) / summary.requests if summary.requests else 1.0
    if gate == "ratio_503":
        count = sum(n for key, n in summary.errors.items() if key.startswith("503"))
        return count / summary.requests if summary.requests else 0.0
    return summary.goodput


def gate_verdicts(summary: Summary, gates: dict[str, float]) -> list[GateVerdict]:
    """Each gate, by name, with what was measured against its limit."""
    verdicts = []
    for gate, limit in sorted(gates.items()):
        value = measured(summary, gate)
        held = value >= limit if gate == "min_goodput" else value <= limit
        verdicts.append(GateVerdict(name=gate, measured=value, limit=limit, held=held))
    return verdicts


def breaches(verdicts: list[GateVerdict]) -> list[str]:
    """Each breached gate as `name: measured V, limit L`."""
    return [f"{v.name}: measured {v.measured:.4g}, limit {v.limit:.4g}" for v in verdicts if not v.held]


def _served_model(campaign: Campaign) -> str:
    models = httpx.get(f"{campaign.target}/v1/models", timeout=30, headers=campaign.headers)
    return models.json()["data"][0]["id"]


def locust_env(campaign: Campaign) -> dict[str, str]:
    """The environment of the campaign's Locust processes: the headers go there, not on their command lines."""
    return {**os.environ, "SLUICE_LOAD_HEADERS": json.dumps(campaign.headers)}


def locust_options(campaign: Campaign, rows_dir: Path) -> list[str]:
    """The campaign's settings as the locustfile's options (a master sends them to its workers)."""
    rate = campaign.arrival_rate
    settings = {
        "workload": campaign.workload,
        "model": campaign.model,
        "tokenizer": campaign.tokenizer,
        "rows_dir": rows_dir,
        "rate": "" if rate is None else rate / max(campaign.worker_count, 1),
        "burstiness": campaign.burstiness,
        "duration_s": campaign.duration_s,
        "session_header": campaign.session_header,
        "seed": campaign.seed,
        "lengths": campaign.lengths.model_dump_json(),
        "dataset": campaign.dataset or "",
    }
    # `=`: an empty session header is a value, not a missing one.
    return [f"--sluice-{name.replace('_', '-')}={value}" for name, value in settings.items()]


def run_locust(campaign: Campaign, rows_dir: Path) -> list[StreamRow]:
    """Run Locust (one process, a master and its local workers, or a master for remote ones) and merge the rows
    every process wrote; `campaign` names its model."""
    rows_dir.mkdir(parents=True, exist_ok=True)
    for stale in rows_dir.glob("rows-*.csv"):
        stale.unlink()
    locust = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "--host", campaign.target]
    run = [
        *locust_options(campaign, rows_dir),
        "--users",
        str(campaign.users),
        "--spawn-rate",
        str(campaign.users),
        "--stop-timeout",
        str(STOP_TIMEOUT_S),
        # Locust's own statistics and report, beside sluice's (the master writes them under workers).
        "--csv",
        str(campaign.out / LOCUST_CSV_PREFIX),
        "--html",
        str(campaign.out / LOCUST_HTML),
    ]
    timeout = campaign.duration_s + 2 * STOP_TIMEOUT_S + 60
    env = locust_env(campaign)
    if not campaign.worker_count:
        subprocess.run(
            [*locust, *run, "--run-time", f"{campaign.duration_s:g}s"], timeout=timeout, check=False, env=env
        )
        return _rows(rows_dir)
    # A master ends the run itself (the locustfile): it waits for every worker's rows, which --run-time would not.
    master = campaign.master or RemoteMaster(port=free_port(LOOPBACK), expect_workers=campaign.workers, wait_s=60)
    listen = ["--master-bind-host", master.bind_host, "--master-bind-port", str(master.port)]
    wait = ["--expect-workers", str(master.expect_workers), "--expect-workers-max-wait", f"{master.wait_s:g}"]
    processes = [subprocess.Popen([*locust, *run, "--master", *listen, *wait], env=env)]
    if campaign.master is None:
        worker = [*locust, "--worker", "--master-host", master.bind_host, "--master-port", str(master.port)]
        processes += [subprocess.Popen(worker, env=env) for _ in range(campaign.workers)]
    try:
        processes[0].wait(timeout=master.wait_s + timeout)
        for process in processes[1:]:
            process.wait(timeout=STOP_TIMEOUT_S)
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    return _rows(rows_dir)


def _rows(rows_dir: Path) -> list[StreamRow]:
    rows = []
    for path in sorted(rows_dir.glob("rows-*.csv")):
        with path.open() as handle:
            rows += [StreamRow.from_csv(row) for row in csv.DictReader(handle)]
    return rows


def run(campaign: Campaign) -> tuple[Summary, list[str]]:
    """The campaign, its files in `campaign.out`; (summary, breached gates)."""
    if campaign.model is None:
        campaign = campaign.model_copy(update={"model": _served_model(campaign)})
    campaign.out.mkdir(parents=True, exist_ok=True)
    rows = run_locust(campaign, campaign.out / "rows")
    rows.sort(key=lambda r: r.sent_at)
    write_rows(campaign.out / "rows.csv", rows)
    open_loop = campaign.arrival_rate is not None
    summary = summarize(rows, campaign.slo, open_loop=open_loop)
    verdicts = gate_verdicts(summary, campaign.gates)
    breached = breaches(verdicts)
    vllm_keys = vllm_result(
        summary,
        rows,
        model=str(campaign.model),
        tokenizer=str(campaign.tokenizer),
        request_rate=campaign.arrival_rate,
        burstiness=campaign.burstiness,
        max_concurrency=None if open_loop else campaign.users,
        slo_given=campaign.slo != SLO(),
    )
    own = {
        "campaign": campaign.model_dump(mode="json"),
        "summary": summary.model_dump(),
        "gates": [verdict.model_dump() for verdict in verdicts],
        "breached": breached,
    }
    payload = vllm_keys | own
    (campaign.out / "summary.json").write_text(json.dumps(payload, indent=2))
    title = f"sluice load {campaign.workload} -> {campaign.target}"
    write_report(title, summary, rows, campaign.out, settings=own["campaign"], gates=verdicts)
    return summary, breached
