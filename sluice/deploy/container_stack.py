"""`sluice stack up FILE --nodes N | status | down FILE`: a team's stack across containers, through the Docker SDK.

A private (internal) Docker network, a Ray head container and N workers from the node image, each running
`sluice node`; the spec is deployed from the head. Everything created carries `STACK_LABEL`, and `down` removes
exactly that. Details: `sluice/deploy/README.md`.
"""

from __future__ import annotations

import io
import os
import tarfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from base.waiting import wait_until
from builders.specs import load_spec
from infra.container_images import image_tag
from sluice.deploy.node import RAY_GCS_PORT

if TYPE_CHECKING:
    from docker import DockerClient
    from docker.models.containers import Container

STACK_LABEL = "sluice.stack"
ROLE_LABEL = "sluice.role"
SPEC_DIR = "/etc/sluice/stack"
# Ray's object store lives in /dev/shm; Docker's default 64 MiB makes Ray fall back to a slower disk store.
SHM_SIZE = "1g"
NODES_JOIN_TIMEOUT_S = 180.0
_ALIVE_NODES = (
    "import ray, sys; ray.init(address=sys.argv[1], logging_level='ERROR'); print(sum(n['Alive'] for n in ray.nodes()))"
)


class StackNode(BaseModel):
    container: str
    address: str


class RunningStack(BaseModel):
    stack: str
    network: str
    head: StackNode
    workers: list[StackNode]
    url: str
    metrics_url: str


def _client() -> DockerClient:
    """The Docker SDK is imported when used: without the `stack` extra, the CLI's `docker_engine()` says so."""
    import docker

    return docker.from_env()


def stack_name(path: str) -> str:
    return load_spec(path).stack


def network_name(stack: str) -> str:
    return f"sluice-{stack}"


def _address(container: Container, network: str) -> str:
    container.reload()
    return container.attrs["NetworkSettings"]["Networks"][network]["IPAddress"]


def _put_file(container: Container, source: Path, folder: str) -> str:
    data = io.BytesIO()
    with tarfile.open(fileobj=data, mode="w") as archive:
        archive.add(source, arcname=source.name)
    container.exec_run(["mkdir", "-p", folder])
    container.put_archive(folder, data.getvalue())
    return f"{folder}/{source.name}"


def run_in(container: Container, argv: list[str], say: Callable[[str], None] | None = None) -> tuple[int, str]:
    """Run a command in a node, streaming its lines to `say`; its exit code and whole output."""
    api = container.client.api
    exec_id = api.exec_create(container.id, argv)["Id"]
    lines = []
    for chunk in api.exec_start(exec_id, stream=True):
        for line in chunk.decode(errors="replace").splitlines():
            lines.append(line)
            if say is not None:
                say(line)
    return api.exec_inspect(exec_id)["ExitCode"], "\n".join(lines)


def _start_node(
    client: Any,
    image: str,
    stack: str,
    network: str,
    name: str,
    role: str,
    command: list[str],
    environment: dict[str, str] | None = None,
) -> Any:
    return client.containers.run(
        image,
        command=command,
        name=name,
        hostname=name,
        network=network,
        labels={STACK_LABEL: stack, ROLE_LABEL: role},
        shm_size=SHM_SIZE,
        environment=environment or {},
        detach=True,
    )


def _wait_for_nodes(head: Container, gcs: str, wanted: int, say: Callable[[str], None]) -> None:
    def alive_nodes() -> int | None:
        code, output = run_in(head, ["python", "-c", _ALIVE_NODES, gcs])
        alive = int(output.strip().splitlines()[-1]) if code == 0 and output.strip() else 0
        return alive if alive >= wanted else None

    alive = wait_until(NODES_JOIN_TIMEOUT_S, alive_nodes, f"{wanted} Ray nodes to join", poll_s=2)
    say(f"{alive} Ray nodes alive")


def stack_up(
    path: str,
    nodes: int,
    image: str = image_tag("cpu"),
    worker_cpus: int | None = None,
    say: Callable[[str], None] = print,
) -> RunningStack:
    """The spec's stack on a head and `nodes` workers in containers; raises if it is already up or does not serve."""
    spec = load_spec(path)
    if spec.frontend.tls is not None:
        raise RuntimeError(f"{path}: frontend.tls is not carried into containers yet (its files stay on this host)")
    stack = spec.stack
    client = _client()
    if client.containers.list(all=True, filters={"label": f"{STACK_LABEL}={stack}"}):
        raise RuntimeError(f"stack {stack} is already up: `sluice stack down {path}` first")
    network = network_name(stack)
    client.networks.create(network, driver="bridge", internal=True, labels={STACK_LABEL: stack})
    keys = spec.frontend.protection.api_keys
    # A key variable reaches the frontend through the head's environment; a key file is copied below.
    key_env = {keys.env: os.environ[keys.env]} if keys is not None and keys.env in os.environ else {}
    head = _start_node(client, image, stack, network, f"{network}-head", "head", ["head"], key_env)
    head_address = _address(head, network)
    say(f"head: {head.name} on {head_address}")
    cpus = ["--num-cpus", str(worker_cpus)] if worker_cpus is not None else []
    workers = []
    for index in range(1, nodes + 1):
        name = f"{network}-worker-{index}"
        worker = _start_node(client, image, stack, network, name, "worker", ["worker", "--head", head_address, *cpus])
        workers.append(StackNode(container=name, address=_address(worker, network)))
        say(f"worker: {name} on {workers[-1].address}")
    gcs = f"{head_address}:{RAY_GCS_PORT}"
    _wait_for_nodes(head, gcs, nodes + 1, say)
    spec_in_head = _put_file(head, Path(path).resolve(), SPEC_DIR)
    if keys is not None and keys.file is not None:
        _put_file(head, keys.file.resolve(), str(keys.file.resolve().parent))
    code, _ = run_in(head, ["sluice", "deploy", spec_in_head, "--address", gcs], say)
    if code != 0:
        raise RuntimeError(f"`sluice deploy` on the head failed ({code}); `sluice stack down {path}` cleans up")
    return RunningStack(
        stack=stack,
        network=network,
        head=StackNode(container=head.name, address=head_address),
        workers=workers,
        url=f"http://{head_address}:{spec.frontend.port}",
        metrics_url=f"http://{head_address}:{spec.frontend.metrics_port}",
    )


def stack_status(path: str, as_json: bool = False) -> tuple[int, str]:
    """`sluice status` of the stack, run on its head (exit code, output)."""
    stack = stack_name(path)
    heads = _client().containers.list(filters={"label": [f"{STACK_LABEL}={stack}", f"{ROLE_LABEL}=head"]})
    if not heads:
        return 1, f"stack {stack} is not up: `sluice stack up {path}`"
    head = heads[0]
    gcs = f"{_address(head, network_name(stack))}:{RAY_GCS_PORT}"
    argv = ["sluice", "status", f"{SPEC_DIR}/{Path(path).name}", "--address", gcs]
    return run_in(head, argv + ["--json"] * as_json)


def stack_down(stack: str, say: Callable[[str], None] = print) -> int:
    """Remove the containers and network labelled with this stack; how many containers went."""
    client = _client()
    containers = client.containers.list(all=True, filters={"label": f"{STACK_LABEL}={stack}"})
    for container in containers:
        container.remove(force=True)
        say(f"removed {container.name}")
    for network in client.networks.list(filters={"label": f"{STACK_LABEL}={stack}"}):
        network.remove()
        say(f"removed network {network.name}")
    return len(containers)
