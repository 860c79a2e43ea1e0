"""`sluice load` (a Locust campaign, or the routing suite) and `sluice replay` (recorded requests against a path)."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

from base.runtime import default_model_dir
from loadtests.campaign import LOCUST_MASTER_PORT
from loadtests.workloads import WORKLOADS
from sluice.cli.request_headers import add_header_options, request_headers
from sluice.deploy.errors import Unreachable, UsageError, require_url, served_models
from sluice.deploy.exit_codes import EXIT_FAILED, EXIT_INCOMPLETE, EXIT_OK
from topologies import EMBEDDED_SPEC

# `sluice load compare A B`: not a workload, two runs to set side by side (`loadtests.compare`).
COMPARE = "compare"


def _gates(args: argparse.Namespace) -> dict[str, float]:
    """The spec's abort criteria and each `--gate NAME=LIMIT` (names are checked with the campaign)."""
    from loadtests.campaign import gates_from_spec
    from topologies.problems import SpecError

    try:
        gates = gates_from_spec(Path(args.spec)) if args.spec else {}
    except (OSError, SpecError) as error:
        raise UsageError(f"--spec {args.spec}: {error}") from None
    for gate in args.gate:
        name, _, value = gate.partition("=")
        try:
            gates[name] = float(value)
        except ValueError:
            raise UsageError(f"--gate {gate!r}: give NAME=LIMIT, e.g. ttft_p99_ms=500") from None
    return gates


def _slo_limits(args: argparse.Namespace) -> dict[str, float | None]:
    """The goodput SLOs from `--slo-*-ms` and vLLM's `--goodput NAME:MS ...` (a name given both ways is refused)."""
    limits = {"ttft_ms": args.slo_ttft_ms, "tpot_ms": args.slo_tpot_ms, "e2el_ms": args.slo_e2el_ms}
    for pair in args.goodput:
        name, _, value = pair.partition(":")
        key = f"{name}_ms"
        if key not in limits:
            raise UsageError(f"--goodput {pair!r}: the name is one of ttft, tpot, e2el")
        if limits[key] is not None:
            raise UsageError(f"--goodput {pair!r}: {name} is also set by --slo-{name}-ms")
        try:
            limits[key] = float(value)
        except ValueError:
            raise UsageError(f"--goodput {pair!r}: give NAME:MS, e.g. ttft:200") from None
    return limits


def _rates(args: argparse.Namespace) -> list[float]:
    """`--rate`: none (each workload's own loop), one rate, or a sweep's rates."""
    from loadtests.sweep import parse_rates

    if args.rate is None:
        return []
    try:
        return parse_rates(args.rate)
    except ValueError as error:
        raise UsageError(str(error)) from None


def _campaign(args: argparse.Namespace) -> Any:
    """The campaign the arguments describe, every value checked before any load is sent."""
    from pydantic import ValidationError

    from loadtests.campaign import Campaign
    from loadtests.dataset import DatasetError, read_dataset
    from loadtests.metrics import SLO

    if not args.target:
        raise UsageError("--target is required for a workload campaign")
    target = require_url("--target", args.target)
    rates = _rates(args)
    if args.dataset:
        try:
            read_dataset(Path(args.dataset))
        except DatasetError as error:
            raise UsageError(str(error)) from None
    try:
        return Campaign(
            workload=args.workload,
            target=target,
            out=Path(args.out or f"load-{args.workload}"),
            tokenizer=Path(args.tokenizer or default_model_dir() / "tokenizer.json"),
            duration_s=args.duration,
            users=args.users,
            rate=rates[0] if rates else None,
            burstiness=args.burstiness,
            workers=args.workers,
            master={
                "bind_host": args.master_bind_host,
                "port": args.master_port,
                "expect_workers": args.expect_workers,
                "wait_s": args.expect_workers_max_wait,
            }
            if args.master
            else None,
            model=args.model,
            slo=SLO(**_slo_limits(args)),
            gates=_gates(args),
            headers=request_headers(args),
            lengths={"input_len": args.input_len, "output_len": args.output_len, "range_ratio": args.range_ratio},
            dataset=Path(args.dataset).resolve() if args.dataset else None,
        )
    except ValidationError as error:
        problems = "; ".join(
            ": ".join(filter(None, (".".join(map(str, e["loc"])), e["msg"].removeprefix("Value error, "))))
            for e in error.errors()
        )
        raise UsageError(problems) from None


def _load(args: argparse.Namespace) -> int:
    """`sluice load WORKLOAD --target URL`: a Locust campaign, or a sweep of them (`--rate 2,4`); exit 1 when a gate
    is breached."""
    from loadtests.campaign import run
    from loadtests.sweep import run_sweep

    if args.workload == COMPARE:
        return _compare(args)
    if args.runs:
        raise UsageError(f"unexpected {' '.join(args.runs)!r}: only `sluice load compare A B` takes runs")
    if args.workload == "routing":
        return _routing_suite(args)
    from loadtests.tokenizer_source import TokenizerError, checked_tokenizer

    campaign = _campaign(args)
    models = served_models(campaign.target, headers=campaign.headers)
    if campaign.model is None:
        if not models:
            raise Unreachable(f"the target {campaign.target} serves no model")
        campaign = campaign.model_copy(update={"model": models[0]})
    try:  # the last check before any load: the prompts' tokenizer
        campaign = campaign.model_copy(update={"tokenizer": checked_tokenizer(str(campaign.tokenizer))})
    except TokenizerError as error:
        raise UsageError(str(error)) from None
    rates = _rates(args)
    if len(rates) > 1:
        steps, breached = run_sweep(campaign, rates)
        ok = ", ".join(f"{step['rate']:g}/s: {step['completed']} ok, {step['failed']} failed" for step in steps)
        print(f"{ok}; each step's folder, and the sweep's summary.json and report.html, in {campaign.out}")
    else:
        summary, breached = run(campaign)
        print(f"{summary.ok}/{summary.requests} requests ok; rows, summary.json and report.html in {campaign.out}")
    for breach in breached:
        print(f"gate breached: {breach}", file=sys.stderr)
    return EXIT_FAILED if breached else EXIT_OK


def _compare(args: argparse.Namespace) -> int:
    """`sluice load compare A B`: two runs' summaries side by side, B over A."""
    from loadtests.compare import CompareError, comparison_lines, read_summary

    if len(args.runs) != 2:
        raise UsageError("sluice load compare takes two runs: their folders (or summary.json files)")
    try:
        first, second = (read_summary(Path(run)) for run in args.runs)
    except CompareError as error:
        raise UsageError(str(error)) from None
    print("\n".join(comparison_lines(*args.runs, first, second)))
    return EXIT_OK


def _load_worker(args: argparse.Namespace) -> int:
    """`sluice load-worker --master-host H`: a Locust worker of a `sluice load --master` campaign, bounded in time."""
    import subprocess

    from loadtests.campaign import LOCUSTFILE

    worker = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--worker"]
    worker += ["--master-host", args.master_host, "--master-port", str(args.master_port)]
    try:
        return subprocess.run(worker, timeout=args.timeout, check=False).returncode
    except subprocess.TimeoutExpired:
        print(f"sluice load-worker: no campaign ended within {args.timeout:g} s; stopped", file=sys.stderr)
        return EXIT_INCOMPLETE


def _routing_suite(args: argparse.Namespace) -> int:
    from sluice.bench.routing_suite import routing_suite
    from sluice.deploy.apply import connect

    connect(args.address)
    tokenizer = Path(args.tokenizer or default_model_dir() / "tokenizer.json")
    figures = routing_suite(
        Path(args.spec or EMBEDDED_SPEC), Path(args.out or "load-routing"), tokenizer, args.duration
    )
    print(json.dumps(figures, indent=2))
    return 0


def _replay(args: argparse.Namespace) -> int:
    from loadtests.replay import RecordingError, load_recording, replay, report

    try:
        recording = load_recording(Path(args.recording))
    except (OSError, RecordingError) as error:
        print(error, file=sys.stderr)
        return 1
    targets = [args.target.rstrip("/"), *([args.compare.rstrip("/")] if args.compare else [])]
    answers = asyncio.run(replay(recording, targets, speed=args.speed))
    summary, clean = report(answers, recording)
    print(json.dumps(summary, indent=2))
    return 0 if clean else 1


def register(commands: Any) -> None:
    load = commands.add_parser("load", help="a Locust load campaign against a frontend (rows, summary, report)")
    load.add_argument("workload", help=f"{', '.join(WORKLOADS)}, the suite routing, or {COMPARE} A B")
    load.add_argument("runs", nargs="*", help=f"{COMPARE}: two runs' folders (or their summary.json)")
    load.add_argument(
        "--target", "--base-url", help="the frontend's base URL, e.g. http://127.0.0.1:8000 (not for routing)"
    )
    load.add_argument("--address", default="auto", help="routing: the Ray cluster to deploy the suite's stacks on")
    load.add_argument("--duration", type=float, default=60.0, help="seconds of load")
    load.add_argument("--users", type=int, default=8, help="concurrent users (closed loop; open loop: senders)")
    load.add_argument(
        "--rate",
        "--request-rate",
        help="requests per second, opening any workload's loop (bursts and step: 4 without it); "
        "several, e.g. 2,4,8: a sweep, one campaign per rate and one report",
    )
    load.add_argument("--burstiness", type=float, default=1.0, help="open loop: the gamma shape (1 = Poisson)")
    load.add_argument("--input-len", type=int, help="prompt tokens of every request (default: the workload's)")
    load.add_argument(
        "--output-len", type=int, help="output tokens of every request (default: the dataset's, else the workload's)"
    )
    load.add_argument(
        "--range-ratio", type=float, default=0.0, help="each length drawn uniformly from [n(1-r), n(1+r)] (vLLM's)"
    )
    load.add_argument(
        "--dataset", help="prompts from a file: a ShareGPT JSON, or JSON Lines of {prompt, output_len (optional)}"
    )
    load.add_argument("--workers", type=int, default=0, help="Locust workers under a master (0: one process)")
    load.add_argument(
        "--master", action="store_true", help="a Locust master for workers on other machines (sluice load-worker)"
    )
    load.add_argument("--expect-workers", type=int, default=1, help="--master: the workers to wait for")
    load.add_argument("--expect-workers-max-wait", type=float, default=60.0, help="--master: seconds to wait for them")
    load.add_argument(
        "--master-bind-host", default="127.0.0.1", help="--master: the address workers reach (a private one)"
    )
    load.add_argument("--master-port", type=int, default=LOCUST_MASTER_PORT, help="--master: the port workers reach")
    load.add_argument("--out", help="the output folder (default: load-<workload>)")
    load.add_argument("--model", help="the served model (default: the target's first)")
    load.add_argument(
        "--tokenizer",
        help="the served model's tokenizer: a tokenizer.json, its model folder or a Hub id (default: the tiny model's)",
    )
    load.add_argument("--spec", help="a stack's spec: its ingress.abort criteria become gates; routing: the stack")
    load.add_argument("--gate", action="append", default=[], metavar="NAME=LIMIT", help="e.g. ttft_p99_ms=500")
    load.add_argument("--slo-ttft-ms", type=float, help="goodput SLO: TTFT")
    load.add_argument("--slo-tpot-ms", type=float, help="goodput SLO: TPOT")
    load.add_argument("--slo-e2el-ms", type=float, help="goodput SLO: end-to-end latency")
    load.add_argument(
        "--goodput", nargs="+", default=[], metavar="NAME:MS", help="vLLM's form of the SLOs, e.g. ttft:200 tpot:50"
    )
    add_header_options(load)
    load.set_defaults(func=_load)

    worker = commands.add_parser("load-worker", help="a Locust worker of a `sluice load --master` campaign")
    worker.add_argument("--master-host", default="127.0.0.1", help="the master's --master-bind-host")
    worker.add_argument("--master-port", type=int, default=LOCUST_MASTER_PORT, help="the master's --master-port")
    worker.add_argument(
        "--timeout", type=float, default=3900.0, help="seconds after which the worker stops, campaign or not"
    )
    worker.set_defaults(func=_load_worker)

    replay_command = commands.add_parser(
        "replay", help="send recorded requests (JSONL) to a path, or to two and compare"
    )
    replay_command.add_argument("recording", help="a JSONL file of recorded requests")
    replay_command.add_argument("--target", required=True, help="base URL of the path, e.g. http://127.0.0.1:8000")
    replay_command.add_argument("--compare", help="a second base URL: send every request to both and compare")
    replay_command.add_argument("--speed", type=float, default=1.0, help="replay faster (>1) or slower than recorded")
    replay_command.set_defaults(func=_replay)
