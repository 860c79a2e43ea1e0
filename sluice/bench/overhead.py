"""The direct path's overhead, part by part (`sluice bench paths` runs it on the stack it measures): HAProxy alone
(`passthrough_haproxy`), the route call as HAProxy's Lua action times it at fixed open-loop rates, and the router's
CPU per decision. Details: `sluice/bench/README.md`."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import subprocess
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import psutil

from base.quantiles import quantile
from base.runtime import LOOPBACK, free_port
from base.waiting import WaitTimeout, wait_until
from infra.haproxy.process import find_haproxy_binary
from routers.round_robin import NAME as ROUND_ROBIN

RATES = (100, 1000, 5000)
RATE_STEP_S = 4.0
# Keep-alive connections the open-loop client may hold: enough that a slow answer never delays the next request.
MAX_CONNECTIONS = 256
ROUTED_CHEAP_PATH = "/v1/models"


def variant_label(policy: str, routers: int, tables: bool = False) -> str:
    """A router variant the route decision is measured on: its policy, router replica count, and whether the frontend
    decides from the routers' table (no route call) or makes a route call per request."""
    return f"{policy} x{routers}{' tables' if tables else ''}"


# The stack's own router (the embedded default's policy, one router replica, table decisions): the routing goals are
# judged here.
DEFAULT_VARIANT = variant_label(ROUND_ROBIN, 1, tables=True)


def passthrough_config(port: int, replica_urls: list[str]) -> str:
    """HAProxy in front of the replica ports with nothing of sluice's: no Lua, no route call, no stick tables."""
    servers = []
    for index, url in enumerate(replica_urls):
        parts = urlsplit(url)
        servers.append(f"    server r{index} {parts.netloc}")
    prefix = urlsplit(replica_urls[0]).path
    return "\n".join(
        [
            "global",
            "    maxconn 4096",
            "defaults",
            "    mode http",
            "    option http-no-delay",
            "    timeout connect 5s",
            "    timeout client 3600s",
            "    timeout server 3600s",
            "frontend passthrough",
            f"    bind {LOOPBACK}:{port}",
            f"    http-request set-path {prefix}%[path]" if prefix else "",
            "    default_backend replicas",
            "backend replicas",
            "    balance roundrobin",
            *servers,
            "",
        ]
    )


@contextlib.contextmanager
def passthrough_haproxy(folder: Path, replica_urls: list[str]) -> Iterator[str]:
    """A plain HAProxy process (started here, ended here by its PID) in front of `replica_urls`; yields its URL."""
    port = free_port(LOOPBACK)
    config = folder / "passthrough.cfg"
    config.write_text(passthrough_config(port, replica_urls))
    process = subprocess.Popen([str(find_haproxy_binary()), "-db", "-f", str(config)])
    try:
        try:
            wait_until(10, lambda: process.poll() is not None or _listening(port), "HAProxy to listen", poll_s=0.05)
        except WaitTimeout:
            pass
        if process.poll() is not None or not _listening(port):
            raise RuntimeError(f"the pass-through HAProxy did not start (exit {process.poll()})")
        yield f"http://{LOOPBACK}:{port}"
    finally:
        process.terminate()
        try:
            process.wait(5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _listening(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection((LOOPBACK, port), 1):
        return True
    return False


async def _exchange(connection: tuple[asyncio.StreamReader, asyncio.StreamWriter], request: bytes) -> tuple[int, bool]:
    """One request on a keep-alive connection: its status, and whether the connection may be reused."""
    reader, writer = connection
    writer.write(request)
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
    status = int(lines[0].split(" ", 2)[1])
    if "content-length" not in headers:
        await reader.read()
        return status, False
    await reader.readexactly(int(headers["content-length"]))
    return status, headers.get("connection", "").lower() != "close"


async def post_at_rate(url: str, rate: int, seconds: float, id_prefix: str) -> tuple[list[str], Counter[int]]:
    """Open loop: request i leaves at start + i / rate, whatever the earlier ones are doing. Returns the request ids
    sent and the count of each status."""
    parts = urlsplit(url)
    host, port = parts.hostname or LOOPBACK, parts.port or 80
    idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    opened: list[asyncio.StreamWriter] = []
    slots = asyncio.Semaphore(MAX_CONNECTIONS)
    statuses: Counter[int] = Counter()
    ids = [f"{id_prefix}-{i}" for i in range(int(rate * seconds))]

    async def one(request_id: str) -> None:
        async with slots:
            if idle:
                connection = idle.pop()
            else:
                connection = await asyncio.open_connection(host, port)
                opened.append(connection[1])
            request = (
                f"POST {ROUTED_CHEAP_PATH} HTTP/1.1\r\nHost: {host}:{port}\r\nx-request-id: {request_id}\r\n"
                "content-length: 0\r\n\r\n"
            ).encode()
            try:
                status, reusable = await _exchange(connection, request)
            except (OSError, asyncio.IncompleteReadError):
                status, reusable = 0, False
            statuses[status] += 1
            if reusable:
                idle.append(connection)
            else:
                connection[1].close()

    loop = asyncio.get_running_loop()
    started = loop.time()
    tasks = []
    for index, request_id in enumerate(ids):
        delay = started + index / rate - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(request_id)))
    await asyncio.gather(*tasks)
    for writer in opened:
        writer.close()
    return ids, statuses


def router_processes(router_app: str) -> list[psutil.Process]:
    """The processes of the router app's replicas."""
    found = [
        process
        for process in psutil.process_iter(["cmdline"])
        if " ".join(process.info["cmdline"] or []).startswith(f"ray::ServeReplica:{router_app}:")
    ]
    if not found:
        raise RuntimeError(f"no process of router app {router_app}")
    return found


def cpu_s(processes: list[psutil.Process]) -> float:
    return sum(times.user + times.system for times in (process.cpu_times() for process in processes))


def cpu_us_per_decision(busy_cpu_s: float, idle_cpu_s: float, elapsed_s: float, idle_s: float, decisions: int) -> float:
    """CPU µs per decision over a step of `elapsed_s`: its CPU less the idle CPU (measured over `idle_s`) over as
    long."""
    return max(busy_cpu_s - idle_cpu_s * elapsed_s / idle_s, 0.0) / max(decisions, 1) * 1e6


def route_call_rates(url: str, frontend: Any, router_app: str) -> dict[str, Any]:
    """Route decision p50/p99 as timed inside HAProxy's Lua action, the routers' CPU per decision (all of the app's
    router replicas together) and HAProxy's worker's CPU per request, at each rate; with the rate the client reached
    (it may fall short at the highest)."""
    router = router_processes(router_app)
    haproxy = [psutil.Process(frontend.status.remote().result(timeout_s=30)["worker_pid"])]
    before, haproxy_before = cpu_s(router), cpu_s(haproxy)
    time.sleep(RATE_STEP_S)
    idle_cpu_s, haproxy_idle_s = cpu_s(router) - before, cpu_s(haproxy) - haproxy_before
    results: dict[str, Any] = {}
    for rate in RATES:
        before, haproxy_before = cpu_s(router), cpu_s(haproxy)
        sent_at = time.perf_counter()
        ids, statuses = asyncio.run(post_at_rate(url, rate, RATE_STEP_S, f"bench-rate-{rate}-{time.time_ns()}"))
        elapsed_s = time.perf_counter() - sent_at
        busy_cpu_s, haproxy_busy_s = cpu_s(router) - before, cpu_s(haproxy) - haproxy_before
        time.sleep(0.5)  # the frontend logs a request once it has ended
        records = frontend.requests.remote(ids).result(timeout_s=60)
        route_ms = [r["route_s"] * 1000 for r in records if r["route_s"] is not None]
        if not route_ms:
            raise RuntimeError(f"no route call was logged at {rate} req/s (statuses {dict(statuses)})")
        results[str(rate)] = {
            "requests": len(ids),
            "reached_req_per_s": len(ids) / elapsed_s,
            "statuses": {str(k): v for k, v in sorted(statuses.items())},
            "route_p50_ms": quantile(route_ms, 0.5),
            "route_p99_ms": quantile(route_ms, 0.99),
            "router_cpu_us_per_decision": cpu_us_per_decision(
                busy_cpu_s, idle_cpu_s, elapsed_s, RATE_STEP_S, len(route_ms)
            ),
            "haproxy_cpu_us_per_request": cpu_us_per_decision(
                haproxy_busy_s, haproxy_idle_s, elapsed_s, RATE_STEP_S, len(ids)
            ),
        }
    return results


def rates_table(variants: dict[str, Any]) -> str:
    head = (
        f"{'routers':<26}{'req/s':>6}{'reached':>9}{'route p50 ms':>14}{'route p99 ms':>14}{'router µs/decision':>20}"
        f"{'HAProxy µs/request':>20}"
    )
    lines = [head + "  statuses"]
    for variant, results in variants.items():
        for rate, entry in results.items():
            lines.append(
                f"{variant:<26}{rate:>6}{entry['reached_req_per_s']:>9.0f}{entry['route_p50_ms']:>14.2f}"
                f"{entry['route_p99_ms']:>14.2f}{entry['router_cpu_us_per_decision']:>20.0f}"
                f"{entry['haproxy_cpu_us_per_request']:>20.0f}  {entry['statuses']}"
            )
    return "\n".join(lines)
