"""`sluice model build`, `serve` (a team topology on a Ray cluster of its own, on 127.0.0.1), `validate`, `schema`."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from base.contracts import HAPROXY_PORT_DEFAULT, HAPROXY_PROMETHEUS_PORT_DEFAULT
from base.runtime import DEFAULT_SERVE_PROXY_PORT, cache_dir, default_model_dir, default_moe_model_dir
from topologies import EMBEDDED_SPEC

if TYPE_CHECKING:
    from builders.plan import StackPlan

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
    from builders.specs import parse_spec
    from topologies.spec import read_spec_data

    data = read_spec_data(args.file)
    if not isinstance(data, dict):
        return parse_spec(data, args.file)  # names what the file holds instead of a mapping
    frontend = data.setdefault("frontend", {})
    for flag, key in (("port", "port"), ("prometheus_port", "metrics_port"), ("routers", "routers")):
        if getattr(args, flag) is not None:
            frontend[key] = getattr(args, flag)
    protection = frontend.setdefault("protection", {})
    if args.api_key_file:
        protection["api_keys"] = {"file": str(Path(args.api_key_file).resolve())}
    if args.max_client_concurrency is not None:
        protection.setdefault("client_limits", {})["max_concurrent_requests"] = args.max_client_concurrency
    if args.tls_self_signed:
        from infra.tls_certs import throwaway_certificate

        files = throwaway_certificate(cache_dir() / "tls")
        frontend["tls"] = {"cert_file": str(files.cert), "key_file": str(files.key)}
        print(f"TLS with a throwaway certificate: clients trust {files.ca} (e.g. curl --cacert {files.ca})")
    if args.policy is not None:
        data["routing"] = {**data.get("routing", {}), "policy": args.policy, "policy_kwargs": {}}
    if args.replicas is not None:
        for model in data.get("models", []):
            model.pop("autoscaling", None)
            model["replicas"] = args.replicas
    return parse_spec(data, args.file)


def watch_canary(plan: StackPlan, said: str | None) -> str | None:
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


def _validate(args: argparse.Namespace) -> int:
    from builders.specs import engine_problems, load_spec
    from infra.api_keys import ApiKeyError
    from topologies.platform import is_platform_file, load_platform
    from topologies.problems import SpecError

    try:
        if is_platform_file(args.file):
            platform = load_platform(args.file)
            for tenant in platform.tenants:
                tenant.api_keys.digests()
            tenants = ", ".join(tenant.team for tenant in platform.tenants)
            print(f"{args.file}: valid platform {platform.name} (tenants: {tenants})")
            return 0
        spec = load_spec(args.file)
    except (SpecError, ApiKeyError) as error:
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

    from builders.specs import topology_json_schema

    print(json.dumps(topology_json_schema(), indent=2))
    return 0


def register(commands: Any) -> None:
    from routers.registry import policy_names

    model = commands.add_parser("model", help="the locally generated tiny model")
    model_commands = model.add_subparsers(dest="model_command", required=True)
    build = model_commands.add_parser("build", help="build the tiny model deterministically")
    build.add_argument("--out", help="output folder (default: the tiny model's, or the MoE variant's, cache folder)")
    build.add_argument("--moe", action="store_true", help="the MoE variant (Mixtral layers, 4 experts)")
    build.set_defaults(func=_model_build)

    serve = commands.add_parser("serve", help="run a team topology (the embedded default) on 127.0.0.1")
    serve.add_argument("file", nargs="?", default=str(EMBEDDED_SPEC), help="a spec file (default: local-cpu)")
    serve.add_argument("--replicas", type=int, help="replicas of every model")
    serve.add_argument("--routers", type=int, help="router replicas (spec: frontend.routers)")
    serve.add_argument("--policy", choices=sorted(policy_names()), help="the routing policy (spec: routing.policy)")
    serve.add_argument("--port", type=int, help=f"HAProxy's port on 127.0.0.1 (spec; {HAPROXY_PORT_DEFAULT})")
    serve.add_argument(
        "--prometheus-port", type=int, help=f"HAProxy's metrics port (spec; {HAPROXY_PROMETHEUS_PORT_DEFAULT})"
    )
    serve.add_argument("--verbose", action="store_true", help="stream Ray's and vLLM's logs here too")
    serve.add_argument(
        "--serve-proxy-port", type=int, default=DEFAULT_SERVE_PROXY_PORT, help="Serve's own HTTP proxy (off HAProxy's)"
    )
    serve.add_argument(
        "--api-key-file", help="require `Authorization: Bearer <key>`: a file of key hashes (sluice api-key new)"
    )
    serve.add_argument(
        "--max-client-concurrency", type=int, help="requests in flight per client (its key, else its address)"
    )
    serve.add_argument(
        "--tls-self-signed",
        action="store_true",
        help="TLS on the port with a throwaway CA and certificate for 127.0.0.1 (for local tries)",
    )
    serve.set_defaults(func=_serve)

    validate = commands.add_parser("validate", help="check a team topology spec (and its engine args with vLLM)")
    validate.add_argument("file", help="the spec file")
    validate.add_argument("--no-engine", action="store_true", help="skip vLLM's check of the engine arguments")
    validate.set_defaults(func=_validate)
    schema = commands.add_parser("schema", help="print the JSON Schema of topology specs (for editors)")
    schema.set_defaults(func=_schema)
