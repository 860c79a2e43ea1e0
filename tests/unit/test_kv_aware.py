"""The kv_aware policy's ranking: the longest cached prefix wins, saturation passes it over, misses go by load, a
replica without events is scored by what was routed there, a lost stream ranks last, every reason is counted; and
the registry's rules around it (forwarded bodies, the prefill side, the model's files, the handle path)."""

from __future__ import annotations

import json
import random
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from builders.plan import build_plan
from builders.specs import parse_spec
from routers.core import ReplicaView, RouteRequest
from routers.entry import PolicyContext
from routers.kv_aware import KVAware
from routers.kv_events import ReplicaEvents
from routers.kv_index import chain_keys
from routers.prompt_tokens import ReadOn
from routers.registry import HANDLE_POLICY_WITHOUT_PROMPT, build_policy, handle_policy
from services.replica.llm_config import LLMAppConfig
from services.router.settings import PrefillTarget, RouterAppArgs, RouterSettings
from topologies.spec import SpecError

BLOCK = 4
VIEWS = tuple(ReplicaView(replica_id=r, capacity=64) for r in ("a", "b", "c"))


def _tokens(body: bytes, held: object = None) -> list[int] | None:
    """The unit tests' prompt: the body is the token list itself (the real tokenizer is tested on vLLM replicas)."""
    parsed = json.loads(body)
    return parsed if isinstance(parsed, list) else None


def _policy(**kwargs: object) -> KVAware:
    policy = KVAware(_tokens, **kwargs)  # type: ignore[arg-type]
    policy.block_size = BLOCK
    for view in VIEWS:
        policy.sources[view.replica_id] = ReplicaEvents.EVENTS
    return policy


def _store(policy: KVAware, replica: str, tokens: list[int]) -> None:
    """The replica's engine stored these tokens' blocks (as its BlockStored event says)."""
    engine_hashes = [f"{replica}-{i}" for i in range(len(tokens) // BLOCK)]
    policy.index.stored(replica, engine_hashes, None, tokens, BLOCK)


def _request(tokens: list[int] | None, n: int, truncated: bool = False) -> RouteRequest:
    body = json.dumps(tokens).encode() if tokens is not None else b'{"messages": 3}'
    return RouteRequest(request_id=f"r{n}", body_prefix=body, body_truncated=truncated)


PROMPT = list(range(16))


def test_the_replica_with_the_longest_cached_prefix_is_primary() -> None:
    policy = _policy()
    _store(policy, "a", PROMPT[:4])
    _store(policy, "b", PROMPT[:12])
    ranking = policy.rank(VIEWS, _request(PROMPT, 0))
    assert [tier[0].replica_id for tier in ranking][:2] == ["b", "a"]
    assert policy.counts.last_reason == "match"


def test_a_saturated_best_match_is_passed_over_for_the_next_best() -> None:
    policy = _policy(saturation_factor=1.5)
    _store(policy, "b", PROMPT)
    primaries = [policy.rank(VIEWS, _request(PROMPT, i))[0][0].replica_id for i in range(30)]
    in_flight = Counter(primaries)
    assert max(in_flight.values()) <= 1.5 * (30 / 3) + 1, in_flight
    assert in_flight["b"] == max(in_flight.values()), "the replica that caches the prefix still takes the most"
    assert policy.counts.decisions["saturated"] > 0 and policy.counts.decisions["match"] > 0


def test_below_the_saturation_floor_a_prefix_stays_on_its_replica() -> None:
    policy = _policy(saturation_floor=4)
    _store(policy, "b", PROMPT)
    primaries = [policy.rank(VIEWS, _request(PROMPT, i))[0][0].replica_id for i in range(5)]
    assert primaries == ["b"] * 4 + [primaries[4]] and primaries[4] != "b"


def test_live_load_is_the_frontends_count_of_open_requests_plus_what_this_router_sent_since() -> None:
    policy = _policy(saturation_floor=4)
    _store(policy, "b", PROMPT)
    primaries = [policy.rank(VIEWS, _request(PROMPT, i))[0][0].replica_id for i in range(5)]
    assert primaries[:4] == ["b"] * 4 and primaries[4] != "b"  # this router's decisions alone: b is saturated
    # The frontends count one request open on b (the others ended): b takes the prefix again, up to the floor.
    policy.tracker.sampled()
    sampled = tuple(replace(view, in_flight=int(view.replica_id == "b"), in_flight_sampled=True) for view in VIEWS)
    primaries = [policy.rank(sampled, _request(PROMPT, 10 + i))[0][0].replica_id for i in range(4)]
    assert primaries == ["b"] * 3 + [primaries[3]] and primaries[3] != "b"
    assert policy.counts.last_reason == "saturated"


def test_misses_go_to_the_least_loaded_replica_and_spread() -> None:
    policy = _policy()
    primaries = [policy.rank(VIEWS, _request([100 + i] * 8, i))[0][0].replica_id for i in range(9)]
    assert Counter(primaries) == {"a": 3, "b": 3, "c": 3}
    assert policy.counts.decisions["miss"] == 9


@pytest.mark.parametrize(
    ("request_", "reason"),
    [(_request(PROMPT, 0, truncated=True), "body_truncated"), (_request(None, 0), "no_prompt")],
)
def test_a_request_without_a_prompt_is_routed_by_load_and_says_why(request_: RouteRequest, reason: str) -> None:
    policy = _policy()
    _store(policy, "b", PROMPT)
    policy.rank(VIEWS, request_)
    assert policy.counts.last_reason == reason


def test_before_any_replica_announced_its_block_size_there_is_no_index() -> None:
    policy = KVAware(_tokens)
    policy.rank(VIEWS, _request(PROMPT, 0))
    assert policy.counts.last_reason == "no_index"


def test_a_replica_without_events_is_scored_by_what_this_router_sent_it() -> None:
    policy = _policy()
    policy.sources["c"] = ReplicaEvents.APPROXIMATE
    first = policy.rank(VIEWS, _request(PROMPT, 0))[0][0].replica_id
    policy.tracker.finish("r0")
    if first != "c":  # the miss went elsewhere: send the prefix to c as a router would have
        policy.routed_prefixes.routed("c", chain_keys(PROMPT, BLOCK))
        policy.sources[first] = ReplicaEvents.APPROXIMATE
        policy.routed_prefixes.forget(first)
    assert policy.rank(VIEWS, _request(PROMPT, 1))[0][0].replica_id == "c"
    assert policy.counts.last_reason == "approximate_match"


def test_a_replica_whose_stream_was_lost_is_never_primary_while_another_can_take_it() -> None:
    policy = _policy()
    _store(policy, "a", PROMPT)
    policy.sources["a"] = ReplicaEvents.LOST
    for i in range(6):
        ranking = policy.rank(VIEWS, _request(PROMPT, i))
        assert ranking[0][0].replica_id != "a" and ranking[-1][0].replica_id == "a"


def test_two_policies_given_the_same_index_and_requests_rank_alike() -> None:
    first, second = _policy(), _policy()
    for policy in (first, second):
        _store(policy, "a", PROMPT[:8])
        _store(policy, "c", [7] * 12)
    requests = [_request(PROMPT if i % 3 else [7] * 12 + [i], i) for i in range(200)]
    ids = [[[t[0].replica_id for t in p.rank(VIEWS, r)] for r in requests] for p in (first, second)]
    assert ids[0] == ids[1]


class _BlockwiseTokens:
    """The unit tests' prompt read a block at a time, asking `read_on` before each further block (as the real
    tokenizer asks before each new piece); `read` is how many tokens the last call handed out."""

    def __init__(self) -> None:
        self.read = 0

    def __call__(self, body: bytes, read_on: ReadOn | None = None) -> list[int] | None:
        tokens = _tokens(body)
        if tokens is None or read_on is None:
            return tokens
        end = 0
        while end < len(tokens) and read_on(tokens[:end]):
            end += BLOCK
        self.read = min(end, len(tokens))
        return tokens[: self.read]


def test_once_one_replica_or_none_holds_a_block_the_rest_of_the_prompt_is_not_read() -> None:
    tokenize = _BlockwiseTokens()
    policy = KVAware(tokenize)
    policy.block_size = BLOCK
    for view in VIEWS:
        policy.sources[view.replica_id] = ReplicaEvents.EVENTS
    _store(policy, "b", PROMPT[:12])
    assert policy.rank(VIEWS, _request(PROMPT, 0))[0][0].replica_id == "b"
    assert tokenize.read == BLOCK, "only b holds the first block: no block after it can change the order"
    _store(policy, "a", PROMPT[:8])
    assert policy.rank(VIEWS, _request(PROMPT, 1))[0][0].replica_id == "b"
    assert tokenize.read == 3 * BLOCK, "a and b hold two blocks: read on to the third, which only b holds"


def test_reading_a_prompt_only_as_far_as_it_can_change_the_ranking_ranks_as_reading_it_all() -> None:
    rng = random.Random(4)
    prompts = [[rng.randrange(50) for _ in range(6 * BLOCK)] for _ in range(5)]
    whole, partial = _policy(), KVAware(_BlockwiseTokens())
    partial.block_size = BLOCK
    partial.sources = dict(whole.sources)
    for step in range(300):
        if step % 3 == 0:
            replica, prompt = rng.choice("abc"), rng.choice(prompts)
            stored = prompt[: BLOCK * rng.randrange(1, 7)]
            for policy in (whole, partial):
                _store(policy, replica, stored)
        request = _request(rng.choice(prompts)[: BLOCK * rng.randrange(1, 7) + 1], step)
        ranked = [[tier[0].replica_id for tier in policy.rank(VIEWS, request)] for policy in (whole, partial)]
        assert ranked[0] == ranked[1], step
        assert whole.counts.last_reason == partial.counts.last_reason


def test_the_policy_reads_the_body_so_the_spec_must_forward_it() -> None:
    spec = {"kind": "openai", "team": "t", "name": "n", "routing": {"policy": "kv_aware"}}
    spec["models"] = [{"name": "m", "source": "tiny"}]
    with pytest.raises(SpecError, match="forward_body"):
        parse_spec(spec)
    spec["routing"]["forward_body"] = True
    assert parse_spec(spec).routing.publishes_kv_events


def test_the_prefill_side_and_a_router_without_the_models_files_are_refused() -> None:
    with pytest.raises(ValidationError, match="cannot run kv_aware"):
        PrefillTarget(app="p", policy="kv_aware")
    with pytest.raises(ValidationError, match="model_path"):
        RouterSettings(target_app="x", policy="kv_aware")
    with pytest.raises(ValueError, match="tokenizer"):
        build_policy("kv_aware", {}, PolicyContext())


def test_handle_calls_of_a_kv_aware_deployment_route_by_load() -> None:
    assert handle_policy("kv_aware", {"saturation_factor": 2.0}) == (HANDLE_POLICY_WITHOUT_PROMPT, {})
    assert handle_policy("consistent_hash", {"load_factor": 1.5}) == ("consistent_hash", {"load_factor": 1.5})


TEAMS = Path(__file__).resolve().parents[2] / "topologies" / "teams"


def _apps(spec: dict) -> dict[str, dict]:
    return {app.name: app.args for app in build_plan(parse_spec(spec)).apps}


def test_the_plan_turns_on_the_replicas_events_and_gives_the_router_the_models_files() -> None:
    data = yaml.safe_load((TEAMS / "kv-aware-cpu.yaml").read_text())
    apps = _apps(data)
    llm = LLMAppConfig.model_validate(apps["platform-kv-aware-cpu-llm"])
    router = RouterAppArgs.model_validate(apps["platform-kv-aware-cpu-router"]).settings
    assert json.loads(str(llm.engine.extra_args["kv_events_config"]))["endpoint"] == "tcp://*:0"
    assert llm.deployment.handle_policy == HANDLE_POLICY_WITHOUT_PROMPT
    assert router.model_path == llm.engine.model and router.target_route_prefix == "/platform-kv-aware-cpu-llm"
    data["routing"].update(policy="round_robin", kv_events=True)
    assert "kv_events_config" in LLMAppConfig.model_validate(_apps(data)["platform-kv-aware-cpu-llm"]).engine.extra_args
    data["routing"].update(policy="kv_aware", kv_events=False)
    assert "kv_events_config" not in _apps(data)["platform-kv-aware-cpu-llm"]["engine"]["extra_args"]


def test_on_prefill_decode_the_decode_replicas_publish_and_the_prefill_side_may_not_run_it() -> None:
    data = yaml.safe_load((TEAMS / "prefill-decode-cpu.yaml").read_text())
    data["routing"] = {**data.get("routing", {}), "policy": "kv_aware", "forward_body": True}
    data["models"][0]["prefill"]["routing"] = {"policy": "power_of_two"}
    apps = _apps(data)
    decode = next(args for name, args in apps.items() if name.endswith("-llm"))
    prefill = next(args for name, args in apps.items() if name.endswith("-prefill"))
    assert "kv_events_config" in decode["engine"]["extra_args"]
    assert "kv_events_config" not in prefill["engine"]["extra_args"]
    data["models"][0]["prefill"]["routing"] = {"policy": "kv_aware"}
    with pytest.raises(SpecError, match="cannot run kv_aware"):
        parse_spec(data)
