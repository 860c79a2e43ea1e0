"""What every team's topology spec has, whatever its kind: the stack's sections (`StackBase`), a model's name,
source and engine arguments (`ModelBase`), and reading the file.

Each kind's own sections (its models, its stack with `kind: Literal[...]`) live in its module under
`builders/kinds/`, which also plans it; `builders.specs` validates a file against every registered kind and reports
every problem at once, each with its field path and what to change.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, field_validator, model_validator

from base.tiny_model import TINY_TOOL_CALL_PARSER
from infra.haproxy.models import MODEL_NAME_PATTERN
from services.replica.llm_config import CPU_ONLY_DEFAULTS, EngineArgValue, EngineConfig
from services.replica.tool_parsers import AUTO_TOOL_CALL_PARSER, family_tool_call_parser
from topologies.problems import SpecError, SpecProblem
from topologies.sections import (
    NAME_PATTERN,
    EngineArgs,
    Frontend,
    Ingress,
    Observability,
    Routing,
    RoutingOverride,
    Section,
)

# `source: tiny` is sluice's locally generated tiny model, `tiny-moe` its MoE variant (built on first use).
TINY_SOURCE = "tiny"
TINY_MOE_SOURCE = "tiny-moe"


# A model's `engine: sim`: the simulator engine stand-in (services/replica/sim/) instead of vLLM, timed from a stated
# model; for routing experiments at scale, never a served model.
SIM_ENGINE = "sim"


class ModelBase(Section):
    name: str
    """The served model name clients ask for (`model` in a request)."""
    source: str
    """Where the weights come from: a folder (absolute path), a Hugging Face Hub id, or `tiny` (sluice's generated
    model)."""
    # vLLM's engine arguments, or `sim` (the simulator engine stand-in, `SIM_ENGINE`).
    engine: EngineArgs | Literal["sim"] = Field(default_factory=dict)
    """vLLM's engine arguments (checked by vLLM's own parser; JSON-valued ones as YAML maps or lists;
    `tool_call_parser`: a parser or `auto`), or `sim`: the simulator engine stand-in."""
    routing: RoutingOverride | None = None
    """This model's policy, its settings or its route timeout, over the stack's `routing`."""

    @property
    def simulated(self) -> bool:
        """The replicas run the simulator engine stand-in, not vLLM."""
        return self.engine == SIM_ENGINE

    @field_validator("name")
    @classmethod
    def _served_name(cls, value: str) -> str:
        if not MODEL_NAME_PATTERN.match(value):
            raise ValueError(f"{value!r} is not a served model name: letters, digits and . _ : / - only")
        return value

    @model_validator(mode="after")
    def _known_family(self) -> ModelBase:
        why = self.unresolved_tool_call_parser()
        if why is not None:
            raise ValueError(f"engine.tool_call_parser: {why}")
        return self

    def unresolved_tool_call_parser(self, overrides: EngineArgs | None = None) -> str | None:
        """Why `tool_call_parser: auto` (of the model, or of these role overrides) names no parser; None if it does."""
        if self.tool_call_parser(self.source, overrides) != AUTO_TOOL_CALL_PARSER:
            return None
        return (
            f"auto knows no tool-call parser for {self.source!r}: name one of vLLM's `--tool-call-parser` choices "
            "(llama3_json, hermes, mistral, ...)"
        )

    def tool_call_parser(self, model_path: str, overrides: EngineArgs | None = None) -> str | None:
        """The engine's tool-call parser: the one the spec names, its family's for `auto` (`auto` itself when the
        family is unknown), the tiny model's own when the spec says nothing of the tiny model, else None (off)."""
        own = {} if isinstance(self.engine, str) else self.engine
        tiny = self.source in (TINY_SOURCE, TINY_MOE_SOURCE)
        asked = {**own, **(overrides or {})}.get("tool_call_parser", TINY_TOOL_CALL_PARSER if tiny else None)
        if asked != AUTO_TOOL_CALL_PARSER:
            return None if asked is None else str(asked)
        if tiny:
            return TINY_TOOL_CALL_PARSER
        return family_tool_call_parser(self.name, self.source, model_path=model_path) or AUTO_TOOL_CALL_PARSER

    def engine_config(self, model_path: str, overrides: EngineArgs | None = None, gpus: bool = False) -> EngineConfig:
        """The engine settings of this model; `model_path`: where its weights are (the source, resolved). On GPUs
        the CPU-only defaults are left to vLLM."""
        unset: dict[str, EngineArgValue | None] = dict.fromkeys(CPU_ONLY_DEFAULTS) if gpus else {}
        own = {} if isinstance(self.engine, str) else self.engine
        args = {**unset, **own, **(overrides or {})}
        args["tool_call_parser"] = self.tool_call_parser(model_path, overrides)
        named = {k: v for k, v in args.items() if k in EngineConfig.model_fields and k != "extra_args"}
        extra = {k: v for k, v in args.items() if k not in named}
        return EngineConfig(model=model_path, served_model_name=self.name, **named, extra_args=extra)


class StackBase(Section):
    team: str
    """The team that owns the stack (a lower-case identifier); apps are named `<team>-<name>-...`."""
    name: str
    """The stack's name within its team (a lower-case identifier)."""
    routing: Routing = Routing()
    """How the frontend routes requests: the policy and its settings, timeouts, the session header."""
    frontend: Frontend = Frontend()
    """The frontend: HAProxy's ports, the router replicas, protection, TLS, or a platform to attach to."""
    ingress: Ingress = Ingress()
    """Which path serves: direct, the legacy ingress, or both as a canary."""
    staging: bool = False
    """A staging stack's routers accept fault injection (`sluice check` makes one fail on purpose)."""
    observability: Observability = Observability()
    """Traces across the path (`tracing`); off by default."""

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


def resolve_relative_paths(data: Any, folder: Path) -> Any:
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
