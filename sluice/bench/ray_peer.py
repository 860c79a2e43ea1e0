"""Ray 2.60's own HAProxy direct streaming on the tiny model: the peer `sluice bench paths` measures sluice against.

Ray Serve LLM as Ray ships it, on the same model and vLLM settings as sluice's replicas, with one change: the
in-process executor (docs/design.md §5). It runs as its own process with its own Ray cluster, on ports moved off
sluice's, in a private network namespace (`sluice.bench.netns`); it stops on SIGTERM, SIGINT or EOF on its stdin.
Why each setting: `sluice/bench/README.md` (The Ray peer).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil

from base import sse
from base.runtime import LOOPBACK, engine_env, free_port, process_env
from base.tiny_model import SERVED_MODEL_NAME
from base.waiting import WaitTimeout, wait_until
from sluice.bench.netns import in_private_netns

PEER_APP = "ray-peer"
MAX_ONGOING_REQUESTS = 128
REPLICA_CPUS = 0.25
# Serve's direct-ingress replica ports: sluice's stack keeps Ray's defaults (HTTP 30000-31000, gRPC 40000-41000);
# the kernel's ephemeral ports start at 32768.
REPLICA_HTTP_PORTS = (31100, 31999)
REPLICA_GRPC_PORTS = (41100, 41999)
# Every process of one peer (Ray's daemons, workers, HAProxy, vLLM engines) inherits this variable: how the peer
# and its test find what is left of it, even a process that lost its parent.
MARKER_ENV = "SLUICE_RAY_PEER_WORKDIR"
# Ray's unix sockets sit in `<temp dir>/session_<date>_<pid>/sockets/`, and a socket path has at most 107 bytes.
MAX_RAY_TEMP_DIR_LEN = 40
SHUTDOWN_GRACE_S = 60.0
LOG_TAIL_LINES = 40
ENGINE_CLS_NAME = "InProcessVLLMEngine"
# Serve's HTTP (Ray's HAProxy) and gRPC ports, HAProxy's stats and Prometheus pages, Serve's fallback proxy.
PORT_NAMES = ("http", "grpc", "stats", "metrics", "fallback_http", "fallback_grpc")
# By its import name: run with `-m`, this module is `__main__`, which Ray's replicas cannot import.
MODULE = "sluice.bench.ray_peer"


def peer_processes(workdir: Path) -> list[psutil.Process]:
    """Every live process of the peer that ran in `workdir`, found by the variable they all inherit."""
    marker = f"{MARKER_ENV}={workdir.resolve()}"
    found = []
    for process in psutil.process_iter():
        try:
            if process.pid != os.getpid() and marker in (f"{k}={v}" for k, v in process.environ().items()):
                found.append(process)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


@dataclass(frozen=True)
class RayPeer:
    """A running peer: `url` is Ray's HAProxy (OpenAI paths under it), `replica_urls` the replicas' own ports."""

    url: str
    replica_urls: list[str]
    pid: int


@contextmanager
def running_ray_peer(
    model: Path, workdir: Path, replicas: int = 2, timeout_s: float = 300, in_process_executor: bool = True
) -> Iterator[RayPeer]:
    """Run the peer as a subprocess (in this process's network namespace, which must be private) until exit.
    `workdir` gets the peer's log and Ray's temp dir, so it must be short (`MAX_RAY_TEMP_DIR_LEN`). Fails with the
    peer's last log lines if it dies or is not ready in time. On exit: SIGTERM, SIGKILL after `SHUTDOWN_GRACE_S`."""
    workdir.mkdir(parents=True, exist_ok=True)
    ready_file = workdir / "ready.json"
    ready_file.unlink(missing_ok=True)
    log_path = workdir / "ray-peer.log"
    argv = [sys.executable, "-m", MODULE, "--model", str(model), "--workdir", str(workdir)]
    argv += ["--replicas", str(replicas), "--ready-file", str(ready_file), "--timeout-s", str(timeout_s)]
    if not in_process_executor:
        argv.append("--ray-executor")
    with log_path.open("wb") as log:
        process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT)
    try:
        # The peer keeps its own deadline for the app; this one also covers its imports and Ray's start.
        with contextlib.suppress(WaitTimeout):
            wait_until(timeout_s + 30, lambda: ready_file.exists() or process.poll() is not None, "the peer", 0.5)
        if not ready_file.exists():
            state = f"exited with {process.returncode}" if process.poll() is not None else "was not ready"
            raise RuntimeError(f"Ray peer {state} after {timeout_s + 30:.0f}s at most; last log:\n{_tail(log_path)}")
        ready = json.loads(ready_file.read_text())
        yield RayPeer(url=ready["url"], replica_urls=ready["replica_urls"], pid=process.pid)
    finally:
        _stop(process)


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(SHUTDOWN_GRACE_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    if process.stdin is not None:
        process.stdin.close()


def _tail(path: Path) -> str:
    lines = path.read_text(errors="replace").splitlines() if path.exists() else []
    return "\n".join(lines[-LOG_TAIL_LINES:])


def peer_env(model: Path, workdir: Path, haproxy_dir: Path, ports: dict[str, int], in_process: bool) -> dict[str, str]:
    """sluice's process and CPU engine environment (`model`: the tiny model's folder), Ray's HAProxy direct streaming
    on, every port moved (`ports`: free ports for HAProxy's stats and Prometheus pages and Serve's fallback proxy)."""
    env = {**process_env(), **engine_env(str(model.resolve()), gpus=False)}
    env.update(
        {
            MARKER_ENV: str(workdir.resolve()),
            "RAY_SERVE_ENABLE_HA_PROXY": "1",
            "RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING": "1",
            # 2.60 turns token auth on for clusters it starts; the driver then fails with InvalidAuthToken.
            "RAY_AUTH_MODE": "disabled",
            "RAY_SERVE_HAPROXY_STATS_PORT": str(ports["stats"]),
            "RAY_SERVE_HAPROXY_METRICS_PORT": str(ports["metrics"]),
            "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT": str(ports["fallback_http"]),
            "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT": str(ports["fallback_grpc"]),
            "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(REPLICA_HTTP_PORTS[0]),
            "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(REPLICA_HTTP_PORTS[1]),
            "RAY_SERVE_DIRECT_INGRESS_MIN_GRPC_PORT": str(REPLICA_GRPC_PORTS[0]),
            "RAY_SERVE_DIRECT_INGRESS_MAX_GRPC_PORT": str(REPLICA_GRPC_PORTS[1]),
            "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": str(haproxy_dir / "haproxy.cfg"),
            "RAY_SERVE_HAPROXY_SOCKET_PATH": str(haproxy_dir / "admin.sock"),
            "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": str(haproxy_dir),
            "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": str(haproxy_dir / "server-state"),
            "RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH": str(haproxy_dir / "metrics.sock"),
        }
    )
    if in_process:
        env["RAYLLM_VLLM_ENGINE_CLS"] = f"{MODULE}.{ENGINE_CLS_NAME}"
    return env


def llm_config(model: Path, replicas: int) -> dict[str, Any]:
    """Ray Serve LLM's config for the tiny model with sluice's engine settings (`EngineConfig` defaults)."""
    from services.replica.llm_config import EngineConfig

    engine = EngineConfig(model=str(model))
    return {
        "model_loading_config": {"model_id": engine.served_model_name, "model_source": engine.model},
        "accelerator_config": {"kind": "cpu"},
        "placement_group_config": {"bundles": [{"CPU": REPLICA_CPUS}]},
        "engine_kwargs": engine.model_dump(exclude={"model", "served_model_name", "extra_args"}, exclude_none=True),
        "deployment_config": {
            "num_replicas": replicas,
            "max_ongoing_requests": MAX_ONGOING_REQUESTS,
            # Ray adds the replica actor's CPUs (default 1) to the engine's bundle: 1.25 CPUs per replica would not
            # fit two on 2 cores, and sluice's replica is one 0.25-CPU actor.
            "ray_actor_options": {"num_cpus": 0},
        },
    }


@functools.cache
def _in_process_engine_class() -> type:
    from ray.llm._internal.serve.engines.vllm.vllm_engine import VLLMEngine

    class InProcessVLLMEngine(VLLMEngine):
        """Ray's vLLM engine with vLLM's in-process executor ("uni") instead of the forced "mp" one."""

        def _start_async_llm_engine(self, engine_args: Any, engine_config: Any, placement_group: Any) -> Any:
            engine_config.parallel_config.distributed_executor_backend = "uni"
            return super()._start_async_llm_engine(engine_args, engine_config, placement_group)

    InProcessVLLMEngine.__module__ = MODULE
    return InProcessVLLMEngine


def __getattr__(name: str) -> Any:
    # Built on first use (Ray's replica imports it by name): importing this module must not import vLLM.
    if name == ENGINE_CLS_NAME:
        return _in_process_engine_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


async def stream_chat(url: str, timeout_s: float = 30) -> tuple[str, list[str]]:
    """One streamed greedy chat completion (8 tokens): its text and its SSE `data:` payloads."""
    body = {
        "model": SERVED_MODEL_NAME,
        "messages": [{"role": "user", "content": "ka lo mi"}],
        "max_tokens": 8,
        "temperature": 0,
        "stream": True,
    }
    async with httpx.AsyncClient(timeout=timeout_s) as client:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
            response.raise_for_status()
            payloads = sse.data_payloads([line async for line in sse.aiter_lines(response.aiter_bytes())])
    text = "".join(
        choice["delta"].get("content") or ""
        for payload in payloads
        if payload != sse.DONE
        for choice in json.loads(payload)["choices"]
    )
    return text, payloads


def _wait_streaming(url: str, timeout_s: float) -> None:
    """Until a chat completion streams through Ray's HAProxy to `[DONE]` (it reloads as replicas register)."""
    problems = ["nothing tried"]

    def streamed() -> bool:
        try:
            if asyncio.run(stream_chat(url))[1][-1:] == ["[DONE]"]:
                return True
            problems.append("no [DONE]")
        except httpx.HTTPError as error:
            problems.append(repr(error))
        return False

    try:
        wait_until(timeout_s, streamed, f"a chat completion streamed through {url}", poll_s=1)
    except WaitTimeout as error:
        raise WaitTimeout(f"{error}: {problems[-1]}") from None


def _replica_urls() -> list[str]:
    from services.serve_internals import list_replica_endpoints

    endpoints = asyncio.run(list_replica_endpoints(PEER_APP))
    return [e.url for e in endpoints if e.deployment.startswith("LLMServer")]


def _exit_on_signal(*_: Any) -> None:
    raise SystemExit(0)


def _stop_on_signal_or_eof() -> None:
    """SIGTERM, SIGINT or EOF on stdin (the parent went away) unwind the peer through its cleanup, at any stage.
    Installed after `ray.init`, whose own SIGTERM handler would end the process without it."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _exit_on_signal)
    threading.Thread(target=_signal_at_stdin_eof, daemon=True).start()


def _signal_at_stdin_eof() -> None:
    # The raw descriptor, not sys.stdin: a daemon thread blocked inside the buffered reader holds its lock, and the
    # interpreter's shutdown then aborts ("could not acquire lock for <stdin>").
    while os.read(sys.stdin.fileno(), 4096):
        pass
    os.kill(os.getpid(), signal.SIGTERM)


def _reap(workdir: Path, timeout_s: float = 30) -> None:
    """Wait for the peer's processes to end after Ray's shutdown; kill (and name) any that do not."""
    with contextlib.suppress(WaitTimeout):
        wait_until(timeout_s, lambda: not peer_processes(workdir), "the peer's processes to end", poll_s=0.5)
    for process in peer_processes(workdir):
        with contextlib.suppress(psutil.NoSuchProcess):
            print(f"ray peer: killing leftover process {process.pid} {process.cmdline()[:3]}", flush=True)
            process.kill()


def serve_peer(model: Path, workdir: Path, replicas: int, ready_file: Path, timeout_s: float, in_process: bool) -> None:
    """Start the peer's Ray cluster and app, announce it in `ready_file`, serve until told to stop, clean up."""
    ray_temp = workdir.resolve() / "ray"
    if len(str(ray_temp)) > MAX_RAY_TEMP_DIR_LEN:
        raise ValueError(f"{ray_temp}: longer than {MAX_RAY_TEMP_DIR_LEN} characters, Ray's sockets would not fit")
    ray_temp.mkdir(parents=True, exist_ok=True)
    # Ray's HAProxy nests a 56-character node id under this folder before its socket names: keep it short.
    haproxy_dir = Path(tempfile.mkdtemp(prefix="rp-", dir="/tmp"))
    ports = {name: free_port(LOOPBACK) for name in PORT_NAMES}
    env = peer_env(model, workdir, haproxy_dir, ports, in_process)
    os.environ.update(env)
    import ray
    from ray import serve
    from ray.serve.llm import build_openai_app

    try:
        ray.init(
            address="local",
            _node_ip_address=LOOPBACK,
            include_dashboard=False,
            _temp_dir=str(ray_temp),
            runtime_env={"env_vars": env},
            log_to_driver=False,
        )
        _stop_on_signal_or_eof()
        serve.start(http_options={"host": LOOPBACK, "port": ports["http"]}, grpc_options={"port": ports["grpc"]})
        started = time.monotonic()
        serve.run(build_openai_app({"llm_configs": [llm_config(model, replicas)]}), name=PEER_APP, route_prefix="/")
        url = f"http://{LOOPBACK}:{ports['http']}"
        _wait_streaming(url, max(timeout_s - (time.monotonic() - started), 10))
        ready = {"url": url, "replica_urls": _replica_urls(), "ports": ports}
        ready_file.with_suffix(".tmp").write_text(json.dumps(ready))
        ready_file.with_suffix(".tmp").rename(ready_file)
        print(f"ray peer ready in {time.monotonic() - started:.0f}s: {json.dumps(ready)}", flush=True)
        threading.Event().wait()
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)
        if ray.is_initialized():
            serve.shutdown()
            ray.shutdown()
        _reap(workdir)
        shutil.rmtree(haproxy_dir, ignore_errors=True)
        print("ray peer stopped", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sluice.bench.ray_peer", description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="the tiny model's folder (`sluice model build`)")
    parser.add_argument("--workdir", type=Path, required=True, help="Ray's temp dir goes in here (short path)")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--ready-file", type=Path, required=True, help='JSON {"url", "replica_urls"} once serving')
    parser.add_argument("--timeout-s", type=float, default=300)
    parser.add_argument("--ray-executor", action="store_true", help="keep Ray's forced multi-process executor")
    args = parser.parse_args(argv)
    if not in_private_netns():
        print(
            "ray peer: refusing to start outside a private network namespace (Ray's HAProxy mode binds all "
            "interfaces); run it under sluice.bench.netns.private_netns_argv",
            file=sys.stderr,
        )
        return 2
    args.workdir.mkdir(parents=True, exist_ok=True)
    serve_peer(args.model, args.workdir, args.replicas, args.ready_file, args.timeout_s, not args.ray_executor)
    return 0


if __name__ == "__main__":
    sys.exit(main())
