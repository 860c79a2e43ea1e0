"""kv_aware on token load: with every engine's load reported, the cost is the prefill left after the cached prefix
plus the replica's token load; a hot prefix spills once its KV outweighs a whole prefill; a replica at capacity is
never the primary; a stale report falls back to in-flight counts; the prompt is read only as far as the ranking
needs; and the load book's own arithmetic (waiting requests, placements since the report, staleness)."""

from __future__ import annotations

import json
from collections import Counter

from routers.core import ReplicaView, RouteRequest
from routers.engine_load import PLACEMENT_TTL_S, STALE_AFTER_S, EngineLoads, TokenLoad
from routers.kv_aware import KVAware
from routers.kv_events import ReplicaEvents

BLOCK = 4
VIEWS = tuple(ReplicaView(replica_id=r, capacity=64) for r in ("a", "b", "c"))
PROMPT = list(range(64))


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _tokens(body: bytes, read_on: object = None) -> list[int] | None:
    parsed = json.loads(body)
    return parsed if isinstance(parsed, list) else None


def _policy(clock: _Clock, tokenize=_tokens) -> KVAware:  # noqa: ANN001
    """Prefill and running KV weighed one to one, so the arithmetic reads plainly (the defaults are tested apart)."""
    policy = KVAware(tokenize, decode_weight=1.0, prefix_weight=1.0)
    policy.block_size = BLOCK
    policy.engine_loads = EngineLoads(clock=clock)
    for view in VIEWS:
        policy.sources[view.replica_id] = ReplicaEvents.EVENTS
    return policy


def _store(policy: KVAware, replica: str, tokens: list[int]) -> None:
    hashes = [f"{replica}-{i}" for i in range(len(tokens) // BLOCK)]
    policy.index.stored(replica, hashes, None, tokens, BLOCK)


def _report(policy: KVAware, **loads: int) -> None:
    for replica, tokens in loads.items():
        policy.engine_loads.reported(replica, kv_tokens_used=tokens, waiting=0, prefill_tokens_pending=0)


def _primary(policy: KVAware, tokens: list[int], n: int, views=VIEWS) -> str:  # noqa: ANN001
    request = RouteRequest(request_id=f"r{n}", body_prefix=json.dumps(tokens).encode())
    return policy.rank(views, request)[0][0].replica_id


def test_a_cached_prefix_wins_until_its_replica_holds_more_tokens_than_the_prefill_it_saves() -> None:
    policy = _policy(_Clock())
    _store(policy, "a", PROMPT)  # 64 tokens cached on a: 60 of them usable (the last token is always computed)
    _report(policy, a=50, b=0, c=0)
    assert _primary(policy, PROMPT, 0) == "a"
    assert policy.counts.last_reason == "match"
    _report(policy, a=100, b=0, c=0)
    assert _primary(policy, PROMPT, 1) != "a", "64 tokens of KV more than the others outweigh a 64-token prefill"
    assert policy.counts.last_reason == "saturated"


def test_placements_since_the_last_report_count_so_a_burst_spreads_before_the_next_report() -> None:
    policy = _policy(_Clock())
    _store(policy, "a", PROMPT)
    _report(policy, a=0, b=0, c=0)
    primaries = Counter(_primary(policy, PROMPT, n) for n in range(9))
    assert primaries["a"] >= 2, "the replica caching the prefix takes the first requests"
    assert len(primaries) == 3, f"a burst of one hot prefix reaches every replica: {primaries}"


def test_a_replica_at_its_capacity_is_never_the_primary_even_with_the_whole_prefix() -> None:
    policy = _policy(_Clock())
    _store(policy, "a", PROMPT)
    _report(policy, a=0, b=500, c=500)
    full = (ReplicaView(replica_id="a", capacity=1, in_flight=1, in_flight_sampled=True), *VIEWS[1:])
    assert _primary(policy, PROMPT, 0, full) != "a"


def test_without_a_fresh_report_from_every_replica_the_policy_ranks_by_in_flight_counts() -> None:
    clock = _Clock()
    policy = _policy(clock)
    _store(policy, "a", PROMPT)
    _report(policy, a=10_000, b=0, c=0)
    assert _primary(policy, PROMPT, 0) != "a", "by token load the loaded replica loses"
    clock.now += STALE_AFTER_S + 1
    assert _primary(policy, PROMPT, 1) == "a", "stale reports: the longest match wins, as by in-flight counts"


def test_the_prompt_is_read_only_while_the_one_replica_holding_it_has_not_won_yet() -> None:
    reads: list[int] = []

    def tokenize(body: bytes, read_on) -> list[int] | None:  # noqa: ANN001
        tokens = json.loads(body)
        for end in range(BLOCK, len(tokens) + 1, BLOCK):
            reads.append(end)
            if read_on is not None and not read_on(tokens[:end]):
                return tokens[:end]
        return tokens

    policy = _policy(_Clock(), tokenize)
    _store(policy, "a", PROMPT)
    _report(policy, a=0, b=0, c=0)
    _primary(policy, PROMPT, 0)
    assert reads[-1] == BLOCK, "a alone holds the first block and already wins: nothing more is read"
    reads.clear()
    _report(policy, a=40, b=0, c=0)
    _primary(policy, PROMPT, 1)
    assert reads[-1] > 40, "a wins only once more than 40 of its tokens are known to be cached"


def test_by_default_a_cached_prefix_is_worth_four_times_its_tokens_and_running_kv_a_quarter() -> None:
    policy = KVAware(_tokens)
    policy.block_size = BLOCK
    policy.engine_loads = EngineLoads(clock=_Clock())
    for view in VIEWS:
        policy.sources[view.replica_id] = ReplicaEvents.EVENTS
    _store(policy, "a", PROMPT)
    _report(policy, a=4 * 4 * 64 - 4, b=0, c=0)
    assert _primary(policy, PROMPT, 0) == "a", "1,020 tokens of running KV weigh 255: less than 4 x 64 cached"
    _report(policy, a=4 * 4 * 64 + 4, b=0, c=0)
    assert _primary(policy, PROMPT, 1) != "a"


def test_the_load_book_counts_waiting_requests_at_the_mean_prompt_and_placements_until_the_next_report() -> None:
    clock = _Clock()
    book = EngineLoads(clock=clock)
    assert book.load("a") is None
    book.reported("a", kv_tokens_used=100, waiting=2, running=1)
    assert book.load("a") == TokenLoad(kv_tokens=100, prefill_tokens=2 * 512, requests=3)
    book.placed("a", prompt_tokens=1000, prefill_tokens=300)
    assert book.load("a") == TokenLoad(100 + 700, round(2 * book.mean_prompt_tokens.value) + 300, requests=4)
    book.reported("a", kv_tokens_used=1100, waiting=0, prefill_tokens_pending=0, running=2)
    assert book.load("a") == TokenLoad(1100, 0, 2), "a report holds every placement made before it"
    clock.now += STALE_AFTER_S + 0.1
    assert book.load("a") is None


def test_a_report_that_did_not_move_keeps_the_placements_and_they_expire_after_the_window() -> None:
    clock = _Clock()
    book = EngineLoads(clock=clock)
    book.reported("a", kv_tokens_used=0, waiting=0, prefill_tokens_pending=0)
    book.placed("a", prompt_tokens=100, prefill_tokens=100)
    book.reported("a", kv_tokens_used=0, waiting=0, prefill_tokens_pending=0)
    assert book.load("a") == TokenLoad(0, 100, 1), "the engine has not taken it in yet"
    clock.now += PLACEMENT_TTL_S + 0.01
    book.expire()
    assert book.load("a") == TokenLoad(0, 0)


def test_a_report_whose_engine_was_asked_for_more_prompts_holds_the_placements_though_its_load_reads_the_same() -> None:
    clock = _Clock()
    book = EngineLoads(clock=clock)
    book.reported("a", kv_tokens_used=0, waiting=0, prefill_tokens_pending=0, prefix_queries=500)
    book.placed("a", prompt_tokens=100, prefill_tokens=100)
    book.reported("a", kv_tokens_used=0, waiting=0, prefill_tokens_pending=0, prefix_queries=600)
    assert book.load("a") == TokenLoad(0, 0), "the request came and finished between the two reports"


def test_a_placement_counts_for_as_long_as_a_request_takes_on_that_engine() -> None:
    clock = _Clock()
    book = EngineLoads(clock=clock)
    book.reported("a", kv_tokens_used=0, waiting=0, prefill_tokens_pending=0, request_seconds=0.1)
    book.reported("b", kv_tokens_used=0, waiting=0, prefill_tokens_pending=0)
    book.placed("a", prompt_tokens=100, prefill_tokens=100)
    book.placed("b", prompt_tokens=100, prefill_tokens=100)
    book.take_changed()
    clock.now += 0.11
    book.expire()
    assert book.take_changed() == {"a"}, "only a's placement ran out"
    assert (book.load("a"), book.load("b")) == (TokenLoad(0, 0), TokenLoad(0, 100, 1))
    clock.now += PLACEMENT_TTL_S
    book.expire()
    assert book.load("b") == TokenLoad(0, 0), "an engine that reported no request time: the window at most"


def test_a_replica_holding_its_share_of_requests_is_passed_over_even_with_the_whole_prefix() -> None:
    policy = KVAware(_tokens, saturation_floor=2)
    policy.block_size = BLOCK
    policy.engine_loads = EngineLoads(clock=_Clock())
    for view in VIEWS:
        policy.sources[view.replica_id] = ReplicaEvents.EVENTS
    _store(policy, "a", PROMPT)
    for replica in ("a", "b", "c"):
        policy.engine_loads.reported(replica, kv_tokens_used=0, waiting=0, prefill_tokens_pending=0)
    picks = [_primary(policy, PROMPT, n) for n in range(6)]
    assert picks[:2] == ["a", "a"], "below the floor the prefix keeps its replica"
    assert Counter(picks)["a"] <= 3, f"1.5 x the mean in requests at most: {picks}"


def test_a_clients_requests_one_after_another_keep_their_replica_however_many() -> None:
    clock = _Clock()
    policy = KVAware(_tokens)
    policy.block_size = BLOCK
    policy.engine_loads = EngineLoads(clock=clock)
    for view in VIEWS:
        policy.sources[view.replica_id] = ReplicaEvents.EVENTS
        policy.engine_loads.reported(view.replica_id, 0, 0, 0, request_seconds=0.05)
    _store(policy, "a", PROMPT)
    picks = []
    for n in range(8):  # each answered before the next is sent: the engine's request time apart
        picks.append(_primary(policy, PROMPT, n))
        clock.now += 0.1
    assert picks == ["a"] * 8, "finished requests do not count against the replica's share"


def test_two_routers_polling_at_different_moments_rank_the_same_decisions_alike() -> None:
    clocks, policies = [_Clock(), _Clock()], []
    for clock in clocks:
        policy = _policy(clock)
        _store(policy, "a", PROMPT)
        _report(policy, a=0, b=0, c=0)
        policies.append(policy)
    rankings: list[list[list[str]]] = [[], []]
    for n in range(12):
        for which, policy in enumerate(policies):
            if (n + which) % 5 == 0:  # each router's poll lands at its own moment: idle engines, the same report
                _report(policy, a=0, b=0, c=0)
            request = RouteRequest(request_id=f"r{n}", body_prefix=json.dumps(PROMPT).encode())
            rankings[which].append([tier[0].replica_id for tier in policy.rank(VIEWS, request)])
    assert rankings[0] == rankings[1]
    assert len({ranking[0] for ranking in rankings[0]}) >= 2, "the load spread the prefix: the loads were compared"
