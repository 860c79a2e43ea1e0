"""`sluice bench routers`, the kv_aware rows: the CPU of one decision, tokenization included, with the tiny model's
real tokenizer and chat template (`PromptTokens`), at about 1k and 8k prompt tokens, 8 replicas whose index holds
every prompt's shared part.

Four shapes: a prompt no replica holds (the router tokenizes its first blocks, finds no holder and stops), a prompt
new to this router that one replica holds (another router sent it there: past the first blocks only that replica can
match, so the router stops there too), one that two replicas hold (the ranking between them needs the whole prompt:
the worst case), and a shared system prompt of that size with a new 16-token question (what `shared_prefix` and
multi-turn traffic look like: the router tokenizes the system prompt once and reuses its pieces). CPU time of this
process, the best of `REPEATS` runs, as the other rows. Goal (issue 25): at most 1 ms at 1k tokens.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from loadtests.workloads import PromptMaker
from routers.core import ReplicaView, RouteRequest
from routers.entry import PolicyContext
from routers.kv_aware import NAME as KV_AWARE
from routers.kv_events import ReplicaEvents
from routers.kv_index import chain_keys
from routers.prompt_tokens import PromptTokens
from routers.registry import build_policy, policy_entry

PROMPT_SIZES = (1024, 8192)
QUESTION_TOKENS = 16
REPLICAS = 8
REPEATS = 3
BLOCK_SIZE = 32


def _decisions(count: int, tokens: int) -> int:
    """Fewer decisions for longer prompts: each run stays around a second."""
    return max(20, count * 1024 // tokens)


def _body(system: str, question: str) -> bytes:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    return json.dumps({"model": "sluice-tiny", "messages": messages}).encode()


# Each shape and how many replicas the index says hold each prompt's system part.
SHAPES = {
    "new prompt": 0,
    "new to this router, held by one replica": 1,
    "new to this router, held by two replicas": 2,
    "shared system prompt": 1,
}


def kv_aware_decision_us(model_dir: Path, tokens: int, shape: str, count: int = 200) -> float:
    prompts = PromptMaker(model_dir / "tokenizer.json", seed=tokens)
    tokenize = PromptTokens(str(model_dir))
    # The engines' side: their own tokenizer (this router's would cache every piece before the timed run).
    engines_tokenize = PromptTokens(str(model_dir))
    policy = build_policy(KV_AWARE, {}, PolicyContext(tokenize=tokenize))
    # The index the router's KV event subscriber would feed (kv_aware's entry has the hook).
    events = policy_entry(KV_AWARE).kv_event_target(policy)  # type: ignore[misc]
    events.block_size = BLOCK_SIZE
    views = tuple(ReplicaView(replica_id=f"replica-{i:02d}", capacity=1_000_000) for i in range(REPLICAS))
    for view in views:
        events.sources[view.replica_id] = ReplicaEvents.EVENTS
    decisions = _decisions(count, tokens)
    system = prompts.prompt(tokens)
    shared = shape == "shared system prompt"
    runs = []
    for run in range(REPEATS):
        bodies = [
            _body(system if shared else prompts.prompt(tokens), prompts.prompt(QUESTION_TOKENS))
            for _ in range(decisions)
        ]
        # The index holds each prompt's system part on the shape's replicas, as the engines' events would say.
        for i, body in enumerate(bodies if SHAPES[shape] else ()):
            prompt = engines_tokenize(body) or []
            keys = len(chain_keys(prompt[: tokens // BLOCK_SIZE * BLOCK_SIZE], BLOCK_SIZE))
            for holder in range(SHAPES[shape]):
                engine_hashes = [f"{run}-{i}-{holder}-{k}" for k in range(keys)]
                replica_id = views[(i + holder) % REPLICAS].replica_id
                events.index.stored(replica_id, engine_hashes, None, prompt, BLOCK_SIZE)
        tokenize(bodies[0])  # a shared system prompt's pieces are cached after the first request, as in a router
        requests = [RouteRequest(request_id=f"{run}-{i}", body_prefix=body) for i, body in enumerate(bodies)]
        start = time.process_time()
        for request in requests:
            policy.rank(views, request)
            policy.on_completed(request.request_id, "")
        runs.append((time.process_time() - start) / decisions * 1e6)
    return min(runs)


def run_kv_aware_bench(model_dir: Path) -> list[tuple[str, float]]:
    """(label, µs per decision) of each shape and size."""
    rows = []
    for tokens in PROMPT_SIZES:
        for shape in SHAPES:
            label = f"kv_aware {tokens // 1024}k tokens, {shape}"
            rows.append((label, kv_aware_decision_us(model_dir, tokens, shape)))
    return rows
