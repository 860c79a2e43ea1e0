"""The `sluice` command line."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from base.contracts import HAPROXY_PORT_DEFAULT, HAPROXY_PROMETHEUS_PORT_DEFAULT
from base.runtime import (
    DEFAULT_SERVE_PROXY_PORT,
    apply_process_env,
    default_model_dir,
    default_moe_model_dir,
)
from sluice.cli.cluster import EMBEDDED_SPEC, add_cluster_commands

# How often `sluice serve` looks for a canary that rolled back by itself.
CANARY_WATCH_S = 2.0


def _model_build(args: argparse.Namespace) -> int:
    from base.tiny_model import build_tiny_model

    default = default_moe_model_dir() if args.moe else default_model_dir()
    out = build_tiny_model(Path(args.out or default), moe=args.moe)
    print(f"tiny {'MoE ' if args.moe else ''}model written to {out}")
    return 0


def serve_spec(args: argparse.Namespace) -> Any:
    """The spec `sluice serve` runs: the file (the embedded default unless given) with the flags applied over it."""
    import yaml

    from topologies.spec import parse_spec

    data = yaml.safe_load(Path(args.file).read_text())
    frontend = data.setdefault("frontend", {})
    for flag, key in (("port", "port"), ("prometheus_port", "metrics_port"), ("routers", "routers")):
        if getattr(args, flag) is not None:
            frontend[key] = getattr(args, flag)
    protection = frontend.setdefault("protection", {})
    if args.api_key_file:
        protection["api_keys"] = {"file": str(Path(args.api_key_file).resolve())}
    if args.max_client_concurrency is not None:
        protection.setdefault("client_limits", {})["max_concurrent_requests"] = args.max_client_concurrency
    if args.policy is not None:
        data["routing"] = {**data.get("routing", {}), "policy": args.policy, "policy_kwargs": {}}
    if args.replicas is not None:
        for model in data.get("models", []):
            model.pop("autoscaling", None)
            model["replicas"] = args.replicas
    return parse_spec(data, args.file)


def watch_canary(plan: Any, said: str | None) -> str | None:
    """Print a line in `sluice serve`'s terminal when the stack's canary rolls back by itself; the line in force."""
    from sluice.deploy.status import canary_line, ingress_state

    line = canary_line(ingress_state(plan))
    if line is not None and line != said and "ROLLED BACK" in line:
        print(line, flush=True)
    return line


def _serve(args: argparse.Namespace) -> int:
    import logging

    from base.runtime import ray_temp_dir
    from builders.plan import build_plan
    from sluice.deploy.apply import apply_plan, ensure_models, serving_lines
    from sluice.deploy.local_cluster import start_local_cluster, stop_local_cluster
    from topologies.problems import SpecError

    try:
        spec = serve_spec(args)
        plan = build_plan(spec)
    except SpecError as error:
        print(error, file=sys.stderr)
        return 1
    ensure_models(spec)
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    if not args.verbose:
        logging.getLogger("ray").setLevel(logging.WARNING)
    print(f"starting Ray on 127.0.0.1; Ray's and vLLM's logs: {ray_temp_dir()}/session_latest/logs", flush=True)
    start_local_cluster(serve_proxy_port=args.serve_proxy_port, log_to_driver=args.verbose)
    import ray

    if not args.verbose:
        logging.getLogger("ray.serve").setLevel(logging.WARNING)
    said: str | None = None
    try:
        if not apply_plan(spec, plan):
            return 1
        print("\n".join(serving_lines(spec, plan)))
        address = ray.get_runtime_context().gcs_address
        print(f"  sluice status {plan.stack} --address {address}", flush=True)
        print("Ctrl-C stops everything.", flush=True)
        while not stop.wait(CANARY_WATCH_S):
            said = watch_canary(plan, said=said)
    finally:
        # Serve's shutdown deletes every app; HAProxy dies with its frontend replica.
        print("shutting down", flush=True)
        stop_local_cluster()
    return 0


def _api_key_new(args: argparse.Namespace) -> int:
    from infra.api_keys import key_hash_line, new_api_key

    key = new_api_key()
    print(f"key (hand it to the caller; sluice stores only its hash): {key}")
    print(f"line for the key file: {key_hash_line(key, args.label)}")
    return 0


def _api_key_hash(args: argparse.Namespace) -> int:
    from infra.api_keys import key_hash_line

    key = sys.stdin.readline().strip()
    if not key:
        print("sluice api-key hash: give the key on standard input", file=sys.stderr)
        return 2
    print(key_hash_line(key, args.label))
    return 0


def _validate(args: argparse.Namespace) -> int:
    from topologies.problems import SpecError
    from topologies.spec import engine_problems, load_spec

    try:
        spec = load_spec(args.file)
    except SpecError as error:
        print(error, file=sys.stderr)
        return 1
    problems = [] if args.no_engine else engine_problems(spec)
    if problems:
        print(f"{args.file}: {len(problems)} problem(s)", file=sys.stderr)
        for problem in problems:
            print(f"  {problem}", file=sys.stderr)
        return 1
    models = ", ".join(model.name for model in spec.models)
    print(f"{args.file}: valid {spec.kind} stack {spec.team}/{spec.name} ({models})")
    return 0


def _schema(args: argparse.Namespace) -> int:
    import json

    from topologies.spec import topology_json_schema

    print(json.dumps(topology_json_schema(), indent=2))
    return 0


def _load(args: argparse.Namespace) -> int:
    """`sluice load WORKLOAD --target URL`: a Locust campaign; exit 1 when a gate is breached."""
    from loadtests.campaign import Campaign, gates_from_spec, run
    from loadtests.metrics import SLO

    if args.workload == "routing":
        return _routing_suite(args)
    if not args.target:
        print("--target is required for a workload campaign", file=sys.stderr)
        return 1
    gates = gates_from_spec(Path(args.spec)) if args.spec else {}
    for gate in args.gate:
        name, _, value = gate.partition("=")
        gates[name] = float(value)
    campaign = Campaign(
        workload=args.workload,
        target=args.target.rstrip("/"),
        out=Path(args.out or f"load-{args.workload}"),
        tokenizer=Path(args.tokenizer or default_model_dir() / "tokenizer.json"),
        duration_s=args.duration,
        users=args.users,
        rate=args.rate,
        burstiness=args.burstiness,
        workers=args.workers,
        model=args.model,
        slo=SLO(ttft_ms=args.slo_ttft_ms, tpot_ms=args.slo_tpot_ms, e2el_ms=args.slo_e2el_ms),
        gates=gates,
    )
    try:
        summary, breached = run(campaign)
    except ValueError as error:
        print(error, file=sys.stderr)
        return 1
    print(f"{summary.ok}/{summary.requests} requests ok; rows, summary.json and report.html in {campaign.out}")
    for breach in breached:
        print(f"gate breached: {breach}", file=sys.stderr)
    return 1 if breached else 0


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


def _bench_replica(args: argparse.Namespace) -> int:
    from base.tiny_model import ensure_built
    from sluice.bench.replica import run_replica_bench

    run_replica_bench(ensure_built(Path(args.model)), replicas=args.replicas)
    return 0


def _bench_direct(args: argparse.Namespace) -> int:
    from base.tiny_model import ensure_built
    from sluice.bench.replica import run_direct_bench

    run_direct_bench(ensure_built(Path(args.model)))
    return 0


def _bench_pd(args: argparse.Namespace) -> int:
    from sluice.bench.pd import run_pd_bench

    run_pd_bench(samples=args.samples)
    return 0


def _bench_paths(args: argparse.Namespace) -> int:
    """Re-executed in a private network namespace when this machine allows it (root, `unshare`): Ray's own HAProxy,
    the peer, binds ports on every interface, and there loopback is the only one."""
    from sluice.bench.paths import run_paths_bench
    from sluice.bench.ray_peer import in_private_netns, private_netns_argv

    if not args.no_peer and not in_private_netns() and os.geteuid() == 0 and shutil.which("unshare"):
        argv = [sys.executable, "-m", "sluice.cli.main", "bench", "paths", "--out", str(Path(args.out).resolve())]
        return subprocess.run(private_netns_argv(argv), check=False).returncode
    run_paths_bench(Path(args.out), with_peer=not args.no_peer)
    return 0


def _bench_routers(args: argparse.Namespace) -> int:
    from sluice.bench.routers import run_router_bench

    run_router_bench(with_actor=not args.no_actor)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from routers.config import SETTINGS

    parser = argparse.ArgumentParser(prog="sluice", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    model = commands.add_parser("model", help="the locally generated tiny model")
    model_commands = model.add_subparsers(dest="model_command", required=True)
    build = model_commands.add_parser("build", help="build the tiny model deterministically")
    build.add_argument("--out", help="output folder (default: the tiny model's, or the MoE variant's, cache folder)")
    build.add_argument("--moe", action="store_true", help="the MoE variant (Mixtral layers, 4 experts)")
    build.set_defaults(func=_model_build)

    serve = commands.add_parser("serve", help="run a team topology (the embedded default) on 127.0.0.1")
    serve.add_argument("file", nargs="?", default=str(EMBEDDED_SPEC), help="a spec file (default: local-cpu)")
    serve.add_argument("--replicas", type=int, help="replicas of every model")
    serve.add_argument("--routers", type=int)
    serve.add_argument("--policy", choices=sorted(SETTINGS))
    serve.add_argument("--port", type=int, help=f"HAProxy's port on 127.0.0.1 (spec; {HAPROXY_PORT_DEFAULT})")
    serve.add_argument(
        "--prometheus-port", type=int, help=f"HAProxy's metrics port (spec; {HAPROXY_PROMETHEUS_PORT_DEFAULT})"
    )
    serve.add_argument("--verbose", action="store_true", help="stream Ray's and vLLM's logs here too")
    serve.add_argument("--serve-proxy-port", type=int, default=DEFAULT_SERVE_PROXY_PORT)
    serve.add_argument(
        "--api-key-file", help="require `Authorization: Bearer <key>`: a file of key hashes (sluice api-key new)"
    )
    serve.add_argument(
        "--max-client-concurrency", type=int, help="requests in flight per client (its key, else its address)"
    )
    serve.set_defaults(func=_serve)

    validate = commands.add_parser("validate", help="check a team topology spec (and its engine args with vLLM)")
    validate.add_argument("file")
    validate.add_argument("--no-engine", action="store_true", help="skip vLLM's check of the engine arguments")
    validate.set_defaults(func=_validate)
    schema = commands.add_parser("schema", help="print the JSON Schema of topology specs (for editors)")
    schema.set_defaults(func=_schema)

    add_cluster_commands(commands)

    api_key = commands.add_parser("api-key", help="team API keys: the key file holds their hashes only")
    api_key_commands = api_key.add_subparsers(dest="api_key_command", required=True)
    new = api_key_commands.add_parser("new", help="a new random key and its key file line")
    new.add_argument("--label", default="", help="who the key is for (kept next to the hash)")
    new.set_defaults(func=_api_key_new)
    hash_key = api_key_commands.add_parser("hash", help="the key file line of a key read from standard input")
    hash_key.add_argument("--label", default="")
    hash_key.set_defaults(func=_api_key_hash)

    load = commands.add_parser("load", help="a Locust load campaign against a frontend (rows, summary, report)")
    load.add_argument("workload", help="short_long, long_short, mixed, bursts, step, multi_turn, or the suite routing")
    load.add_argument("--target", help="the frontend's base URL, e.g. http://127.0.0.1:8000 (not for routing)")
    load.add_argument("--address", default="auto", help="routing: the Ray cluster to deploy the suite's stacks on")
    load.add_argument("--duration", type=float, default=60.0, help="seconds of load")
    load.add_argument("--users", type=int, default=8, help="concurrent users (closed loop; open loop: senders)")
    load.add_argument("--rate", type=float, default=4.0, help="open loop (bursts, step): requests per second")
    load.add_argument("--burstiness", type=float, default=1.0, help="bursts: the gamma shape (1 = Poisson)")
    load.add_argument("--workers", type=int, default=0, help="Locust workers under a master (0: one process)")
    load.add_argument("--out", help="the output folder (default: load-<workload>)")
    load.add_argument("--model", help="the served model (default: the target's first)")
    load.add_argument("--tokenizer", help="the served model's tokenizer.json (default: the tiny model's)")
    load.add_argument("--spec", help="a stack's spec: its ingress.abort criteria become gates; routing: the stack")
    load.add_argument("--gate", action="append", default=[], metavar="NAME=LIMIT", help="e.g. ttft_p99_ms=500")
    load.add_argument("--slo-ttft-ms", type=float, help="goodput SLO: TTFT")
    load.add_argument("--slo-tpot-ms", type=float, help="goodput SLO: TPOT")
    load.add_argument("--slo-e2el-ms", type=float, help="goodput SLO: end-to-end latency")
    load.set_defaults(func=_load)

    replay_command = commands.add_parser(
        "replay", help="send recorded requests (JSONL) to a path, or to two and compare"
    )
    replay_command.add_argument("recording")
    replay_command.add_argument("--target", required=True, help="base URL of the path, e.g. http://127.0.0.1:8000")
    replay_command.add_argument("--compare", help="a second base URL: send every request to both and compare")
    replay_command.add_argument("--speed", type=float, default=1.0, help="replay faster (>1) or slower than recorded")
    replay_command.set_defaults(func=_replay)

    bench = commands.add_parser("bench", help="benchmarks (not tests)")
    bench_commands = bench.add_subparsers(dest="bench_command", required=True)
    replica = bench_commands.add_parser("replica", help="startup, memory, TTFT and tokens/s of the replicas")
    replica.add_argument("--model", default=str(default_model_dir()))
    replica.add_argument("--replicas", type=int, default=2)
    replica.set_defaults(func=_bench_replica)
    direct = bench_commands.add_parser("direct", help="TTFT through HAProxy + router vs direct; route call alone")
    direct.add_argument("--model", default=str(default_model_dir()))
    direct.set_defaults(func=_bench_direct)
    pd = bench_commands.add_parser("pd", help="TTFT and ITL of prefill/decode versus the plain topology")
    pd.add_argument("--samples", type=int, default=30, help="streams per stack and prompt length")
    pd.set_defaults(func=_bench_pd)
    paths = bench_commands.add_parser("paths", help="replica port, direct, legacy, Serve proxy: side by side")
    paths.add_argument("--out", default=".cache/bench", help="where paths.json and the charts go")
    paths.add_argument("--no-peer", action="store_true", help="skip Ray's own direct streaming (the peer)")
    paths.set_defaults(func=_bench_paths)
    routers = bench_commands.add_parser("routers", help="policy decision time, ring rebuild, ledger round trip")
    routers.add_argument("--no-actor", action="store_true", help="skip the Ray actor ledger round trip")
    routers.set_defaults(func=_bench_routers)
    return parser


def main(argv: list[str] | None = None) -> int:
    apply_process_env()
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
