"""KubeRay's RayService, the part of it sluice renders, as pydantic models: a manifest that passes them passes the
operator's own checks on those fields (names, group labels, replica bounds, `rayStartParams` resources).

Modelled from KubeRay's v1 API and validation; every model forbids unknown keys, so a typo fails here rather than
being pruned by the CRD's schema. Sources and rules: infra/README.md (KubeRay's RayService).
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

RAY_SERVICE_API_VERSION = "ray.io/v1"
# KubeRay's MaxRayServiceNameLength: MaxRayClusterNameLength (53) less the RayCluster's suffix.
MAX_RAY_SERVICE_NAME = 47
INT32_MAX = 2**31 - 1
_DNS1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")
_DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
# A Kubernetes qualified name (label key), with an optional DNS-subdomain prefix, and a label value.
_LABEL_NAME = r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
_LABEL_KEY = re.compile(rf"^([a-z0-9]([-a-z0-9.]{{0,251}}[a-z0-9])?/)?{_LABEL_NAME}$")
_LABEL_VALUE = re.compile(rf"^({_LABEL_NAME})?$")
_INTEGER = re.compile(r"^[0-9]+$")


def ray_start_resources(resources: dict[str, int]) -> str:
    """Custom resources as a `rayStartParams["resources"]` value: JSON, quoted and escaped for KubeRay's shell."""
    return '"' + json.dumps(resources).replace('"', '\\"') + '"'


def parse_ray_start_resources(value: str) -> dict[str, int]:
    """The custom resources of a `rayStartParams["resources"]` value, read as Ray's KubeRay autoscaler reads it."""
    if len(value) < 2 or value[0] != '"' or value[-1] != '"':
        raise ValueError(f'resources {value!r}: KubeRay wants the JSON quoted and escaped, e.g. \'"{{\\"A\\": 1}}"\'')
    try:
        resources = json.loads(value[1:-1].replace("\\", ""))
    except json.JSONDecodeError as error:
        raise ValueError(f"resources {value!r} is not JSON inside its quotes: {error}") from None
    if not isinstance(resources, dict) or not all(
        isinstance(amount, int) and not isinstance(amount, bool) for amount in resources.values()
    ):
        raise ValueError(f"resources {value!r}: a JSON object of integer amounts (the autoscaler's rule)")
    return resources


def _start_params(params: dict[str, str]) -> dict[str, str]:
    if "labels" in params:
        raise ValueError("rayStartParams['labels'] is refused by KubeRay: use the group's `labels`")
    for key in ("num-cpus", "num-gpus"):
        if key in params and not _INTEGER.match(params[key]):
            raise ValueError(f"rayStartParams[{key!r}] = {params[key]!r}: `ray start` takes a whole number")
    if "resources" in params:
        parse_ray_start_resources(params["resources"])
    return params


def _labels(labels: dict[str, str] | None) -> dict[str, str] | None:
    for key, value in (labels or {}).items():
        if not _LABEL_KEY.match(key) or len(key.rpartition("/")[2]) > 63:
            raise ValueError(f"label key {key!r} is not a Kubernetes qualified name")
        if not _LABEL_VALUE.match(value) or len(value) > 63:
            raise ValueError(f"label {key}={value!r}: a label value is at most 63 of A-Z a-z 0-9 - _ .")
    return labels


RayStartParams = Annotated[dict[str, str], AfterValidator(_start_params)]
Labels = Annotated[dict[str, str] | None, AfterValidator(_labels)]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ObjectMeta(_Model):
    name: str
    labels: Labels = None


class TemplateMeta(_Model):
    labels: Labels = None


class PodTemplate(_Model):
    metadata: TemplateMeta = TemplateMeta()
    spec: dict[str, Any]

    @field_validator("spec")
    @classmethod
    def _ray_container_first(cls, spec: dict[str, Any]) -> dict[str, Any]:
        containers = spec.get("containers") or []
        if not containers or not containers[0].get("image"):
            raise ValueError("KubeRay runs Ray in the template's first container: give it one, with an image")
        return spec


class HeadGroupSpec(_Model):
    rayStartParams: RayStartParams
    template: PodTemplate


class WorkerGroupSpec(_Model):
    groupName: str
    replicas: int = Field(ge=0, le=INT32_MAX)
    minReplicas: int = Field(ge=0, le=INT32_MAX)
    maxReplicas: int = Field(ge=0, le=INT32_MAX)
    labels: Labels = None
    rayStartParams: RayStartParams
    template: PodTemplate

    @field_validator("groupName")
    @classmethod
    def _group_name(cls, value: str) -> str:
        if not _DNS1123_LABEL.match(value):
            raise ValueError(f"groupName {value!r} is not a DNS-1123 label")
        return value

    @model_validator(mode="after")
    def _ordered(self) -> WorkerGroupSpec:
        if not self.minReplicas <= self.replicas <= self.maxReplicas:
            raise ValueError(
                f"group {self.groupName}: minReplicas {self.minReplicas} <= replicas {self.replicas} <= "
                f"maxReplicas {self.maxReplicas} does not hold"
            )
        return self


class AuthOptions(_Model):
    # KubeRay >= 1.5.1 with Ray >= 2.52: `token` makes a Secret with a random token and sets RAY_AUTH_MODE and
    # RAY_AUTH_TOKEN on every Ray container.
    mode: Literal["disabled", "token"]


class RayClusterSpec(_Model):
    rayVersion: str
    authOptions: AuthOptions | None = None
    enableInTreeAutoscaling: bool | None = None
    headGroupSpec: HeadGroupSpec
    workerGroupSpecs: list[WorkerGroupSpec]

    @field_validator("workerGroupSpecs")
    @classmethod
    def _distinct_groups(cls, groups: list[WorkerGroupSpec]) -> list[WorkerGroupSpec]:
        names = [group.groupName for group in groups]
        if len(set(names)) != len(names):
            raise ValueError(f"worker group names repeat: {names}")
        return groups


class RayServiceSpec(_Model):
    # A YAML string: Ray Serve's multi-application config (`serve deploy`'s schema).
    serveConfigV2: str
    rayClusterConfig: RayClusterSpec

    @field_validator("serveConfigV2")
    @classmethod
    def _serve_config(cls, value: str) -> str:
        config = yaml.safe_load(value)
        if not isinstance(config, dict) or not config.get("applications"):
            raise ValueError("serveConfigV2 must be a YAML mapping with a non-empty `applications` list")
        return value


class RayService(_Model):
    apiVersion: Literal["ray.io/v1"] = RAY_SERVICE_API_VERSION
    kind: Literal["RayService"] = "RayService"
    metadata: ObjectMeta
    spec: RayServiceSpec

    @field_validator("metadata")
    @classmethod
    def _service_name(cls, metadata: ObjectMeta) -> ObjectMeta:
        if len(metadata.name) > MAX_RAY_SERVICE_NAME or not _DNS1035_LABEL.match(metadata.name):
            raise ValueError(
                f"RayService name {metadata.name!r}: KubeRay wants a DNS-1035 label (a lower-case letter first) of at "
                f"most {MAX_RAY_SERVICE_NAME} characters: shorten the spec's team or name"
            )
        return metadata

    def manifest(self) -> dict[str, Any]:
        return self.model_dump(mode="json", exclude_none=True)
