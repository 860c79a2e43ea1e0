"""Closed-loop streaming clients of several tenants on one platform, bounded in count and time: each stream records
its tenant, status, `Retry-After` and reason on a refusal, its time to the first token and whether it reached
`[DONE]`."""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from dataclasses import dataclass, field

import httpx

from base.contracts import PRIORITY_HEADER, RETRY_AFTER_HEADER, SERVE_REASON_HEADER
from tests.support.sse import DONE, astream_lines

# Streams one client sends at most, whatever the run's time allows.
MAX_TURNS = 400
# Answer lengths spread over this range: streams of one length start and end in waves, which hides queueing order.
MAX_TOKENS_RANGE = (8, 48)


@dataclass(frozen=True)
class Clients:
    """`count` clients of tenant `team` (its key), asking for `model` in `priority` (None: the tenant's default)."""

    team: str
    key: str
    model: str
    count: int
    priority: str | None = None


@dataclass
class Stream:
    team: str
    status: int = 0
    reason: str | None = None
    retry_after: str | None = None
    ttft_s: float | None = None
    done: bool = False


@dataclass
class TenantLoad:
    streams: list[Stream] = field(default_factory=list)

    def of(self, team: str) -> list[Stream]:
        return [stream for stream in self.streams if stream.team == team]

    def completed(self, team: str) -> int:
        return sum(stream.status == 200 and stream.done for stream in self.of(team))

    def share(self, team: str) -> float:
        total = sum(self.completed(t) for t in {s.team for s in self.streams})
        return self.completed(team) / total if total else 0.0

    def ttft_p50(self, team: str) -> float:
        return statistics.median(s.ttft_s for s in self.of(team) if s.ttft_s is not None)

    def refusals(self) -> list[Stream]:
        return [stream for stream in self.streams if stream.status != 200]

    def cut(self) -> list[Stream]:
        """Streams answered 200 that did not reach `[DONE]`."""
        return [stream for stream in self.streams if stream.status == 200 and not stream.done]


async def _client(
    http: httpx.AsyncClient, url: str, clients: Clients, stop: float, load: TenantLoad, seed: int
) -> None:
    rng = random.Random(seed)
    headers = {"authorization": f"Bearer {clients.key}"}
    if clients.priority is not None:
        headers[PRIORITY_HEADER] = clients.priority
    for _ in range(MAX_TURNS):
        if time.monotonic() >= stop:
            return
        body = {"model": clients.model, "prompt": "hello", "max_tokens": rng.randint(*MAX_TOKENS_RANGE), "stream": True}
        stream = Stream(team=clients.team)
        load.streams.append(stream)
        began = time.monotonic()
        async with http.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as response:
            stream.status = response.status_code
            stream.reason = response.headers.get(SERVE_REASON_HEADER)
            stream.retry_after = response.headers.get(RETRY_AFTER_HEADER)
            if response.status_code != 200:
                await response.aread()
                await asyncio.sleep(float(stream.retry_after or 1))
                continue
            async for line in astream_lines(response):
                if not line.startswith("data: "):
                    continue
                if stream.ttft_s is None:
                    stream.ttft_s = time.monotonic() - began
                stream.done = line[len("data: ") :] == DONE


async def tenant_load(url: str, groups: list[Clients], run_s: float) -> TenantLoad:
    """Every group's clients streaming one request after another for `run_s` seconds."""
    load = TenantLoad()
    stop = time.monotonic() + run_s
    total = sum(group.count for group in groups)
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=total)) as http:
        await asyncio.gather(
            *(
                _client(http, url, group, stop, load, seed=1000 * g + i)
                for g, group in enumerate(groups)
                for i in range(group.count)
            )
        )
    return load
