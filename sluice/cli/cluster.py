"""The commands on a stack in a running Ray cluster: `deploy`, `status`, `down`, `canary`, `rollback`, `check`."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from base.runtime import COMPATIBLE_RAY_START
from sluice.cli.request_headers import add_header_options, request_headers
from sluice.deploy.errors import UsageError
from topologies import EMBEDDED_SPEC


def _on_cluster(args: argparse.Namespace) -> int:
    """`sluice deploy | status | down | canary | rollback | check`: a stack on a running Ray cluster, after the
    preflight (exit `PREFLIGHT_EXIT_CODE` with the fix when the cluster cannot run a sluice stack)."""
    from services.frontend.ingress_control import NoLegacyPath
    from sluice.cli import ingress as ingress_cli
    from sluice.deploy import apply as deploy
    from sluice.deploy import status
    from sluice.deploy.check.checklist import check
    from sluice.deploy.preflight import PREFLIGHT_EXIT_CODE, PreflightError, connect_to_serve
    from topologies.problems import SpecError

    deploy.quiet_ray_loggers(args.verbose)
    try:
        if args.command == "deploy":
            return deploy.deploy(args.file, args.address, args.timeout)
        if args.command == "down":
            return deploy.down(args.target, args.address)
        if args.command == "canary":
            return ingress_cli.canary(args.file, args.address, args.weight, args.watch)
        if args.command == "rollback":
            return ingress_cli.rollback(args.file, args.address)
        connect_to_serve(args.address)
        if args.command == "status":
            return status.status(args.target, args.address, as_json=args.json)
        spec = args.file or str(EMBEDDED_SPEC)
        headers = request_headers(args)
        return check(spec, None, args.address, args.json, args.allow_skip, _expected(args), args.ca_file, headers)
    except PreflightError as error:
        print(error, file=sys.stderr)
        return PREFLIGHT_EXIT_CODE
    except (SpecError, NoLegacyPath) as error:
        print(error, file=sys.stderr)
        return 1


def _expected(args: argparse.Namespace) -> dict[str, str]:
    """`--expect-ray` / `--expect-vllm`: the versions `sluice check` requires."""
    return {name: value for name, value in (("ray", args.expect_ray), ("vllm", args.expect_vllm)) if value}


def _check(args: argparse.Namespace) -> int:
    """`sluice check --target URL` needs no cluster; with a spec file it is a command on the cluster."""
    from sluice.deploy.check.checklist import allowed_skips, check

    try:
        allowed_skips(args.allow_skip)  # before anything connects
    except ValueError as error:
        raise UsageError(str(error)) from None
    headers = request_headers(args)  # before anything connects too
    if args.target is None:
        return _on_cluster(args)
    return check(None, args.target, args.address, args.json, args.allow_skip, _expected(args), args.ca_file, headers)


def register(commands: Any) -> None:
    from sluice.deploy.check.checklist import ITEMS as CHECK_ITEMS

    deploy = commands.add_parser(
        "deploy",
        help="deploy a spec to a running Ray cluster and return once it serves",
        description="Preflight (exit 3 with the fix when the cluster cannot run a sluice stack), deploy the spec's "
        "apps, show each deployment's replicas as they start, return once the frontend serves every replica. "
        f"A compatible Ray on this machine: `{COMPATIBLE_RAY_START}`.",
    )
    deploy.add_argument("file", help="the stack's spec file, or a platform file (kind: platform)")
    deploy.add_argument(
        "--timeout",
        type=float,
        help="seconds to wait for the stack (default 600, or 1800 when a model asks for GPUs); on the deadline, "
        "exit 1 naming the stuck deployment and its replica log's last lines",
    )
    status = commands.add_parser(
        "status",
        help="what runs on the cluster: every sluice stack, or one stack's policy, replicas, routers, ingress, canary",
    )
    status.add_argument("target", nargs="?", help="a stack's spec file or its name team-name (none: list stacks)")
    status.add_argument("--json", action="store_true", help="print an object (schema: sluice/deploy/json_reports.py)")
    down = commands.add_parser("down", help="delete a deployed stack's apps (HAProxy goes with the frontend app)")
    down.add_argument("target", help="the stack's spec file or its name team-name")
    for command in (deploy, status, down):
        command.set_defaults(func=_on_cluster)

    canary = commands.add_parser("canary", help="set a deployed stack's share of sessions on the direct path")
    canary.add_argument("file", help="the deployed stack's spec file")
    canary.add_argument(
        "--weight",
        type=int,
        required=True,
        choices=range(0, 101),
        metavar="0..100",
        help="percent of sessions on the direct path",
    )
    canary.add_argument("--watch", type=float, default=0.0, help="follow both paths' measures for this many seconds")
    rollback = commands.add_parser("rollback", help="every new request to the legacy path; drain the direct one")
    rollback.add_argument("file", help="the deployed stack's spec file")
    for command in (canary, rollback):
        command.set_defaults(func=_on_cluster)
    check = commands.add_parser(
        "check",
        help="the adoption checklist of a deployed stack (or of a URL)",
        description="Observes and never changes the stack. Exit 0: every item ran and passed; 4: incomplete (items "
        "skipped, each with the setting that enables it); 1: an item failed.",
    )
    check.add_argument("file", nargs="?", help="the stack's spec (default: the embedded one)")
    check.add_argument("--target", help="check only what this frontend URL shows")
    check.add_argument("--json", action="store_true", help="print an object (schema: sluice/deploy/json_reports.py)")
    check.add_argument(
        "--allow-skip",
        action="append",
        default=[],
        metavar="ITEM",
        help="an item you accept skipped (repeatable): " + ", ".join(repr(item) for item in CHECK_ITEMS),
    )
    check.add_argument("--expect-ray", metavar="VERSION", help="the Ray version every replica and this CLI must run")
    check.add_argument("--expect-vllm", metavar="VERSION", help="the vLLM version every replica and this CLI must run")
    check.add_argument("--ca-file", help="the CA an https frontend's certificate is checked against (default: system)")
    add_header_options(check)
    check.set_defaults(func=_check)
    for command in (deploy, status, down, canary, rollback, check):
        command.add_argument("--address", default="auto", help="the Ray cluster (default: RAY_ADDRESS, else local)")
        command.add_argument("--verbose", action="store_true", help="Ray's and Serve's own log lines too")
