"""The Grafana dashboard shipped with sluice (`sluice-dashboard.json`): its shape, checked on load, and the metric
names its queries read (`metric_names`), so a test can compare them with what a running stack exports.
Details: infra/README.md (observability).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from infra.observability import DASHBOARD_PATH

DATASOURCE_VARIABLE = "DS_PROMETHEUS"
GRID_COLUMNS = 24
SCHEMA_VERSION = 39


class _Grafana(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)


class Datasource(_Grafana):
    type: Literal["prometheus"]
    uid: Literal["${DS_PROMETHEUS}"]


class GridPos(_Grafana):
    h: int = Field(ge=1)
    w: int = Field(ge=1, le=GRID_COLUMNS)
    x: int = Field(ge=0, lt=GRID_COLUMNS)
    y: int = Field(ge=0)

    @model_validator(mode="after")
    def _inside_the_grid(self) -> GridPos:
        if self.x + self.w > GRID_COLUMNS:
            raise ValueError(f"x + w = {self.x + self.w} is past the grid's {GRID_COLUMNS} columns")
        return self


class Target(_Grafana):
    ref_id: str = Field(alias="refId", min_length=1)
    expr: str = Field(min_length=1)
    datasource: Datasource
    legend_format: str = Field("", alias="legendFormat")


class Panel(_Grafana):
    id: int = Field(ge=1)
    type: Literal["row", "timeseries", "stat", "bargauge"]
    title: str = Field(min_length=1)
    grid_pos: GridPos = Field(alias="gridPos")
    datasource: Datasource | None = None
    targets: list[Target] = Field(default_factory=list)

    @model_validator(mode="after")
    def _queries(self) -> Panel:
        if self.type == "row":
            if self.targets:
                raise ValueError(f"row {self.title!r} holds queries")
            return self
        if not self.targets or self.datasource is None:
            raise ValueError(f"panel {self.title!r} needs a datasource and at least one query")
        ref_ids = [target.ref_id for target in self.targets]
        if len(set(ref_ids)) != len(ref_ids):
            raise ValueError(f"panel {self.title!r}: refIds repeat: {ref_ids}")
        return self


class Variable(_Grafana):
    name: str = Field(min_length=1)
    type: Literal["datasource", "query", "custom", "interval"]


class Templating(_Grafana):
    variables: list[Variable] = Field(alias="list")


class Dashboard(_Grafana):
    uid: str = Field(min_length=1, max_length=40)
    title: str = Field(min_length=1)
    schema_version: int = Field(alias="schemaVersion", ge=SCHEMA_VERSION)
    panels: list[Panel] = Field(min_length=1)
    templating: Templating

    @model_validator(mode="after")
    def _consistent(self) -> Dashboard:
        ids = [panel.id for panel in self.panels]
        if len(set(ids)) != len(ids):
            raise ValueError(f"panel ids repeat: {sorted(ids)}")
        variables = {variable.name: variable for variable in self.templating.variables}
        datasource = variables.get(DATASOURCE_VARIABLE)
        if datasource is None or datasource.type != "datasource":
            raise ValueError(f"the dashboard needs a datasource variable {DATASOURCE_VARIABLE}")
        return self

    def exprs(self) -> list[str]:
        """Every query of every panel."""
        return [target.expr for panel in self.panels for target in panel.targets]


def load_dashboard(path: Path = DASHBOARD_PATH) -> Dashboard:
    return Dashboard.model_validate_json(path.read_text())


# PromQL words that are no metric: aggregation modifiers, vector matching, set operators, `bool`, `offset`.
_KEYWORDS = frozenset(
    {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset", "and", "or", "unless", "inf"}
)
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_BRACES = re.compile(r"\{[^{}]*\}")
_RANGE = re.compile(r"\[[^\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_VARIABLE = re.compile(r"\$\{[^}]*\}|\$\w+")
_IDENTIFIER = re.compile(r"(?<![\w:.])([A-Za-z_:][\w:]*)(\s*\()?")


def metric_names(expr: str) -> set[str]:
    """The metric names `expr` selects (label names, functions and keywords left out)."""
    text = _STRING.sub('""', expr)
    text = _VARIABLE.sub("", text)
    for pattern in (_BRACES, _RANGE, _GROUPING):
        text = pattern.sub(" ", text)
    names = set()
    for match in _IDENTIFIER.finditer(text):
        name, call = match.groups()
        if call is None and name.lower() not in _KEYWORDS:
            names.add(name)
    return names
