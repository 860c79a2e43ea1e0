"""What is wrong with a spec, each problem with its field path (`models[0].resources.gpus`) and what to change
(`sluice validate` prints every one).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pydantic import ValidationError

# What to do about each kind of pydantic error, where pydantic's own message does not say ({kinds}: the kinds there
# are).
_FIXES = {
    "extra_forbidden": "unknown key: remove it or fix its spelling (`sluice schema` lists every key)",
    "missing": "required: add it",
    "union_tag_not_found": "required: the stack's kind, one of {kinds}",
    "union_tag_invalid": "unknown kind: use one of {kinds}",
}


@dataclass(frozen=True)
class SpecProblem:
    path: str  # "" for the file as a whole
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}" if self.path else self.message


class SpecError(ValueError):
    """Every problem of one spec."""

    def __init__(self, where: str, problems: list[SpecProblem]) -> None:
        self.where = where
        self.problems = problems
        super().__init__(f"{where}: {len(problems)} problem(s)\n" + "\n".join(f"  {p}" for p in problems))


def field_path(loc: tuple[int | str, ...]) -> str:
    """`("models", 0, "resources", "gpus")` -> `models[0].resources.gpus`."""
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path


def pydantic_problems(error: ValidationError, kinds: Sequence[str]) -> list[SpecProblem]:
    """Each of a spec's validation errors as a problem; `kinds`: the stack kinds there are (the union's tags)."""
    problems = []
    for item in error.errors():
        loc = tuple(item["loc"])
        if loc and loc[0] in kinds:  # a discriminated union puts the tag first
            loc = loc[1:]
        kind = item["type"]
        if kind in ("union_tag_not_found", "union_tag_invalid"):
            loc = ("kind",)
        fix = _FIXES.get(kind)
        message = fix.format(kinds=", ".join(kinds)) if fix else item["msg"].removeprefix("Value error, ")
        if kind == "too_short" and loc == ("models",):
            message = "no model: list at least one under `models`"
        problems.append(SpecProblem(field_path(loc), message))
    return problems
