"""A team's topology spec: one YAML file, a union of stack kinds discriminated by `kind`.

- `openai`: each model is a set of vLLM replicas behind the shared frontend.
- `data_parallel`: vLLM data parallel replicas, `in_engine` (one server, N engine ranks) or `ranks` (one Serve
  replica per rank, gang-scheduled: MoE with expert parallelism).
- `prefill_decode`: each model has a prefill role and a decode role, joined by a KV connector.
Loading a spec (`load_spec`) reports every problem at once, each with its field path and what to change.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import Field, TypeAdapter, ValidationError, field_validator

from infra.haproxy.models import MODEL_NAME_PATTERN
from routers.registry import policy_entry, prefill_policy_choices
from services.replica.llm_config import CPU_ONLY_DEFAULTS, EngineArgValue, EngineConfig
from topologies.problems import SpecError, SpecProblem, pydantic_problems
from topologies.sections import (
    NAME_PATTERN,
    EngineArgs,
    Frontend,
    Ingress,
    Routing,
    RoutingOverride,
    Scaling,
    Section,
    policy_problem,
)

# `source: tiny` is sluice's locally generated tiny model, `tiny-moe` its MoE variant (built on first use).
TINY_SOURCE = "tiny"
TINY_MOE_SOURCE = "tiny-moe"


class ModelBase(Section):
    name: str
    source: str
    engine: EngineArgs = Field(default_factory=dict)
    routing: RoutingOverride | None = None

    @field_validator("name")
    @classmethod
    def _served_name(cls, value: str) -> str:
        if not MODEL_NAME_PATTERN.match(value):
            raise ValueError(f"{value!r} is not a served model name: letters, digits and . _ : / - only")
        return value

    def engine_config(self, model_path: str, overrides: EngineArgs | None = None, gpus: bool = False) -> EngineConfig:
        """The engine settings of this model; `model_path`: where its weights are (the source, resolved). On GPUs
        the CPU-only defaults are left to vLLM."""
        unset: dict[str, EngineArgValue | None] = dict.fromkeys(CPU_ONLY_DEFAULTS) if gpus else {}
        args = {**unset, **self.engine, **(overrides or {})}
        named = {k: v for k, v in args.items() if k in EngineConfig.model_fields and k != "extra_args"}
        extra = {k: v for k, v in args.items() if k not in named}
        return EngineConfig(model=model_path, served_model_name=self.name, **named, extra_args=extra)


class OpenAIModel(ModelBase, Scaling):
    pass


class DataParallel(Section):
    mode: Literal["in_engine", "ranks"]
    size: int = Field(ge=2, le=64)


class DataParallelModel(OpenAIModel):
    data_parallel: DataParallel


class Role(Scaling):
    """One side of a prefill/decode pair: its replicas, resources, engine overrides and policy."""

    engine: EngineArgs = Field(default_factory=dict)
    routing: RoutingOverride | None = None


class KVTransfer(Section):
    connector: Literal["NixlConnector", "ExampleConnector"] = "NixlConnector"
    buffer_device: Literal["cpu", "cuda"] = "cpu"
    # How long prefill keeps transferred blocks for decode to read (vLLM's default of 30 s ran out under load).
    lease_s: float = Field(120.0, gt=0)
    extra_config: dict[str, Any] = Field(default_factory=dict)


class PrefillDecodeModel(ModelBase):
    prefill: Role
    decode: Role
    kv_transfer: KVTransfer = KVTransfer()
    # When prefill fails: a clear error (default), or prefill on the decode replica (marked in a header).
    local_prefill_fallback: bool = False
    # How long a decode replica waits for its prefill call before it counts as failed.
    prefill_timeout_s: float = Field(60.0, gt=0)


class StackBase(Section):
    team: str
    name: str
    routing: Routing = Routing()
    frontend: Frontend = Frontend()
    ingress: Ingress = Ingress()
    # A staging stack's routers accept fault injection (`sluice check` makes one fail on purpose).
    staging: bool = False

    @field_validator("team", "name")
    @classmethod
    def _identifier(cls, value: str) -> str:
        if not NAME_PATTERN.match(value):
            raise ValueError(f"{value!r}: use lower-case letters, digits and '-' (at most 63, starting alphanumeric)")
        return value

    @property
    def stack(self) -> str:
        """The stack's name, `<team>-<name>`: its apps', its containers' and its Kubernetes objects' stem."""
        return f"{self.team}-{self.name}"


class OpenAIStack(StackBase):
    kind: Literal["openai"]
    models: list[OpenAIModel] = Field(min_length=1)


class DataParallelStack(StackBase):
    kind: Literal["data_parallel"]
    models: list[DataParallelModel] = Field(min_length=1)


class PrefillDecodeStack(StackBase):
    kind: Literal["prefill_decode"]
    models: list[PrefillDecodeModel] = Field(min_length=1)


TopologySpec = Annotated[OpenAIStack | DataParallelStack | PrefillDecodeStack, Field(discriminator="kind")]
_ADAPTER: TypeAdapter[OpenAIStack | DataParallelStack | PrefillDecodeStack] = TypeAdapter(TopologySpec)


def topology_json_schema() -> dict[str, Any]:
    """The JSON Schema of a spec file, for editors (`sluice schema`)."""
    schema = _ADAPTER.json_schema()
    schema["title"] = "sluice topology spec"
    return schema


def _routings(spec: StackBase) -> Iterator[tuple[str, Routing]]:
    """(path, effective routing) of the stack and of every model or role that overrides it."""
    yield "routing", spec.routing
    for i, model in enumerate(spec.models):  # type: ignore[attr-defined]
        if model.routing is not None:
            yield f"models[{i}].routing", spec.routing.overridden(model.routing)
        for role in ("prefill", "decode"):
            section = getattr(model, role, None)
            if section is not None and section.routing is not None:
                yield f"models[{i}].{role}.routing", spec.routing.overridden(section.routing)


def _cross_field_problems(spec: StackBase) -> list[SpecProblem]:
    problems = []
    seen: dict[str, int] = {}
    for i, model in enumerate(spec.models):  # type: ignore[attr-defined]
        if model.name in seen:
            problems.append(
                SpecProblem(f"models[{i}].name", f"{model.name!r} is already models[{seen[model.name]}]: rename one")
            )
        seen.setdefault(model.name, i)
        if isinstance(model, DataParallelModel) and model.data_parallel.mode == "ranks" and model.autoscaling:
            problems.append(
                SpecProblem(
                    f"models[{i}].autoscaling",
                    "data_parallel mode `ranks` is a gang of fixed size: give replicas (gangs), not autoscaling",
                )
            )
        if isinstance(model, PrefillDecodeModel) and spec.routing.table_decisions:
            problems.append(
                SpecProblem(
                    "routing.table_decisions",
                    f"models[{i}] is prefill/decode: its router pairs each request with a prefill replica, which no "
                    "table holds; set routing.table_decisions: false",
                )
            )
        if isinstance(model, PrefillDecodeModel):
            prefill_routing = spec.routing.overridden(model.routing).overridden(model.prefill.routing)
            prefill_entry = policy_entry(prefill_routing.policy)
            if not prefill_entry.prefill_side:
                problems.append(
                    SpecProblem(
                        f"models[{i}].prefill.routing.policy",
                        f"{prefill_entry.prefill_refusal}: set {prefill_policy_choices()}",
                    )
                )
    for path, routing in _routings(spec):
        problem = policy_problem(routing)
        if problem is not None:
            problems.append(SpecProblem(f"{path}.{problem[0]}", problem[1]))
    max_body = spec.frontend.protection.max_body_bytes
    if spec.routing.forward_body and spec.routing.body_buffer_bytes > max_body:
        problems.append(
            SpecProblem(
                "routing.body_buffer_bytes",
                f"{spec.routing.body_buffer_bytes} is above frontend.protection.max_body_bytes ({max_body}): "
                "lower the buffer or raise the maximum",
            )
        )
    return problems


def parse_spec(data: Any, where: str = "spec") -> OpenAIStack | DataParallelStack | PrefillDecodeStack:
    """A spec from parsed YAML; raises SpecError with every problem."""
    try:
        spec = _ADAPTER.validate_python(data)
    except ValidationError as error:
        raise SpecError(where, pydantic_problems(error)) from None
    problems = _cross_field_problems(spec)
    if problems:
        raise SpecError(where, problems)
    return spec


def load_spec(path: Path | str) -> OpenAIStack | DataParallelStack | PrefillDecodeStack:
    """A spec file; raises SpecError naming the file and every problem."""
    path = Path(path)
    return parse_spec(_relative_to(read_spec_data(path), path.parent), str(path))


def read_spec_data(path: Path | str) -> Any:
    """A spec file's YAML, unchecked; SpecError when it cannot be read or is not YAML."""
    path = Path(path)
    try:
        return yaml.safe_load(path.read_text())
    except OSError as error:
        raise SpecError(str(path), [SpecProblem("", f"cannot read the file: {error.strerror}")]) from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        problem = SpecProblem("", f"{where}not valid YAML ({getattr(error, 'problem', error)})")
        raise SpecError(str(path), [problem]) from None


def _relative_to(data: Any, folder: Path) -> Any:
    """A key, certificate or CA file named by a relative path is relative to the spec file's folder, wherever sluice
    runs."""
    frontend = data.get("frontend") if isinstance(data, dict) else None
    if not isinstance(frontend, dict):
        return data
    keys = frontend.get("protection", {}).get("api_keys") if isinstance(frontend.get("protection"), dict) else None
    tls = frontend.get("tls")
    for section, fields in ((keys, ("file",)), (tls, ("cert_file", "key_file", "client_ca_file"))):
        if not isinstance(section, dict):
            continue
        for name in fields:
            if isinstance(section.get(name), str) and not Path(section[name]).is_absolute():
                section[name] = str((folder / section[name]).resolve())
    return data


def engine_problems(spec: StackBase) -> list[SpecProblem]:
    """Each model's (and role's) engine arguments through vLLM's own `vllm serve` parser, with the defaults the plan
    gives them: on GPUs the CPU-only defaults are left to vLLM (a prefill/decode model's own arguments: when both
    roles have GPUs)."""
    from services.replica.vllm_app import EngineArgsError, check_engine_args

    problems = []
    for i, model in enumerate(spec.models):  # type: ignore[attr-defined]
        sides = [(role, getattr(model, role)) for role in ("prefill", "decode") if hasattr(model, role)]
        gpus = all(side.resources.gpus > 0 for _, side in sides) if sides else model.resources.gpus > 0
        roles = [(f"models[{i}].engine", model.engine_config(model.source, gpus=gpus))]
        for role, side in sides:
            config = model.engine_config(model.source, side.engine, gpus=side.resources.gpus > 0)
            roles.append((f"models[{i}].{role}.engine", config))
        for path, config in roles:
            try:
                check_engine_args(config)
            except EngineArgsError as error:
                problems.append(SpecProblem(path, f"vLLM refuses it: {error}"))
    return problems
