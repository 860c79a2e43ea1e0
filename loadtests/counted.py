"""A fixed-count closed-loop run: `users` simulated users, each sending exactly `requests_per_user` requests of a
closed-loop workload, in this process (asyncio and httpx), and the same rows a Locust campaign records.

Where a measurement needs the same requests every run rather than load for a time (the routing suite's prefix-cache
figures in CI), a count bounds it: every user draws its prompts and sessions from a seed of its own (`seed` and its
index), and the system prompts from `seed` alone, as Locust's processes do, so a run sends the same requests whatever
the server's speed, and ends when they are answered. Each stream is read as bytes arrive and every line is stamped
with `time.perf_counter()` before parsing (`sse_timing.record_stream`), as the Locust user does.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import httpx

from base import sse
from loadtests.sse_timing import StreamOutput, StreamRow, record_stream
from loadtests.workloads import Conversation, PromptMaker, Request, Workload

# One stream's bound: a request of the tiny model's longest workload answers in seconds.
REQUEST_TIMEOUT_S = 120.0
# A user's seeds: `seed * USER_SEED_STRIDE + user`, apart from every other user's and run's.
USER_SEED_STRIDE = 1000


async def _stream(
    client: httpx.AsyncClient, target: str, workload: str, request: Request, session_header: str
) -> tuple[StreamRow, StreamOutput]:
    headers = {"accept-encoding": "identity", "content-type": "application/json"}
    if session_header and request.send_session:
        headers[session_header] = request.session
    # The body is encoded before the clock starts: TTFT counts the wire and the server, as the Locust user's does.
    body = json.dumps(request.body).encode()
    sent = time.perf_counter()
    row = StreamRow(workload, request.session, sent, sent)
    output = StreamOutput()
    try:
        async with client.stream("POST", f"{target}{request.path}", content=body, headers=headers) as response:
            headers_at = time.perf_counter()
            lines = [(time.perf_counter(), line) async for line in sse.aiter_lines(response.aiter_bytes())]
            output = record_stream(row, response.status_code, dict(response.headers), headers_at, lines)
    except httpx.HTTPError as error:  # a refused connection or a cut stream is a row too
        row.error = type(error).__name__
    return row, output


async def counted_rows(
    workload: str,
    target: str,
    model: str,
    tokenizer: Path,
    users: int,
    requests_per_user: int,
    seed: int,
    session_header: str,
) -> list[StreamRow]:
    """Every user's rows (`requests_per_user` each), in the order they were sent."""
    rows: list[StreamRow] = []

    async def user(index: int, client: httpx.AsyncClient) -> None:
        user_seed = seed * USER_SEED_STRIDE + index
        plan = Workload(workload, model, PromptMaker(tokenizer, seed=user_seed), seed=user_seed, prefix_seed=seed)
        if plan.loop != "closed":
            raise ValueError(f"{workload} is an open-loop workload: a fixed count runs closed-loop ones")
        conversation: Conversation = plan.new_conversation()
        for _ in range(requests_per_user):
            if conversation.turns_left <= 0:
                conversation = plan.new_conversation()
            request = plan.next_request(conversation)
            row, output = await _stream(client, target, workload, request, session_header)
            if workload == "multi_turn":
                row.reusable_tokens = conversation.answered(output)
            rows.append(row)

    limits = httpx.Limits(max_connections=users)
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, limits=limits) as client:
        await asyncio.gather(*(user(index, client) for index in range(users)))
    return sorted(rows, key=lambda row: row.sent_at)
