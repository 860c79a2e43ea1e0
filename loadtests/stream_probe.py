"""Measure TTFT and token throughput of SSE completions against one or more base URLs (HTTP, or HTTPS with `verify`).

Each line is stamped with `time.perf_counter()` as it arrives, before parsing (docs/design.md §5), and the request
asks for `Accept-Encoding: identity` so nothing buffers the stream.
"""

from __future__ import annotations

import asyncio
import json
import ssl
import statistics
import time

import httpx
from pydantic import BaseModel

from base import sse
from base.contracts import REPLICA_HEADER, SERVE_PATH_HEADER
from base.quantiles import quantile

DEFAULT_PROMPT = "ka lo mi ne ru"


class StreamResult(BaseModel):
    # Send to the response headers (what a generic HTTP tool reports) and to the first token.
    headers_s: float = 0.0
    ttft_s: float
    total_s: float
    completion_tokens: int
    # Seconds between consecutive token-carrying events after the first (inter-token latency).
    token_gaps_s: list[float] = []

    @property
    def decode_tokens_per_s(self) -> float:
        decode_s = self.total_s - self.ttft_s
        return (self.completion_tokens - 1) / decode_s if decode_s > 0 else 0.0


class ProbeReport(BaseModel):
    streams: int
    max_tokens: int
    wall_s: float
    ttft_p50_ms: float
    ttft_max_ms: float
    per_stream_tokens_per_s: float
    aggregate_tokens_per_s: float


async def one_stream(
    client: httpx.AsyncClient, url: str, model: str, max_tokens: int, prompt: str | list[int] = DEFAULT_PROMPT
) -> StreamResult:
    """One streamed completion; `prompt` is text or token ids."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    first_token_at: float | None = None
    last_token_at = start
    gaps: list[float] = []
    tokens = 0
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        headers_at = time.perf_counter()
        response.raise_for_status()
        async for line in sse.aiter_lines(response.aiter_bytes()):
            now = time.perf_counter()
            if not line.startswith(sse.DATA_PREFIX) or line == sse.DATA_PREFIX + sse.DONE:
                continue
            try:
                chunk = json.loads(line[len(sse.DATA_PREFIX) :])
            except json.JSONDecodeError as error:
                served = {name: response.headers.get(name) for name in (REPLICA_HEADER, SERVE_PATH_HEADER)}
                raise RuntimeError(f"{url}: an event cut mid-stream ({served}): {line!r}") from error
            if chunk["choices"] and chunk["choices"][0]["text"]:
                if first_token_at is None:
                    first_token_at = now
                else:
                    gaps.append(now - last_token_at)
                last_token_at = now
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    end = time.perf_counter()
    if first_token_at is None:
        raise RuntimeError(f"{url}: stream carried no tokens")
    return StreamResult(
        headers_s=headers_at - start,
        ttft_s=first_token_at - start,
        total_s=end - start,
        completion_tokens=tokens,
        token_gaps_s=gaps,
    )


async def probe(
    urls: list[str],
    model: str,
    streams: int,
    max_tokens: int,
    timeout_s: float = 300,
    verify: ssl.SSLContext | bool = True,
    extra_headers: dict[str, str] | None = None,
) -> ProbeReport:
    """Run `streams` concurrent streams spread round-robin over `urls` and summarise them (`verify`: what an https
    URL's certificate is checked against; `extra_headers`: sent on every request, e.g. the internal credential of a
    replica's own port)."""
    limits = httpx.Limits(max_connections=streams)
    headers = {"accept-encoding": "identity", **(extra_headers or {})}
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits, headers=headers, verify=verify) as client:
        start = time.perf_counter()
        results = await asyncio.gather(
            *(one_stream(client, urls[i % len(urls)], model, max_tokens) for i in range(streams))
        )
        wall = time.perf_counter() - start
    ttfts = [r.ttft_s * 1000 for r in results]
    return ProbeReport(
        streams=streams,
        max_tokens=max_tokens,
        wall_s=wall,
        ttft_p50_ms=quantile(ttfts, 0.5),
        ttft_max_ms=max(ttfts),
        per_stream_tokens_per_s=statistics.mean(r.decode_tokens_per_s for r in results),
        aggregate_tokens_per_s=sum(r.completion_tokens for r in results) / wall,
    )
