"""`sluice node head | worker --head ADDRESS`: one node of a stack across machines (the image's entrypoint).

Starts Ray in the foreground (`ray start --block`, so the container lives and dies with it) on the node's own
address, with sluice's process environment (`base.runtime.process_env`, which Ray's workers inherit; each LLM replica
adds its engine's, `engine_env`, so a node serves CPU and GPU engines alike) and the node's role as a custom resource
(`base.contracts.HEAD_NODE_RESOURCE` or `WORKER_NODE_RESOURCE`): `sluice deploy` places the frontend and routers on
the head and the LLM replicas on the workers by it.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
from typing import Literal

from base.contracts import HEAD_NODE_RESOURCE, NODE_ROLE_CAPACITY, WORKER_NODE_RESOURCE
from base.runtime import CLUSTER_NODE_ENV, process_env, ray_temp_dir

RAY_GCS_PORT = 6379


def node_address() -> str:
    """This node's address on the stack's network (the container's hostname resolves to it)."""
    return socket.gethostbyname(socket.gethostname())


def ray_start_argv(
    role: Literal["head", "worker"], address: str, head: str | None = None, num_cpus: int | None = None
) -> list[str]:
    resource = HEAD_NODE_RESOURCE if role == "head" else WORKER_NODE_RESOURCE
    argv = [
        "ray",
        "start",
        "--block",
        f"--node-ip-address={address}",
        f"--resources={json.dumps({resource: NODE_ROLE_CAPACITY})}",
        f"--temp-dir={ray_temp_dir()}",
        "--disable-usage-stats",
    ]
    if role == "head":
        argv += ["--head", f"--port={RAY_GCS_PORT}", "--include-dashboard=false"]
    else:
        if head is None:
            raise ValueError("a worker node needs the head's address (--head)")
        argv.append(f"--address={head}:{RAY_GCS_PORT}")
    if num_cpus is not None:
        argv.append(f"--num-cpus={num_cpus}")
    return argv


def node_env(address: str) -> dict[str, str]:
    return {**os.environ, **process_env(), **CLUSTER_NODE_ENV, "VLLM_HOST_IP": address}


def run_node(role: Literal["head", "worker"], head: str | None, num_cpus: int | None) -> None:
    """Replace this process with Ray's node (never returns)."""
    address = node_address()
    argv = ray_start_argv(role, address, head, num_cpus)
    ray_temp_dir().mkdir(parents=True, exist_ok=True)
    print(f"sluice node: {role} on {address}: {' '.join(argv)}", flush=True)
    os.execvpe(shutil.which("ray") or "ray", argv, node_env(address))
