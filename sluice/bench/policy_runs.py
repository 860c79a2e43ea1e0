"""One run of `sluice bench policies`: a workload's users against one stack of simulated replicas, and its row.

Every user sends its planned requests one after the other (closed loop) through the stack's HAProxy, the users
starting one after the other over `RAMP_S`; a sampler reads every engine's running and waiting requests each
`LOAD_SAMPLE_S`. The run is bounded by its plan and by `max_s`. The row: the hit rate the engines counted (prefix
cache hits over queries, in tokens, summed over the replicas), the ideal (every request's prompt on one unbounded
cache, in the order they were sent, counted as vLLM counts: whole blocks, at most the prompt less one token), TTFT
p50/p90 (the first content chunk), the load spread (each replica's mean in flight over the run, the largest over the
mean of all), the router's CPU per decision (p99, its route agent's frame read to ACK), and the requests that did
not end in a 2xx stream.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass
from typing import Any

from base.quantiles import quantile
from base.runtime import LOOPBACK
from base.sse import DATA_PREFIX, DONE, LineSplitter
from loadtests.raw_stream import Response, StreamConnection
from routers.kv_index import chain_keys
from routers.prompt_tokens import PromptTokens
from sluice.bench.policy_workloads import PlannedRequest, WorkloadPlan
from sluice.bench.sim_stack import SimPolicyStack

LOAD_SAMPLE_S = 0.25
# Users start one after the other over this long, as a service's users arrive, not all in the first millisecond
# (which would make the first request of every user a miss wherever it went).
RAMP_S = 1.0
CHAT_PATH = "/v1/chat/completions"


@dataclass
class Sent:
    body: dict[str, Any]
    sent_at: float
    ttft_s: float | None = None
    status: int = 0


@dataclass
class PolicyRow:
    replicas: int
    workload: str
    policy: str
    hit_rate: float
    ideal_hit_rate: float
    ttft_p50_ms: float
    ttft_p90_ms: float
    max_mean_load: float
    decision_p99_ms: float
    non_2xx: int
    requests: int

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


async def _send(connection: StreamConnection, planned: PlannedRequest, header: str, sent: list[Sent]) -> None:
    record = Sent(planned.body, time.perf_counter())
    sent.append(record)
    headers = {header: planned.session} if planned.session is not None else {}
    response = Response()
    try:
        splitter = LineSplitter()
        async for chunk in connection.post(CHAT_PATH, json.dumps(planned.body).encode(), headers, response):
            for line in splitter.feed(chunk):
                if not line.startswith(DATA_PREFIX) or line[len(DATA_PREFIX) :] == DONE:
                    continue
                event = json.loads(line[len(DATA_PREFIX) :])
                if record.ttft_s is None and any(c.get("delta", {}).get("content") for c in event["choices"]):
                    record.ttft_s = time.perf_counter() - record.sent_at
    except (OSError, ValueError, TimeoutError, asyncio.IncompleteReadError):
        response.status = 0
    record.status = response.status


async def _user(
    url: tuple[str, int], requests: list[PlannedRequest], header: str, sent: list[Sent], start: float, deadline: float
) -> None:
    await asyncio.sleep(start)
    connection = StreamConnection(*url)
    try:
        for planned in requests:
            if time.perf_counter() > deadline:
                return
            await _send(connection, planned, header, sent)
    finally:
        connection.close()


async def _sample_loads(stack: SimPolicyStack, samples: list[dict[str, int]], stop: asyncio.Event) -> None:
    while not stop.is_set():
        state = await asyncio.to_thread(stack.fleet_state)
        samples.append({replica: figures["running"] + figures["waiting"] for replica, figures in state.items()})
        try:
            await asyncio.wait_for(stop.wait(), LOAD_SAMPLE_S)
        except TimeoutError:
            pass


async def _drive(stack: SimPolicyStack, plan: WorkloadPlan, header: str, max_s: float):  # noqa: ANN202
    sent: list[Sent] = []
    samples: list[dict[str, int]] = []
    stop = asyncio.Event()
    sampler = asyncio.create_task(_sample_loads(stack, samples, stop))
    deadline = time.perf_counter() + max_s
    address = (LOOPBACK, stack.port)
    ramp = RAMP_S / len(plan.users)
    users = (_user(address, user, header, sent, index * ramp, deadline) for index, user in enumerate(plan.users))
    await asyncio.gather(*users)
    stop.set()
    await sampler
    return sent, samples


def ideal_hit_rate(prompts: list[list[int]], answer_ids: list[int], block_size: int) -> float:
    """Hits over queries (tokens) of one unbounded cache fed every prompt in order, with its answer (less the last
    token, which the engine never runs), counted as vLLM counts: whole blocks, at most the prompt less one token."""
    seen: set[int] = set()
    hits = queries = 0
    for tokens in prompts:
        matched = 0
        for key in chain_keys(tokens, block_size):
            if key not in seen:
                break
            matched += 1
        hits += min(matched, (len(tokens) - 1) // block_size) * block_size
        queries += len(tokens)
        seen.update(chain_keys(tokens + answer_ids[:-1], block_size))
    return hits / queries if queries else 0.0


def load_spread(samples: list[dict[str, int]]) -> float:
    """Each replica's mean in flight over the samples; the largest over the mean of all (1.0: even)."""
    if not samples:
        return 0.0
    replicas = samples[0].keys()
    means = [sum(sample.get(replica, 0) for sample in samples) / len(samples) for replica in replicas]
    overall = sum(means) / len(means)
    return max(means) / overall if overall else 0.0


def run_once(
    stack: SimPolicyStack,
    plan: WorkloadPlan,
    tokens: PromptTokens,
    answer_ids: list[int],
    block_size: int,
    max_s: float,
) -> PolicyRow:
    """Drive `plan` through the started `stack` and measure its row."""
    header = stack.router_settings.session_header
    stack.decisions()  # what the health checks' first route calls cost is not the run's
    sent, samples = asyncio.run(_drive(stack, plan, header, max_s))
    state = stack.fleet_state()
    queries = sum(figures["queries"] for figures in state.values())
    hits = sum(figures["hits"] for figures in state.values())
    decisions = stack.decisions()
    ordered = sorted(sent, key=lambda record: record.sent_at)
    prompts = [tokens(json.dumps(record.body).encode()) or [] for record in ordered]
    ttfts = [record.ttft_s for record in sent if record.ttft_s is not None and 200 <= record.status < 300]
    return PolicyRow(
        replicas=stack.count,
        workload=plan.name,
        policy=stack.router_settings.policy,
        hit_rate=round(hits / queries, 4) if queries else 0.0,
        ideal_hit_rate=round(ideal_hit_rate(prompts, answer_ids, block_size), 4),
        ttft_p50_ms=round(quantile(ttfts, 0.5) * 1000, 1) if ttfts else 0.0,
        ttft_p90_ms=round(quantile(ttfts, 0.9) * 1000, 1) if ttfts else 0.0,
        max_mean_load=round(load_spread(samples), 3),
        decision_p99_ms=round(quantile(decisions, 0.99) * 1000, 3) if decisions else 0.0,
        non_2xx=sum(1 for record in sent if not 200 <= record.status < 300 or record.ttft_s is None),
        requests=len(sent),
    )
