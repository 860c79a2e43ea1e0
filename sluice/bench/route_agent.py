"""The route agent alone (issue 29): sluice's SPOE agent (`RouteListener`) answering with the router's own answer
(`build_router_app`'s, the policy behind it, `AGENT_REPLICAS` static replicas) in a process of its own, fed NOTIFY
frames over `CONNECTIONS` persistent connections, as HAProxy sends them, at fixed rates (open loop) by this process.

Its CPU per decision is what the transport and the decision cost without a Serve replica around them; `sluice bench
paths` measures the same agent inside the router's Serve replica behind a real HAProxy. The gap between the two is
the replica's share. The agent runs uvloop, as Ray runs a replica's event loops. CPU per decision: the agent
process's CPU over a step, less its idle CPU over as long, per decision.
"""

from __future__ import annotations

import asyncio
import select
import subprocess
import sys
import time
from typing import Any

from base.agent_wire import BODY_ARG, MESSAGE, STATUS_VAR
from base.contracts import FRONTEND_HEADER, REQUEST_ID_HEADER
from base.runtime import LOOPBACK

AGENT_RATES = (100, 1000, 2000)
AGENT_STEP_S = 4.0
# HAProxy opens a few connections per agent server (one per thread that has sent a frame).
CONNECTIONS = 4
AGENT_REPLICAS = 8
SESSION_HEADER = "x-session-id"
SESSIONS = 97
HELLO = {"supported-versions": "2.0", "max-frame-size": 16380, "capabilities": "pipelining,async", "engine-id": "b"}
# The agent process imports the router's modules before it prints its port.
AGENT_START_S = 120.0
# Beyond the step itself: the last ACKs of a step must arrive within this.
DRAIN_S = 10.0


def _serve_agent(policy: str) -> None:
    """The agent process (`python -m sluice.bench.route_agent POLICY`): the router's answer for `policy` behind a
    `RouteListener` on a loopback port, which it prints on its first line."""
    import uvloop

    from routers.core import ReplicaView
    from services.router.http_app import build_router_app
    from services.router.route_listener import RouteListener
    from services.router.settings import RouterSettings, build_policy

    endpoint = f"http://{LOOPBACK}:1"  # never called: the agent only names replicas
    views = tuple(ReplicaView(replica_id=f"replica-{i}", endpoint=endpoint) for i in range(AGENT_REPLICAS))
    settings = RouterSettings(target_app="bench-llm", policy=policy)
    app = build_router_app(settings, build_policy(settings), lambda: views)

    async def serve() -> None:
        listener = RouteListener(app.state.answer_route, SESSION_HEADER)
        print(await listener.start(LOOPBACK), flush=True)
        await asyncio.Event().wait()

    uvloop.run(serve())


def _notify(index: int) -> bytes:
    from services.router import spop

    arguments: dict[str, spop.Value] = {
        FRONTEND_HEADER: b"bench-frontend",
        REQUEST_ID_HEADER: f"bench-agent-{index}".encode(),
        SESSION_HEADER: f"session-{index % SESSIONS}".encode(),
        BODY_ARG: b"",
    }
    payload = spop.encode_string(MESSAGE) + bytes((len(arguments),)) + spop.encode_kv_list(arguments)
    return spop.encode_frame(spop.FrameType.NOTIFY, index + 1, 1, payload)


def _decided(frame: bytes) -> bool:
    """Whether an agent's frame is an ACK whose set-var actions answer status 200 (a replica chosen)."""
    from services.router import spop

    decoded = spop.decode_frame(frame)
    if decoded.kind != spop.FrameType.ACK:
        return False
    payload, offset = decoded.payload, 0
    while offset < len(payload):
        name, offset = spop.decode_bytes(payload, offset + 3)  # action type, argument count, scope
        value, offset = spop.decode_value(payload, offset)
        if name.decode() == STATUS_VAR:
            return value == 200
    return False


async def _read_frame(reader: asyncio.StreamReader) -> bytes:
    from services.router import spop

    (length,) = spop.LENGTH.unpack(await reader.readexactly(4))
    return await reader.readexactly(length)


async def send_at_rate(port: int, rate: int, seconds: float) -> int:
    """NOTIFY frames at `rate` for `seconds`, round-robin over `CONNECTIONS` connections; the count of ACKs that chose a
    replica."""
    from services.router import spop

    connections: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    for _ in range(CONNECTIONS):
        reader, writer = await asyncio.open_connection(LOOPBACK, port)
        writer.write(spop.encode_frame(spop.FrameType.HAPROXY_HELLO, 0, 0, spop.encode_kv_list(HELLO)))
        await _read_frame(reader)
        connections.append((reader, writer))
    total = int(rate * seconds)
    acks = 0

    async def read_acks(reader: asyncio.StreamReader, count: int) -> None:
        nonlocal acks
        for _ in range(count):
            frame = await _read_frame(reader)
            acks += _decided(frame)

    readers = [
        asyncio.create_task(read_acks(reader, len(range(i, total, CONNECTIONS))))
        for i, (reader, _) in enumerate(connections)
    ]
    loop = asyncio.get_running_loop()
    started = loop.time()
    try:
        for index in range(total):
            delay = started + index / rate - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            connections[index % CONNECTIONS][1].write(_notify(index))
        await asyncio.wait_for(asyncio.gather(*readers), DRAIN_S)
    finally:
        for task in readers:
            task.cancel()
        for _, writer in connections:
            writer.close()
    return acks


def agent_cpu_per_decision(policies: tuple[str, ...], rates: tuple[int, ...] = AGENT_RATES) -> dict[str, Any]:
    """Per policy and rate: the agent process's CPU µs per decision and its ACKs that chose a replica, of the frames
    sent."""
    import psutil

    from sluice.bench.overhead import cpu_s, cpu_us_per_decision

    results: dict[str, Any] = {}
    for policy in policies:
        # A plain child process, ended and reaped here: multiprocessing would leave its resource tracker behind.
        agent = subprocess.Popen(
            [sys.executable, "-m", "sluice.bench.route_agent", policy], stdout=subprocess.PIPE, text=True
        )
        try:
            assert agent.stdout is not None
            if not select.select([agent.stdout], [], [], AGENT_START_S)[0]:
                raise RuntimeError(f"the route agent did not start within {AGENT_START_S:g} s")
            port = int(agent.stdout.readline())
            process = [psutil.Process(agent.pid)]
            before = cpu_s(process)
            time.sleep(AGENT_STEP_S)
            idle_cpu_s = cpu_s(process) - before
            results[policy] = {}
            for rate in rates:
                before, started = cpu_s(process), time.perf_counter()
                acks = asyncio.run(send_at_rate(port, rate, AGENT_STEP_S))
                elapsed_s = time.perf_counter() - started
                busy_cpu_s = cpu_s(process) - before
                results[policy][str(rate)] = {
                    "frames": int(rate * AGENT_STEP_S),
                    "acks": acks,
                    "cpu_us_per_decision": cpu_us_per_decision(busy_cpu_s, idle_cpu_s, elapsed_s, AGENT_STEP_S, acks),
                }
        finally:
            agent.kill()
            agent.wait(timeout=10)
            if agent.stdout is not None:
                agent.stdout.close()
    return results


def agent_table(results: dict[str, Any]) -> str:
    lines = [f"{'route agent alone':<34}{'req/s':>8}{'ACKs':>10}{'CPU µs/decision':>17}"]
    for policy, by_rate in results.items():
        for rate, entry in by_rate.items():
            acks = f"{entry['acks']}/{entry['frames']}"
            lines.append(f"{policy:<34}{rate:>8}{acks:>10}{entry['cpu_us_per_decision']:>17.0f}")
    return "\n".join(lines)


if __name__ == "__main__":
    _serve_agent(sys.argv[1])
