"""The `sluice` command line."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path

from sluice.runtime import DEFAULT_SERVE_PROXY_PORT, apply_process_env, default_model_dir

EMBEDDED_APP_NAME = "llm"


def _model_build(args: argparse.Namespace) -> int:
    from sluice.tiny_model import build_tiny_model

    out = build_tiny_model(Path(args.out))
    print(f"tiny model written to {out}")
    return 0


def ensure_model(path: Path) -> Path:
    from sluice.tiny_model import build_tiny_model, is_built

    if not is_built(path):
        print(f"building the tiny model into {path}", flush=True)
        build_tiny_model(path)
    return path


def _serve(args: argparse.Namespace) -> int:
    from sluice.cluster import start_local_cluster, stop_local_cluster, wait_for_endpoints

    model = ensure_model(Path(args.model))
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    start_local_cluster(serve_proxy_port=args.serve_proxy_port)
    try:
        from ray import serve

        from services.llm_config import EngineConfig, LLMAppConfig, ReplicaDeploymentConfig
        from services.llm_replica import llm_application

        config = LLMAppConfig(
            engine=EngineConfig(model=str(model)),
            deployment=ReplicaDeploymentConfig(num_replicas=args.replicas),
        )
        serve.run(llm_application(config), name=EMBEDDED_APP_NAME, route_prefix="/", blocking=False)
        endpoints = wait_for_endpoints(EMBEDDED_APP_NAME, args.replicas)
        print("\nsluice is serving the tiny model (no HAProxy/router yet: call a replica port directly):")
        for endpoint in endpoints:
            print(f"  replica {endpoint.replica_id}: {endpoint.url}/v1/chat/completions")
        print(f"model name: {config.engine.served_model_name}. Ctrl-C stops everything.", flush=True)
        stop.wait()
    finally:
        print("shutting down", flush=True)
        stop_local_cluster()
    return 0


def _bench_replica(args: argparse.Namespace) -> int:
    from sluice.bench import run_replica_bench

    run_replica_bench(ensure_model(Path(args.model)), replicas=args.replicas)
    return 0


def _bench_routers(args: argparse.Namespace) -> int:
    from sluice.bench_routers import run_router_bench

    run_router_bench(with_actor=not args.no_actor)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sluice", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    model = commands.add_parser("model", help="the locally generated tiny model")
    model_commands = model.add_subparsers(dest="model_command", required=True)
    build = model_commands.add_parser("build", help="build the tiny model deterministically")
    build.add_argument("--out", default=str(default_model_dir()), help="output folder")
    build.set_defaults(func=_model_build)

    serve = commands.add_parser("serve", help="run the embedded default topology on 127.0.0.1")
    serve.add_argument("--model", default=str(default_model_dir()))
    serve.add_argument("--replicas", type=int, default=2)
    serve.add_argument("--serve-proxy-port", type=int, default=DEFAULT_SERVE_PROXY_PORT)
    serve.set_defaults(func=_serve)

    bench = commands.add_parser("bench", help="benchmarks (not tests)")
    bench_commands = bench.add_subparsers(dest="bench_command", required=True)
    replica = bench_commands.add_parser("replica", help="startup, memory, TTFT and tokens/s of the replicas")
    replica.add_argument("--model", default=str(default_model_dir()))
    replica.add_argument("--replicas", type=int, default=2)
    replica.set_defaults(func=_bench_replica)
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
