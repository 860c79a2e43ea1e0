from services.replica.llm_config import EngineConfig, LLMAppConfig, ReplicaDeploymentConfig
from services.replica.llm_replica import llm_deployment
from services.router.service import router_application
from services.router.settings import RouterSettings


def _config(**deployment: object) -> LLMAppConfig:
    return LLMAppConfig(engine=EngineConfig(model="/models/tiny"), deployment=ReplicaDeploymentConfig(**deployment))


def test_replica_count_alone_keeps_the_version_so_serve_scales_in_place() -> None:
    assert _config(num_replicas=2).rollout_version() == _config(num_replicas=3).rollout_version()
    pinned = llm_deployment(_config(num_replicas=2)).version
    assert pinned is not None, "an unpinned version is random per serve.run: every redeploy rolls the replicas"
    assert llm_deployment(_config(num_replicas=3)).version == pinned


def test_another_handle_policy_keeps_the_version_so_comparing_policies_keeps_the_replicas() -> None:
    base = _config(handle_policy="round_robin").rollout_version()
    assert _config(handle_policy="consistent_hash", handle_policy_kwargs={"load_factor": 1.5}).rollout_version() == base
    assert _config(handle_policy="round_robin", capacity_ledger=True).rollout_version() != base


def test_any_other_change_is_a_new_version_so_serve_rolls_the_replicas() -> None:
    base = _config().rollout_version()
    assert _config(max_ongoing_requests=8).rollout_version() != base
    assert _config(drain_grace_s=20).rollout_version() != base
    other_engine = LLMAppConfig(engine=EngineConfig(model="/models/tiny", max_model_len=512))
    assert other_engine.rollout_version() != base


def test_router_version_ignores_its_replica_count_but_not_its_policy() -> None:
    settings = RouterSettings(target_app="llm", target_capacity=32, policy="round_robin")
    one, two = router_application(settings, 1), router_application(settings, 2)
    assert one._bound_deployment.version is not None
    assert one._bound_deployment.version == two._bound_deployment.version
    other = router_application(RouterSettings(target_app="llm", target_capacity=32, policy="power_of_two"), 1)
    assert other._bound_deployment.version != one._bound_deployment.version
