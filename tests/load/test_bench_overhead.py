"""The overhead bench's instruments: the open-loop client keeps its schedule and counts every answer, and the plain
HAProxy it compares against is a config HAProxy accepts, in front of exactly the replica ports it was given."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import time
from pathlib import Path

from infra.haproxy.process import find_haproxy_binary
from sluice.bench.overhead import passthrough_config, post_at_rate

LOOPBACK = "127.0.0.1"


def test_the_open_loop_client_sends_every_request_on_schedule_and_counts_each_status() -> None:
    seen: list[str] = []

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError):
            while True:  # keep-alive: requests one after another until the client closes
                head = await reader.readuntil(b"\r\n\r\n")
                request_id = next(line for line in head.decode().split("\r\n") if line.startswith("x-request-id"))
                seen.append(request_id.split(": ", 1)[1])
                status = b"405 Method Not Allowed" if len(seen) % 4 else b"503 Service Unavailable"
                writer.write(b"HTTP/1.1 " + status + b"\r\ncontent-length: 2\r\n\r\n{}")
                await writer.drain()
        writer.close()

    async def run() -> tuple[list[str], dict[int, int], float]:
        server = await asyncio.start_server(answer, LOOPBACK, 0)
        port = server.sockets[0].getsockname()[1]
        started = time.monotonic()
        try:
            ids, statuses = await post_at_rate(f"http://{LOOPBACK}:{port}", 200, 1.0, "t")
        finally:
            server.close()
        return ids, dict(statuses), time.monotonic() - started

    ids, statuses, took = asyncio.run(run())
    assert len(ids) == 200 and sorted(seen) == sorted(ids)
    assert statuses == {405: 150, 503: 50}
    assert took >= 0.99  # the last request leaves at 199/200 s: the schedule, not as fast as possible


def test_the_plain_haproxy_config_is_valid_and_names_each_replica(tmp_path: Path) -> None:
    urls = ["http://127.0.0.1:31001/app-llm", "http://127.0.0.1:31002/app-llm"]
    config = passthrough_config(30999, urls)
    assert "lua" not in config and "server r0 127.0.0.1:31001" in config and "server r1 127.0.0.1:31002" in config
    assert "set-path /app-llm%[path]" in config
    path = tmp_path / "passthrough.cfg"
    path.write_text(config)
    checked = subprocess.run([str(find_haproxy_binary()), "-c", "-f", str(path)], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stderr
