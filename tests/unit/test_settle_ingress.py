"""How `deploy` settles the declared ingress (review #17), against a scripted frontend and Serve: a frontend that
does not answer yet is not settled (deploy goes on asking), a run-time weight kept over the same declaration
settles, and a legacy app the spec no longer retains is deleted only once no request goes there."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from ray import serve

from builders.plan import build_plan
from builders.specs import load_spec
from sluice.deploy import apply

DIRECT = Path(__file__).resolve().parents[2] / "topologies" / "teams" / "local-cpu.yaml"


class _Answer:
    def __init__(self, value: dict[str, Any] | Exception) -> None:
        self._value = value

    def result(self, timeout_s: float) -> dict[str, Any]:
        if isinstance(self._value, Exception):
            raise self._value
        return self._value


class _Frontend:
    """`ingress.remote()` answers these in turn, the last one from then on."""

    def __init__(self, *answers: dict[str, Any] | Exception) -> None:
        self.answers = list(answers)
        self.ingress = self

    def remote(self) -> _Answer:
        return _Answer(self.answers.pop(0) if len(self.answers) > 1 else self.answers[0])


def _ingress(weight: int, declared: int = 100) -> dict[str, Any]:
    return {"direct_weight": weight, "declared_weight": declared, "drain": None}


def _settle(monkeypatch: pytest.MonkeyPatch, frontend: _Frontend) -> tuple[list[str], list[str]]:
    """(apps deleted, lines said) of settling local-cpu.yaml (a direct stack whose legacy app still runs)."""
    spec = load_spec(DIRECT)
    plan = build_plan(spec)
    legacy = plan.models[0].legacy_app
    deleted: list[str] = []

    class _Status:
        applications = {legacy: object()}

    monkeypatch.setattr(serve, "get_app_handle", lambda name: frontend)
    monkeypatch.setattr(serve, "status", lambda: _Status())
    monkeypatch.setattr(serve, "delete", deleted.append)
    said: list[str] = []
    apply.settle_ingress(spec, plan, said.append)
    return deleted, said


def test_a_frontend_busy_at_first_is_asked_again_and_the_unused_legacy_app_deleted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    deleted, said = _settle(monkeypatch, _Frontend(RuntimeError("frontend restarting"), _ingress(100)))
    assert deleted == ["platform-local-cpu-legacy"]
    assert "frontend: direct weight 100% (ingress mode direct)" in said


def test_a_legacy_app_requests_still_reach_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    # A rollback (weight 0) set over this same declaration is in force: the legacy path serves everything.
    deleted, said = _settle(monkeypatch, _Frontend(_ingress(0)))
    assert deleted == []
    assert any("run-time weight over the declared 100%" in line for line in said)
    assert any("kept" in line for line in said)
