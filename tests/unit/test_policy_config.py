import pytest
from prometheus_client import generate_latest

from routers.consistent_hash import ConsistentHash
from routers.core import ReplicaView, RouteRequest
from routers.registry import PolicyConfigError, build_stateless_policy
from routers.serve_adapters import ADAPTERS, ConsistentHashRequestRouter, request_router_config


def test_each_policy_is_named_by_its_adapter() -> None:
    config = request_router_config("consistent_hash", num_fallback_replicas=1, load_factor=1.5)
    assert config.request_router_kwargs == {"num_fallback_replicas": 1, "load_factor": 1.5}
    assert "ConsistentHashRequestRouter" in str(config.request_router_class)
    assert set(ADAPTERS) == {"round_robin", "power_of_two", "consistent_hash", "capacity_queue", "kv_aware"}
    assert ADAPTERS["consistent_hash"] is ConsistentHashRequestRouter


@pytest.mark.parametrize(
    "policy,kwargs,message",
    [
        ("consistent_hash", {"load_factor": 0.5}, "load_factor: Input should be greater than or equal to 1"),
        ("consistent_hash", {"num_fallback_replicas": -1}, "num_fallback_replicas"),
        ("consistent_hash", {"fallbacks": 2}, "fallbacks: Extra inputs are not permitted"),
        ("power_of_two", {"seed": "abc"}, "seed"),
        ("capacity_queue", {"max_wait_s": 0}, "max_wait_s"),
        ("least_loaded", {}, "unknown routing policy 'least_loaded'"),
    ],
)
def test_bad_kwargs_are_refused_before_deploying(policy: str, kwargs: dict, message: str) -> None:
    with pytest.raises(PolicyConfigError, match=message):
        request_router_config(policy, **kwargs)


def test_stateless_policies_are_built_from_their_settings() -> None:
    policy = build_stateless_policy("consistent_hash", {"num_fallback_replicas": 1, "load_factor": 2.0})
    assert isinstance(policy, ConsistentHash)
    assert (policy.num_fallback_replicas, policy.load_factor) == (1, 2.0)
    with pytest.raises(PolicyConfigError, match="needs a capacity ledger"):
        build_stateless_policy("capacity_queue", {})


def test_decision_reasons_are_exported_to_prometheus() -> None:
    policy = ConsistentHash()
    views = [ReplicaView(replica_id=f"r{i}") for i in range(3)]
    policy.rank(views, RouteRequest(request_id="a", session_id="s"))
    policy.rank(views, RouteRequest(request_id="b"))
    exposition = generate_latest().decode()
    assert 'sluice_router_decisions_total{policy="consistent_hash",reason="primary"}' in exposition
    assert 'sluice_router_decisions_total{policy="consistent_hash",reason="no_session_header"}' in exposition
    assert policy.counts.decisions == {"primary": 1, "no_session_header": 1}
