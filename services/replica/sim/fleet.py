"""Many simulated replicas in one process (a benchmark stand-in): `SimFleet`, and `python -m
services.replica.sim.fleet` to run one.

Each replica is a `SimEngine` with its own KV cache, its own KV event publisher (ZMQ, vLLM's wire format, with
replay) and its own HTTP port on loopback; all of them share one event loop, one uvicorn server (a socket per
replica: the app a request reaches is the one of the port it came in on) and one tokenizer, so 64 replicas cost one
process. An idle engine costs nothing; a busy one wakes once per simulated step.

The process prints one JSON line, `{"replicas": [{"replica_id", "host", "port"}, ...], "control_port"}`, once every
port listens, then serves until SIGTERM or until its standard input closes (its parent went away). The internal
credential the replicas require (as a real replica does behind HAProxy) comes from `CREDENTIAL_ENV`, never from the
command line. The control port answers `FLEET_STATE_PATH`: every engine's running and waiting requests and prefix cache
queries and hits, in one read (what a benchmark samples; the same figures are on each replica's `/metrics`).
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from base.route_wire import KVEventSource
from base.runtime import LOOPBACK
from routers.prompt_tokens import PromptTokens
from services.internal_credential import InternalCredentialMiddleware
from services.replica.sim.engine import SimEngine
from services.replica.sim.kv_publisher import SimKVPublisher
from services.replica.sim.model import SimModel
from services.replica.sim.openai_app import SimOpenAIApp, answer_tokens
from services.socket_server import SocketServer, bound_listener, until_told_to_stop

CREDENTIAL_ENV = "SLUICE_SIM_INTERNAL_CREDENTIAL"
FLEET_STATE_PATH = "/fleet/state"


@dataclass(frozen=True)
class SimReplica:
    replica_id: str
    host: str
    port: int


class _ByPort:
    """The ASGI app of the port a request came in on."""

    def __init__(self, apps: dict[int, object]) -> None:
        self.apps = apps

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            message = await receive()
            while message["type"] != "lifespan.shutdown":
                await send({"type": f"{message['type']}.complete"})
                message = await receive()
            await send({"type": "lifespan.shutdown.complete"})
            return
        await self.apps[scope["server"][1]](scope, receive, send)  # type: ignore[operator]


class SimFleet:
    def __init__(
        self,
        replicas: int,
        model_path: str,
        served_name: str,
        model: SimModel | None = None,
        credential: str | None = None,
        kv_events: bool = True,
        host: str = LOOPBACK,
    ) -> None:
        self.model = model or SimModel()
        self.host = host
        self.served_name = served_name
        self.credential = credential
        self.kv_events = kv_events
        self.count = replicas
        self.tokens = PromptTokens(model_path)
        self.token_text = answer_tokens(self.tokens)
        self.output_token_ids = list(self.token_text)
        self.engines: dict[str, SimEngine] = {}
        self.publishers: list[SimKVPublisher] = []
        self.replicas: list[SimReplica] = []
        self.control_port: int | None = None
        self._server: SocketServer | None = None

    async def start(self) -> list[SimReplica]:
        apps: dict[int, object] = {}
        sockets = []
        for index in range(self.count):
            replica_id = f"sim-{index:02d}"
            source = None
            publish = None
            if self.kv_events:
                publisher = SimKVPublisher()
                await publisher.start(self.host)
                self.publishers.append(publisher)
                publish = publisher.publish
                source = KVEventSource(
                    endpoint=publisher.endpoint, replay_endpoint=publisher.replay_endpoint, topic=publisher.topic
                )
            engine = SimEngine(self.model, publish=publish, output_token_ids=self.output_token_ids)
            self.engines[replica_id] = engine
            app = SimOpenAIApp(engine, self.tokens, self.served_name, replica_id, source, self.token_text).app
            listener = bound_listener(self.host)
            port = listener.getsockname()[1]
            sockets.append(listener)
            apps[port] = InternalCredentialMiddleware(app, self.credential) if self.credential else app
            self.replicas.append(SimReplica(replica_id, self.host, port))
        control = bound_listener(self.host)
        self.control_port = control.getsockname()[1]
        sockets.append(control)
        apps[self.control_port] = Starlette(routes=[Route(FLEET_STATE_PATH, self.state, methods=["GET"])])
        self._server = SocketServer(_ByPort(apps), sockets, lifespan="on", backlog=4096)
        await self._server.start()
        return self.replicas

    async def state(self, request: Request) -> JSONResponse:
        figures = {}
        for replica_id, engine in self.engines.items():
            load = engine.load()
            figures[replica_id] = {
                "running": load.running,
                "waiting": load.waiting,
                "queries": engine.cache.queries,
                "hits": engine.cache.hits,
            }
        return JSONResponse(figures)

    async def close(self) -> None:
        if self._server is not None:
            await self._server.stop()
        for publisher in self.publishers:
            publisher.close()


async def _run(args: argparse.Namespace) -> None:
    model = SimModel(**json.loads(args.sim_model)) if args.sim_model else SimModel()
    fleet = SimFleet(
        args.replicas,
        args.model_path,
        args.served_name,
        model,
        credential=os.environ.get(CREDENTIAL_ENV),
        kv_events=not args.no_kv_events,
    )
    replicas = await fleet.start()
    answer = {"replicas": [vars(replica) for replica in replicas], "control_port": fleet.control_port}
    print(json.dumps(answer), flush=True)
    await until_told_to_stop()
    await fleet.close()


def main() -> None:
    parser = argparse.ArgumentParser(description="simulated vLLM replicas (a benchmark stand-in) in one process")
    parser.add_argument("--replicas", type=int, required=True)
    parser.add_argument("--model-path", required=True, help="the served model's tokenizer and chat template")
    parser.add_argument("--served-name", required=True)
    parser.add_argument("--sim-model", help="SimModel fields as JSON (default: the stated model)")
    parser.add_argument("--no-kv-events", action="store_true")
    import uvloop

    uvloop.run(_run(parser.parse_args()))


if __name__ == "__main__":
    main()
