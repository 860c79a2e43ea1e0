"""`sluice bench overload`: capacity_queue held at OVERLOAD x its capacity for `duration_s`, then idle.

The embedded default's stack with capacity_queue, each replica's capacity (Serve's `max_ongoing_requests`, which the
ledger meters) CAPACITY, on the connected Ray; its frontend asks the routers over SPOE (the usual route call).
OVERLOAD x the replicas' summed capacity closed-loop clients stream MAX_TOKENS-token completions for `duration_s`,
each request stamped when it was sent and when its response began (the ledger granted its token and the replica
streams). Then the load stops, and:

- settling: the ledger's outstanding tokens are read every SETTLE_POLL_S until they equal the streams in flight
  (none once every client ended) and nothing waits: `settled_after_s`, or None past SETTLE_LIMIT_S;
- arrival order: among requests served (2xx) that waited past a wait slice (capacity_queue.WAIT_SLICE_S, after which
  a waiter asks the ledger again), a pair is out of order when the later-sent one began more than ORDER_SLACK_S
  before the earlier one (a response starts an engine step or so after its grant; the step's length varies);
- the requests, the non-2xx by status and reason, those with no response by the client's error, the served requests
  that waited past a slice and the longest wait of one served, and the grants no served request carried
  (`grants_given_back`): a wait that outlasts SPOE's processing timeout is answered over HTTP instead, and a grant to
  the abandoned wait must come back at once (routers/README.md, the ledger actor).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from base.contracts import SERVE_REASON_HEADER
from base.waiting import WaitTimeout, wait_until
from routers.capacity_queue import NAME as CAPACITY_QUEUE
from routers.capacity_queue import WAIT_SLICE_S
from sluice.bench.stack_variants import deploy_variant, ledger_snapshot, non_2xx

CAPACITY = 4  # per replica: small, so a 2-core machine holds OVERLOAD x it in flight and in line
REPLICAS = 2
OVERLOAD = 4
# Long enough that each request's wait in line (about OVERLOAD - 1 service times) passes a wait slice.
MAX_TOKENS = 384
SETTLE_POLL_S = 0.1
SETTLE_LIMIT_S = 60.0
ORDER_SLACK_S = 0.25


@dataclass(frozen=True, slots=True)
class Request:
    sent_s: float
    began_s: float | None  # when the response's headers came; None: no response
    status: int
    reason: str

    @property
    def served(self) -> bool:
        return self.began_s is not None and 200 <= self.status < 300

    @property
    def waited_s(self) -> float | None:
        return None if self.began_s is None else self.began_s - self.sent_s


def out_of_order(requests: list[Request], waited_past_s: float, slack_s: float) -> tuple[int, int]:
    """(pairs out of arrival order, pairs looked at) among the requests served (2xx) that waited past
    `waited_past_s`: a pair is out of order when the one sent later by more than `slack_s` began earlier by more than
    `slack_s`. A refusal is no service: a request whose wait ended in a 503 is left out."""
    waiters = sorted((r for r in requests if r.served and r.sent_s + waited_past_s < r.began_s), key=lambda r: r.sent_s)
    looked_at = inverted = 0
    for i, earlier in enumerate(waiters):
        for later in waiters[i + 1 :]:
            if later.sent_s - earlier.sent_s <= slack_s:
                continue
            if later.sent_s >= earlier.began_s:  # sent after the earlier one began: never waited beside it
                break
            looked_at += 1
            inverted += later.began_s < earlier.began_s - slack_s
    return inverted, looked_at


async def _client(client: httpx.AsyncClient, url: str, body: dict[str, Any], until: float) -> list[Request]:
    requests = []
    while time.perf_counter() < until:
        sent = time.perf_counter()
        try:
            async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
                began = time.perf_counter()
                async for _ in response.aiter_bytes():
                    pass
                reason = response.headers.get(SERVE_REASON_HEADER, "")
                requests.append(Request(sent, began, response.status_code, reason))
        except httpx.HTTPError as error:
            requests.append(Request(sent, None, 0, type(error).__name__))
    return requests


async def _load(url: str, model: str, clients: int, duration_s: float) -> list[Request]:
    body = {"model": model, "prompt": "ka lo mi", "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True}
    until = time.perf_counter() + duration_s
    limits = httpx.Limits(max_connections=clients)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        runs = await asyncio.gather(*(_client(client, url, body, until) for _ in range(clients)))
    return [request for run in runs for request in run]


def _settled_after(plan: Any) -> float | None:
    """Seconds until the ledger holds no token and no waiter (no stream is in flight any more), or None."""

    def settled() -> bool:
        snapshot = ledger_snapshot(plan)
        return snapshot["outstanding"] == 0 and snapshot["waiting"] == 0

    started = time.monotonic()
    try:
        wait_until(SETTLE_LIMIT_S, settled, "the ledger to settle", SETTLE_POLL_S)
    except WaitTimeout:
        return None
    return time.monotonic() - started


def overload(spec_path: Path, out: Path, duration_s: float) -> dict[str, Any]:
    """Run the overload on the connected Ray cluster; returns (and writes to `out/overload.json`) its figures."""
    data = yaml.safe_load(spec_path.read_text())
    data["name"] = "bench-overload"
    for model in data["models"]:
        model["max_ongoing_requests"] = CAPACITY
    plan = deploy_variant(data, CAPACITY_QUEUE, REPLICAS)
    clients = OVERLOAD * CAPACITY * REPLICAS
    try:
        requests = asyncio.run(_load(plan.url, plan.models[0].name, clients, duration_s))
        settled_after_s = _settled_after(plan)
        snapshot = ledger_snapshot(plan)
    finally:
        from sluice.deploy.apply import delete_plan

        delete_plan(plan)
    inverted, looked_at = out_of_order(requests, WAIT_SLICE_S, ORDER_SLACK_S)
    waits = [r.waited_s for r in requests if r.served]
    figures = {
        "duration_s": duration_s,
        "clients": clients,
        "capacity": CAPACITY * REPLICAS,
        "requests": len(requests),
        "non_2xx": non_2xx((r.status, r.reason) for r in requests),
        "no_response": dict(Counter(r.reason for r in requests if r.status == 0)),
        "waited_past_a_slice": sum(w > WAIT_SLICE_S for w in waits),
        "longest_wait_s": max(waits, default=0.0),
        "out_of_order": inverted,
        "waiter_pairs": looked_at,
        "settled_after_s": settled_after_s,
        "grants_given_back": snapshot["granted"] - len(waits),
        "ledger": {key: snapshot[key] for key in ("outstanding", "waiting", "granted", "released", "reaped")},
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "overload.json").write_text(json.dumps(figures, indent=2))
    return figures
