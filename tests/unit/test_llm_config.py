import pytest
from pydantic import ValidationError

from services.replica.llm_config import EngineConfig, LLMAppConfig, ReplicaDeploymentConfig
from services.replica.vllm_app import (
    EngineArgsError,
    MissingModelFolder,
    check_engine_args,
    parse_engine_args,
    require_model_folder,
)


def test_cli_args_render_named_and_extra_flags() -> None:
    config = EngineConfig(model="/m", max_model_len=512, extra_args={"max_num_batched_tokens": 4096})
    args = config.cli_args()
    assert args[args.index("--model") + 1] == "/m"
    assert args[args.index("--max-model-len") + 1] == "512"
    assert args[args.index("--max-num-batched-tokens") + 1] == "4096"
    assert "--enforce-eager" in args
    assert "--tool-call-parser" not in args and "--enable-auto-tool-choice" not in args, "tool calling only if asked"


def test_false_flags_are_omitted() -> None:
    args = EngineConfig(model="/m", enforce_eager=False, tool_call_parser=None).cli_args()
    assert "--enforce-eager" not in args
    assert "--tool-call-parser" not in args
    assert "--enable-auto-tool-choice" not in args


def test_vllm_parser_accepts_the_settings() -> None:
    args = parse_engine_args(EngineConfig(model="/m", kv_cache_memory_bytes=1 << 26))
    assert args.model == "/m"
    assert args.kv_cache_memory_bytes == 1 << 26
    assert args.enforce_eager is True
    assert args.tool_call_parser is None


def test_vllm_rejects_an_unknown_engine_flag() -> None:
    with pytest.raises(SystemExit):
        parse_engine_args(EngineConfig(model="/m", extra_args={"no_such_flag": 1}))


def test_bad_values_are_refused() -> None:
    with pytest.raises(ValidationError):
        EngineConfig(model="/m", max_model_len=0)
    with pytest.raises(ValidationError):
        EngineConfig(model="/m", extra_args={"model; rm -rf": 1})
    with pytest.raises(ValidationError):
        ReplicaDeploymentConfig(max_ongoing_requests=0)
    with pytest.raises(ValidationError, match="greater than or equal to 10"):
        ReplicaDeploymentConfig(drain_grace_s=2)
    with pytest.raises(ValidationError):
        LLMAppConfig.model_validate({"engine": {"model": "/m", "typo_field": 1}})


def test_serve_options_set_max_ongoing_requests_explicitly() -> None:
    options = ReplicaDeploymentConfig(num_replicas=3, max_ongoing_requests=17, drain_grace_s=12).serve_options()
    assert options["max_ongoing_requests"] == 17
    assert options["num_replicas"] == 3
    assert options["graceful_shutdown_timeout_s"] == 12


def test_the_serve_deployment_carries_the_options() -> None:
    from services.replica.llm_replica import llm_deployment

    deployment = llm_deployment(
        LLMAppConfig(
            engine=EngineConfig(model="/m"),
            deployment=ReplicaDeploymentConfig(num_replicas=3, max_ongoing_requests=17, drain_grace_s=12),
        )
    )
    assert deployment.max_ongoing_requests == 17
    assert deployment.num_replicas == 3
    assert deployment.name == "LLMReplica"


def test_every_vllm_engine_process_loads_the_amx_plugin() -> None:
    """vLLM loads its general plugins in each engine process: ours must be one of them, and callable."""
    from vllm.plugins import load_plugins_by_group

    from services.replica.vllm_cpu_amx import request_amx_permission

    plugins = load_plugins_by_group("vllm.general_plugins")
    assert plugins.get("sluice_cpu_amx") is request_amx_permission
    request_amx_permission()


def test_each_engine_rank_of_a_node_gets_its_own_cpu() -> None:
    from services.replica.llm_replica import engine_cpu_binding

    assert engine_cpu_binding(0, 2, cpus=[0, 1, 2, 3]) == "0|1"
    assert engine_cpu_binding(1, 2, cpus=[0, 1, 2, 3]) == "2|3"
    # Fewer CPUs than ranks on the node: wrap around, never all on one CPU.
    assert engine_cpu_binding(1, 2, cpus=[4, 5]) == "4|5"
    assert engine_cpu_binding(0, 4, cpus=[4, 5]) == "4|5|4|5"


def test_handle_calls_route_with_the_deployments_policy_through_its_adapter() -> None:
    from routers.serve_adapters import ConsistentHashRequestRouter

    options = ReplicaDeploymentConfig(
        handle_policy="consistent_hash", handle_policy_kwargs={"num_fallback_replicas": 1}
    )
    router = options.serve_options()["request_router_config"]
    # Serve keeps the class as its import path, which each handle owner imports.
    assert (
        router.request_router_class
        == f"{ConsistentHashRequestRouter.__module__}.{ConsistentHashRequestRouter.__name__}"
    )
    assert router.request_router_kwargs == {"num_fallback_replicas": 1}
    assert "request_router_config" not in ReplicaDeploymentConfig().serve_options()
    with pytest.raises(ValidationError, match="invalid consistent_hash kwargs"):
        ReplicaDeploymentConfig(handle_policy="consistent_hash", handle_policy_kwargs={"load_factor": 0.5})


def test_a_weights_folder_this_node_lacks_is_refused_naming_it(tmp_path) -> None:
    missing = tmp_path / "no-such-model"
    with pytest.raises(MissingModelFolder, match=str(missing)):
        require_model_folder(EngineConfig(model=str(missing)))
    require_model_folder(EngineConfig(model=str(tmp_path)))
    require_model_folder(EngineConfig(model="meta-llama/Llama-3.1-8B-Instruct"))  # a Hub id: vLLM downloads it


def test_vllms_json_valued_flags_take_maps_and_lists_and_its_parser_checks_them() -> None:
    extra = {
        "override_generation_config": {"temperature": 0.5},
        "speculative_config": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4},
        "enable_lora": True,
        "lora_modules": [{"name": "a", "path": "/l/a"}, "b=/l/b"],
    }
    args = check_engine_args(EngineConfig(model="/m", extra_args=extra))
    assert args.override_generation_config == {"temperature": 0.5}
    assert args.speculative_config["num_speculative_tokens"] == 3
    assert [(module.name, module.path) for module in args.lora_modules] == [("a", "/l/a"), ("b", "/l/b")]
    # vLLM's own complaint, on one line and naming the field.
    with pytest.raises(
        EngineArgsError, match=r"--compilation-config.*CompilationConfig; level; Unexpected keyword"
    ) as e:
        check_engine_args(EngineConfig(model="/m", extra_args={"compilation_config": {"level": 0}}))
    assert "\n" not in str(e.value) and "pydantic.dev" not in str(e.value)
