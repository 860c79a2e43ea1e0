"""The router process of `sluice bench policies` (`python -m sluice.bench.policy_router`): the router's own runtime
(`services.router.runtime.RouterRuntime`: the policy, the KV event subscriber, the engine load poller, the HTTP app
and the route agent) over the simulated replicas, with no Serve around it.

It reads one JSON line on standard input: `{"settings": RouterSettings, "replicas": [{"replica_id", "host",
"port"}]}`; the internal credential comes from `CREDENTIAL_ENV`. It prints one JSON line, `{"port", "route_port"}`
(the HTTP app, the route agent), once both listen, and runs until its standard input closes. Beside the router's
paths it answers Serve's health path (HAProxy checks it there), `DECISIONS_PATH`: the CPU seconds of each decision
the route agent answered since the last call (then forgets them), and `DESCRIBE_PATH` (what `sluice status` reads
from a router: the policy, its report, the shadows').
"""

from __future__ import annotations

import json
import os
import sys

from fastapi import Response

from base.contracts import HEALTH_PATH
from base.runtime import LOOPBACK
from services.replica.sim.fleet import CREDENTIAL_ENV
from services.router.runtime import RouterRuntime
from services.router.settings import RouterSettings
from services.serve_internals import ReplicaEndpoint
from services.socket_server import SocketServer, bound_listener, until_told_to_stop

DECISIONS_PATH = "/bench/decisions"
# The runtime's `describe()`: the policy, its report and the shadows'.
DESCRIBE_PATH = "/bench/describe"
# The deployment name the endpoints carry (Serve's for an LLM app).
SIM_DEPLOYMENT = "LLMServer"


async def _serve(line: str, credential: str) -> None:
    spec = json.loads(line)
    settings = RouterSettings.model_validate(spec["settings"])
    endpoints = [ReplicaEndpoint(deployment=SIM_DEPLOYMENT, **replica) for replica in spec["replicas"]]

    async def replicas() -> list[ReplicaEndpoint]:
        return endpoints

    decisions: list[float] = []
    runtime = RouterRuntime(settings, replicas, credential, observe_decision=decisions.append)
    route_port = await runtime.start(LOOPBACK)
    app = runtime.app
    assert app is not None

    @app.get(HEALTH_PATH)
    async def health() -> Response:
        return Response(status_code=200)

    @app.get(DECISIONS_PATH)
    async def taken() -> Response:
        seconds = list(decisions)
        decisions.clear()
        return Response(json.dumps({"seconds": seconds}), media_type="application/json")

    @app.get(DESCRIBE_PATH)
    async def described() -> Response:
        return Response(json.dumps(runtime.describe()), media_type="application/json")

    listener = bound_listener(LOOPBACK)
    server = SocketServer(app, [listener])
    await server.start()
    print(json.dumps({"port": listener.getsockname()[1], "route_port": route_port}), flush=True)
    await until_told_to_stop()
    await server.stop()
    await runtime.close()


def main() -> None:
    import uvloop

    line = sys.stdin.readline()
    uvloop.run(_serve(line, os.environ[CREDENTIAL_ENV]))


if __name__ == "__main__":
    main()
