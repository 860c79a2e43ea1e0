"""`sluice bench replica | direct | pd | paths | routers | policies | tls | soak | overload`: benchmarks, never
tests."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from base.runtime import default_model_dir


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
    from sluice.bench.netns import in_private_netns, private_netns_argv
    from sluice.bench.paths import run_paths_bench

    if not args.no_peer and not in_private_netns() and os.geteuid() == 0 and shutil.which("unshare"):
        argv = [sys.executable, "-m", "sluice.cli.main", "bench", "paths", "--out", str(Path(args.out).resolve())]
        return subprocess.run(private_netns_argv(argv), check=False).returncode
    run_paths_bench(Path(args.out), with_peer=not args.no_peer)
    return 0


def _bench_tls(args: argparse.Namespace) -> int:
    """TLS against plain HTTP through one frontend, on a local Ray of its own (sluice/bench/tls.py)."""
    from base.tiny_model import ensure_built
    from sluice.bench.tls import run_tls_bench
    from sluice.deploy.local_cluster import start_local_cluster, stop_local_cluster

    ensure_built(default_model_dir())
    start_local_cluster(log_to_driver=False)
    try:
        run_tls_bench(Path(args.out))
    finally:
        stop_local_cluster()
    return 0


def _bench_soak(args: argparse.Namespace) -> int:
    """The soak on a local Ray of its own (sluice/bench/soak.py)."""
    import json

    from base.tiny_model import ensure_built
    from sluice.bench.soak import broken_invariants, soak
    from sluice.deploy.local_cluster import start_local_cluster, stop_local_cluster
    from topologies import EMBEDDED_SPEC

    tokenizer = ensure_built(default_model_dir()) / "tokenizer.json"
    start_local_cluster(log_to_driver=False)
    try:
        figures = soak(Path(args.spec or EMBEDDED_SPEC), Path(args.out), tokenizer, args.duration)
    finally:
        stop_local_cluster()
    print(json.dumps(figures, indent=2))
    broken = broken_invariants(figures)
    for invariant in broken:
        print(f"invariant broken: {invariant}", file=sys.stderr)
    return 1 if broken else 0


def _bench_overload(args: argparse.Namespace) -> int:
    """capacity_queue at 4x its capacity over SPOE, then idle, on a local Ray of its own (sluice/bench/overload.py)."""
    import json

    from sluice.bench.overload import overload
    from sluice.deploy.local_cluster import start_local_cluster, stop_local_cluster
    from topologies import EMBEDDED_SPEC

    start_local_cluster(log_to_driver=False)
    try:
        figures = overload(Path(args.spec or EMBEDDED_SPEC), Path(args.out), args.duration)
    finally:
        stop_local_cluster()
    print(json.dumps(figures, indent=2))
    return 0


def _bench_routers(args: argparse.Namespace) -> int:
    from base.tiny_model import ensure_built
    from sluice.bench.kv_decisions import run_kv_aware_bench
    from sluice.bench.routers import run_router_bench

    run_router_bench(with_actor=not args.no_actor)
    print(f"{'kv_aware, tokenization included':<44}{'8 replicas':>12}   (µs per decision; goal at 1k: 1,000)")
    for label, us in run_kv_aware_bench(ensure_built(Path(args.model))):
        print(f"{label:<44}{us:>12.0f}")
    return 0


def _bench_policies(args: argparse.Namespace) -> int:
    """Every policy on every workload over simulated replicas (sluice/bench/policies.py); no Ray."""
    from base.tiny_model import ensure_built
    from sluice.bench.policies import run_policy_bench

    run_policy_bench(
        ensure_built(Path(args.model)),
        Path(args.out),
        tuple(args.replicas),
        tuple(args.workloads),
        tuple(args.policies),
        shadow=not args.no_shadow,
    )
    return 0


def _counts(text: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: replica counts separated by commas, e.g. 8,32,64") from None
    if any(count < 2 or count > 256 for count in counts):
        raise argparse.ArgumentTypeError(f"{text!r}: each replica count from 2 to 256")
    return counts


def _names(choices: tuple[str, ...]) -> Any:
    def parse(text: str) -> list[str]:
        names = text.split(",")
        unknown = [name for name in names if name not in choices]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {', '.join(unknown)}: choose from {', '.join(choices)}")
        return names

    return parse


def _load_duration(text: str) -> float:
    """A load's length in seconds, refused before any stack starts when a campaign could not run it."""
    from loadtests.campaign import load_seconds

    try:
        return load_seconds(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _stack_run_options(parser: argparse.ArgumentParser, duration_s: float, duration: str, out: str, where: str) -> None:
    """The options of a bench that runs one stack (run with capacity_queue) under load for a while."""
    parser.add_argument("--duration", type=_load_duration, default=duration_s, help=duration)
    parser.add_argument("--spec", help="the stack's spec (default: the embedded one; it runs capacity_queue)")
    parser.add_argument("--out", default=out, help=where)


def register(commands: Any) -> None:
    bench = commands.add_parser("bench", help="benchmarks (not tests)")
    bench_commands = bench.add_subparsers(dest="bench_command", required=True)
    replica = bench_commands.add_parser("replica", help="startup, memory, TTFT and tokens/s of the replicas")
    replica.add_argument("--model", default=str(default_model_dir()), help="the model folder the replicas serve")
    replica.add_argument("--replicas", type=int, default=2, help="replicas started side by side")
    replica.set_defaults(func=_bench_replica)
    direct = bench_commands.add_parser("direct", help="TTFT through HAProxy + router vs direct; route call alone")
    direct.add_argument("--model", default=str(default_model_dir()), help="the model folder the replicas serve")
    direct.set_defaults(func=_bench_direct)
    pd = bench_commands.add_parser("pd", help="TTFT and ITL of prefill/decode versus the plain topology")
    pd.add_argument("--samples", type=int, default=30, help="streams per stack and prompt length")
    pd.set_defaults(func=_bench_pd)
    paths = bench_commands.add_parser("paths", help="replica port, direct, legacy, Serve proxy: side by side")
    paths.add_argument("--out", default=".cache/bench", help="where paths.json and the charts go")
    paths.add_argument("--no-peer", action="store_true", help="skip Ray's own direct streaming (the peer)")
    paths.set_defaults(func=_bench_paths)
    routers = bench_commands.add_parser("routers", help="policy decisions, ring rebuild, ledger, route agent")
    routers.add_argument("--no-actor", action="store_true", help="skip the Ray actor ledger round trip")
    routers.add_argument("--model", default=str(default_model_dir()), help="the model whose tokenizer kv_aware uses")
    routers.set_defaults(func=_bench_routers)
    from sluice.bench.policy_workloads import BENCH_POLICIES, DEFAULT_REPLICAS, POLICY_WORKLOADS

    policies = bench_commands.add_parser(
        "policies", help="every policy x workload x replica count on simulated replicas: hit rates, TTFT, load spread"
    )
    policies.add_argument("--replicas", type=_counts, default=list(DEFAULT_REPLICAS), help="e.g. 8,32,64")
    policies.add_argument(
        "--workloads", type=_names(POLICY_WORKLOADS), default=list(POLICY_WORKLOADS), help="comma-separated, e.g. mixed"
    )
    policies.add_argument(
        "--policies", type=_names(BENCH_POLICIES), default=list(BENCH_POLICIES), help="comma-separated, e.g. kv_aware"
    )
    policies.add_argument("--no-shadow", action="store_true", help="skip the shadow policy runs at 16 replicas")
    policies.add_argument(
        "--model", default=str(default_model_dir()), help="the model whose tokenizer and template the prompts use"
    )
    policies.add_argument("--out", default=".cache/bench", help="where policies.json goes")
    policies.set_defaults(func=_bench_policies)
    tls = bench_commands.add_parser("tls", help="TTFT and tokens/s through one frontend over TLS and over plain HTTP")
    tls.add_argument("--out", default=".cache/bench", help="where tls.json goes")
    tls.set_defaults(func=_bench_tls)
    soak = bench_commands.add_parser(
        "soak", help="the mixed campaign with leaving clients, a replica kill and a scale 2-3-2; invariants and RSS"
    )
    _stack_run_options(soak, 1800.0, "seconds of load", ".cache/soak", "where soak.json and the campaign's files go")
    soak.set_defaults(func=_bench_soak)
    overload = bench_commands.add_parser(
        "overload", help="capacity_queue at 4x its capacity over SPOE, then idle: settling and arrival order"
    )
    _stack_run_options(overload, 60.0, "seconds of overload", ".cache/bench", "where overload.json goes")
    overload.set_defaults(func=_bench_overload)
