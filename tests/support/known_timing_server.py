"""An SSE test server with known timing, to check the campaign's measuring code only (never a model server).

Every POST streams `tokens` completion tokens: the first event `ttft_ms` after the request arrived, then one every
`gap_ms`; with `merge` > 1 each event carries that many tokens (what a proxy merging chunks would show). A final
event carries `usage`, then `[DONE]`. `GET /v1/models` names one model. Run: `python -m
tests.support.known_timing_server
--port P [--ttft-ms 50] [--gap-ms 20] [--tokens 16] [--merge 1] [--record FILE]`; it binds 127.0.0.1 only; with
`--record` it appends, per stream, when each event left and the request's prompt and max_tokens. `start(*flags)` runs
one as a subprocess of a test and returns it once it listens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

MODEL = "known-timing"
TTFT_MS, GAP_MS, TOKENS = 50.0, 20.0, 16
ROOT = Path(__file__).resolve().parents[2]


def start(*flags: str) -> tuple[subprocess.Popen, str]:
    """A server with these command-line flags, listening; (its process, its URL)."""
    from base.runtime import free_port
    from base.waiting import WaitTimeout, wait_until

    port = free_port("127.0.0.1")
    process = subprocess.Popen([sys.executable, "-m", __spec__.name, "--port", str(port), *flags], cwd=ROOT)

    def listening() -> bool:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
        except OSError:
            return False
        return True

    try:
        wait_until(20, listening, "the known-timing server to listen", poll_s=0.05)
    except WaitTimeout:
        process.kill()
        raise
    return process, f"http://127.0.0.1:{port}"


def _chunk(text: str) -> bytes:
    """One chunk of a chunked body (how uvicorn and HAProxy send a stream)."""
    data = text.encode()
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


async def _serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, args: argparse.Namespace) -> None:
    """Requests of one keep-alive connection, one after another."""
    try:
        while True:
            await _answer(reader, writer, args)
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


async def _answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, args: argparse.Namespace) -> None:
    head = await reader.readuntil(b"\r\n\r\n")
    loop = asyncio.get_running_loop()
    arrived = loop.time()
    lines = head.decode("latin-1").split("\r\n")
    method = lines[0].split(" ")[0]
    fields = {k.lower(): v for k, _, v in (h.partition(": ") for h in lines[1:])}
    length = int(fields.get("content-length", 0))
    request = await reader.readexactly(length)
    if args.api_key is not None and fields.get("authorization") != f"Bearer {args.api_key}":
        body = json.dumps({"error": {"message": "invalid api key", "type": "invalid_api_key"}}).encode()
        writer.write(
            b"HTTP/1.1 401 Unauthorized\r\ncontent-type: application/json\r\n"
            + f"content-length: {len(body)}\r\n\r\n".encode()
            + body
        )
        await writer.drain()
        return
    if method == "GET":
        body = json.dumps({"object": "list", "data": [{"id": MODEL, "object": "model"}]}).encode()
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
            + f"content-length: {len(body)}\r\n\r\n".encode()
            + body
        )
        await writer.drain()
        return
    writer.write(
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nx-serve-replica: known-1\r\n"
        b"x-serve-path: direct\r\ntransfer-encoding: chunked\r\n\r\n"
    )
    await writer.drain()
    sent = []  # when each event left, on the machine's monotonic clock (the client's perf_counter reads it too)
    for index in range((args.tokens + args.merge - 1) // args.merge):
        due = arrived + (args.ttft_ms + index * args.gap_ms) / 1000
        await asyncio.sleep(max(0.0, due - loop.time()))
        event = {"choices": [{"index": 0, "text": " ka" * args.merge, "finish_reason": None}]}
        writer.write(_chunk(f"data: {json.dumps(event)}\n\n"))
        sent.append(time.perf_counter())
        await writer.drain()
    if args.record:
        # When each event actually left, by session: the truth a client's measures are held to; and what it asked.
        asked = json.loads(request)
        seen = {"session": fields.get("x-session-id", ""), "sent_at": sent}
        seen |= {"prompt": asked.get("prompt"), "max_tokens": asked.get("max_tokens")}
        with open(args.record, "a") as record:
            record.write(json.dumps(seen) + "\n")
    usage = {"prompt_tokens": 16, "completion_tokens": args.tokens, "total_tokens": 16 + args.tokens}
    writer.write(_chunk(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n") + b"0\r\n\r\n")
    await writer.drain()


async def main(args: argparse.Namespace) -> None:
    server = await asyncio.start_server(lambda r, w: _serve(r, w, args), "127.0.0.1", args.port)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--ttft-ms", type=float, default=TTFT_MS)
    parser.add_argument("--gap-ms", type=float, default=GAP_MS)
    parser.add_argument("--tokens", type=int, default=TOKENS)
    parser.add_argument("--merge", type=int, default=1)
    parser.add_argument("--api-key", help="answer 401 to a request without `Authorization: Bearer KEY`")
    parser.add_argument("--record", help="append when each stream's events left (JSONL, perf_counter) to this file")
    asyncio.run(main(parser.parse_args()))
