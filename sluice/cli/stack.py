"""The command line of a stack's artefacts and containers: `sluice render` (Serve config, KubeRay manifest, Prometheus
scrape config), `sluice image build`, `sluice node`, `sluice stack up | down`."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from sluice.deploy.errors import UsageError, docker_engine


def _render(args: argparse.Namespace) -> int:
    from sluice.deploy.apply import render
    from sluice.deploy.render_kuberay import render_kuberay

    try:
        if args.prometheus:
            print(_prometheus(args.file, args.frontend_host), end="")
        else:
            kuberay = args.kuberay or args.attach
            print(render_kuberay(args.file, args.image, args.attach) if kuberay else render(args.file), end="")
    except ValueError as error:  # a SpecError, or a name KubeRay refuses
        print(error, file=sys.stderr)
        return 1
    return 0


def _prometheus(path: str, frontend_host: str) -> str:
    from builders.specs import load_spec
    from infra.prometheus_config import render_prometheus_config

    spec = load_spec(path)
    return render_prometheus_config([f"{frontend_host}:{spec.frontend.metrics_port}"])


def _image_build(args: argparse.Namespace) -> int:
    from infra.container_images import build_image, image_size_bytes

    with docker_engine():
        tag = build_image(args.engine, base=args.base, tag=args.tag)
    print(f"{tag}: {image_size_bytes(tag) / 2**30:.2f} GiB")
    return 0


def _node(args: argparse.Namespace) -> int:
    from sluice.deploy.node import run_node

    if args.role == "worker" and not args.head:
        raise UsageError("a worker node needs the head's address: --head ADDRESS")
    run_node(args.role, args.head, args.num_cpus)
    return 1  # run_node replaces this process


def _stack_up(args: argparse.Namespace) -> int:
    from sluice.deploy.container_stack import stack_up

    try:
        with docker_engine():
            running = stack_up(args.file, args.nodes, image=args.image, worker_cpus=args.worker_cpus)
    except RuntimeError as error:
        print(error, file=sys.stderr)
        return 1
    print(f"\nstack {running.stack} serves at {running.url} (metrics: {running.metrics_url}/metrics)")
    print(f"  head {running.head.container} {running.head.address}")
    for worker in running.workers:
        print(f"  worker {worker.container} {worker.address}")
    return 0


def _stack_status(args: argparse.Namespace) -> int:
    from sluice.deploy.container_stack import stack_status

    with docker_engine():
        code, output = stack_status(args.file, args.json)
    print(output)
    return code


def _stack_down(args: argparse.Namespace) -> int:
    from sluice.deploy.container_stack import stack_down, stack_name

    with docker_engine():
        removed = stack_down(stack_name(args.file))
    print(f"{removed} container(s) removed")
    return 0


def register(commands: Any) -> None:
    from base.runtime import LOOPBACK
    from infra.container_images import ENGINES, image_tag

    render = commands.add_parser("render", help="a spec's plan as a Serve config (serve deploy, KubeRay)")
    render.add_argument("file", help="the stack's spec file")
    what = render.add_mutually_exclusive_group()
    what.add_argument("--kuberay", action="store_true", help="a KubeRay RayService manifest (+ Service, ConfigMap)")
    what.add_argument("--prometheus", action="store_true", help="prometheus.yml for the stack's frontend")
    render.add_argument("--image", default=image_tag("cpu"), help="the node image (sluice image build)")
    render.add_argument(
        "--attach",
        action="append",
        default=[],
        metavar="TEAM_FILE",
        help="with a platform file and --kuberay: a stack attached to it, rendered in the same RayService (repeat)",
    )
    render.add_argument(
        "--frontend-host", default=LOOPBACK, help="where Prometheus reaches the frontend (host, Service name)"
    )
    render.set_defaults(func=_render)

    image = commands.add_parser("image", help="the node image of stacks in containers")
    image_commands = image.add_subparsers(dest="image_command", required=True)
    build = image_commands.add_parser("build", help="build it (the local Debian base first when missing)")
    build.add_argument("--engine", choices=ENGINES, default="cpu", help="vLLM's CPU build or its CUDA one")
    build.add_argument("--base", help="base image (default: the local Debian base for cpu, a CUDA base for gpu)")
    build.add_argument("--tag", help="default sluice:ENGINE")
    build.set_defaults(func=_image_build)

    node = commands.add_parser("node", help="run this container as a node of a stack (the image's entrypoint)")
    node.add_argument("role", choices=("head", "worker"), help="the head (frontend, routers) or a worker")
    node.add_argument("--head", help="the head node's address (workers)")
    node.add_argument("--num-cpus", type=int, help="CPUs this node offers Ray (default: all)")
    node.set_defaults(func=_node)

    stack = commands.add_parser("stack", help="a spec's stack across containers on a private Docker network")
    stack_commands = stack.add_subparsers(dest="stack_command", required=True)
    up = stack_commands.add_parser("up", help="a head and N workers, the spec deployed onto them")
    up.add_argument("file", help="the stack's spec file")
    up.add_argument("--nodes", type=int, default=2, help="worker containers (default 2)")
    up.add_argument("--image", default=image_tag("cpu"), help="the node image (sluice image build)")
    up.add_argument("--worker-cpus", type=int, help="CPUs each worker offers Ray (default: all)")
    up.set_defaults(func=_stack_up)
    status = stack_commands.add_parser("status", help="`sluice status` of the stack, run on its head")
    status.add_argument("file", help="the stack's spec file")
    status.add_argument("--json", action="store_true", help="sluice status --json, run on the head")
    status.set_defaults(func=_stack_status)
    down = stack_commands.add_parser("down", help="remove the stack's containers and network")
    down.add_argument("file", help="the stack's spec file")
    down.set_defaults(func=_stack_down)
