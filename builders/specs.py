"""A team's topology spec file, validated against every registered kind (`builders.kinds.registry`).

The file is a union of the kinds' stack models discriminated by `kind`. Loading it (`load_spec`) reports every
problem at once, each with its field path and what to change: the models' fields first, then what no field alone
shows (model names used twice, each kind's own checks, every routing's policy and kwargs, the body buffer against the
frontend's limit). `engine_problems` runs each model's (and role's) engine arguments through vLLM's own parser.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, Union

from pydantic import Field, TypeAdapter, ValidationError

from builders.kinds.registry import KINDS, kind_of
from topologies.problems import SpecError, SpecProblem, pydantic_problems
from topologies.sections import Routing, policy_problem
from topologies.spec import StackBase, read_spec_data, resolve_relative_paths


@functools.cache
def _adapter(stacks: tuple[type[StackBase], ...]) -> TypeAdapter[Any]:
    if len(stacks) == 1:
        return TypeAdapter(stacks[0])
    return TypeAdapter(Annotated[Union[stacks], Field(discriminator="kind")])  # noqa: UP007 (a tuple of types)


def _spec_adapter() -> TypeAdapter[Any]:
    """The union of the registered kinds' stack models, in registration order."""
    return _adapter(tuple(kind.stack for kind in KINDS.items()))


def topology_json_schema() -> dict[str, Any]:
    """The JSON Schema of a spec file, for editors (`sluice schema`)."""
    schema = _spec_adapter().json_schema()
    schema["title"] = "sluice topology spec"
    return schema


def _routings(spec: StackBase) -> Iterator[tuple[str, Routing]]:
    """(path, effective routing) of the stack and of every model or role that overrides it."""
    yield "routing", spec.routing
    kind = kind_of(spec)
    for i, model in enumerate(spec.models):  # type: ignore[attr-defined]
        if model.routing is not None:
            yield f"models[{i}].routing", spec.routing.overridden(model.routing)
        for role, section in kind.roles(model):
            if section.routing is not None:
                yield f"models[{i}].{role}.routing", spec.routing.overridden(section.routing)


def _cross_field_problems(spec: StackBase) -> list[SpecProblem]:
    problems = []
    seen: dict[str, int] = {}
    kind = kind_of(spec)
    for i, model in enumerate(spec.models):  # type: ignore[attr-defined]
        if model.name in seen:
            problems.append(
                SpecProblem(f"models[{i}].name", f"{model.name!r} is already models[{seen[model.name]}]: rename one")
            )
        seen.setdefault(model.name, i)
        problems += kind.problems(spec, i, model)
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


def parse_spec(data: Any, where: str = "spec") -> StackBase:
    """A spec from parsed YAML; raises SpecError with every problem."""
    try:
        spec = _spec_adapter().validate_python(data)
    except ValidationError as error:
        raise SpecError(where, pydantic_problems(error, [kind.name for kind in KINDS.items()])) from None
    problems = _cross_field_problems(spec)
    if problems:
        raise SpecError(where, problems)
    return spec


def load_spec(path: Path | str) -> StackBase:
    """A spec file; raises SpecError naming the file and every problem."""
    path = Path(path)
    return parse_spec(resolve_relative_paths(read_spec_data(path), path.parent), str(path))


def engine_problems(spec: StackBase) -> list[SpecProblem]:
    """Each model's (and role's) engine arguments through vLLM's own `vllm serve` parser, with the defaults the plan
    gives them: on GPUs the CPU-only defaults are left to vLLM (a model with roles, its own arguments: when every
    role has GPUs)."""
    from services.replica.vllm_app import EngineArgsError, check_engine_args

    problems = []
    kind = kind_of(spec)
    for i, model in enumerate(spec.models):  # type: ignore[attr-defined]
        if model.simulated:
            continue  # no vLLM runs: nothing for its parser to check
        sides = list(kind.roles(model))
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
