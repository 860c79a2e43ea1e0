"""`sluice check`'s verdict without a stack: pass only when every item ran and passed, incomplete (exit 4) when items
were skipped (each naming why and what runs it), fail when any failed; skips the user allows; unknown item names."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from builders.specs import load_spec
from sluice.deploy.check import checklist as check_module
from sluice.deploy.check.checklist import (
    CHECK_EXIT_FAIL,
    CHECK_EXIT_INCOMPLETE,
    CHECK_EXIT_PASS,
    ENABLED_BY,
    FAULT_INJECTION,
    ITEMS,
    LEGACY_SAME_TEXTS,
    NEEDS_SPEC_ENABLED_BY,
    SERVER_MAP,
    STARTUP_PATH,
    TIMEOUT_CLEANUP,
    Item,
    check,
    fault_injection,
    legacy_same_texts,
    report,
    run_checks,
    verdict,
)

ROOT = Path(__file__).resolve().parents[2]
SKIPPED = Item(FAULT_INJECTION, None, "not a staging stack", ENABLED_BY[FAULT_INJECTION])
PASSED = Item("versions", True, "ray 2, vllm 0")
FAILED = Item("server map", False, "r1 is not UP")


def test_every_item_ran_and_passed_is_pass_exit_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert report([PASSED], as_json=False) == CHECK_EXIT_PASS == 0
    assert capsys.readouterr().out.rstrip().endswith("verdict: PASS")
    assert verdict([PASSED]) == {"verdict": "pass", "failed": [], "skipped": [], "items": [PASSED.__dict__]}


def test_a_skipped_item_makes_the_verdict_incomplete_exit_4_naming_why_and_what_runs_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert report([PASSED, SKIPPED], as_json=True) == CHECK_EXIT_INCOMPLETE == 4
    document = json.loads(capsys.readouterr().out)
    assert document["verdict"] == "incomplete" and document["failed"] == []
    assert document["skipped"] == [
        {"item": FAULT_INJECTION, "reason": "not a staging stack", "enable_with": "spec setting `staging: true`",
         "allowed": False}
    ]  # fmt: skip
    report([PASSED, SKIPPED], as_json=False)
    table = capsys.readouterr().out
    assert "SKIP  fault injection  not a staging stack; runs with: spec setting `staging: true`" in table
    assert "verdict: INCOMPLETE (1 skipped: fault injection)" in table and "--allow-skip" in table


def test_an_allowed_skip_passes_but_is_still_reported_as_skipped(capsys: pytest.CaptureFixture[str]) -> None:
    allowed = Item(FAULT_INJECTION, None, "not a staging stack", ENABLED_BY[FAULT_INJECTION], allowed=True)
    assert report([PASSED, allowed], as_json=False) == CHECK_EXIT_PASS
    table = capsys.readouterr().out
    assert "SKIP  fault injection" in table and "(skip allowed)" in table
    assert "verdict: PASS (skips allowed: fault injection)" in table
    assert verdict([PASSED, allowed])["skipped"][0]["allowed"] is True


def test_any_failed_item_fails_exit_1_whatever_was_skipped(capsys: pytest.CaptureFixture[str]) -> None:
    assert report([PASSED, SKIPPED, FAILED], as_json=False) == CHECK_EXIT_FAIL == 1
    assert capsys.readouterr().out.rstrip().endswith("verdict: FAIL (server map)")
    assert verdict([FAILED, SKIPPED])["verdict"] == "fail"


def test_an_unknown_allowed_item_is_refused_before_anything_runs_naming_the_items() -> None:
    # Port 1: a check that ran would fail to connect instead.
    with pytest.raises(ValueError) as refused:
        check(None, "http://127.0.0.1:1", "auto", False, allow_skip=[FAULT_INJECTION, "fault-injection"])
    message = str(refused.value)
    assert "'fault-injection'" in message and all(repr(name) in message for name in ITEMS)


class _Frontend:
    """A frontend answering `/v1/models` and `/version`, and 500 to everything else."""

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m"}]})
        if request.url.path == "/version":
            return httpx.Response(200, json={"version": "0"})
        return httpx.Response(500)


def test_with_target_the_items_that_need_the_spec_are_skipped_naming_the_spec_file(monkeypatch) -> None:
    @contextmanager
    def fake_client(verify: object = True, headers: object = None) -> Iterator[httpx.Client]:
        with httpx.Client(transport=httpx.MockTransport(_Frontend())) as client:
            yield client

    monkeypatch.setattr(check_module, "check_client", fake_client)
    items = run_checks(None, None, "http://frontend", allow_skip=[SERVER_MAP])
    skipped = {i.item: i for i in items if i.ok is None}
    assert set(skipped) == {
        STARTUP_PATH,
        SERVER_MAP,
        "served replica is the chosen one",
        FAULT_INJECTION,
        TIMEOUT_CLEANUP,
        LEGACY_SAME_TEXTS,
    }
    assert {i.enable_with for i in skipped.values()} == {NEEDS_SPEC_ENABLED_BY}
    assert [name for name, i in skipped.items() if i.allowed] == [SERVER_MAP]


def test_a_spec_s_skips_name_the_settings_that_run_them() -> None:
    spec = load_spec(ROOT / "topologies" / "teams" / "local-cpu.yaml")
    assert not spec.staging and not spec.ingress.retains_legacy
    assert fault_injection(None, "", spec, None)[0] is None  # type: ignore[arg-type]
    model = type("Planned", (), {"legacy_deployed": False})()
    assert legacy_same_texts(None, "", model)[0] is None  # type: ignore[arg-type]
    # The settings named are the spec's own, and the values named run the items.
    assert ENABLED_BY[FAULT_INJECTION] == "spec setting `staging: true`" and "staging" in type(spec).model_fields
    assert ENABLED_BY[LEGACY_SAME_TEXTS].startswith("spec setting `ingress.mode: both` or `legacy`")
    assert all(spec.ingress.model_copy(update={"mode": mode}).retains_legacy for mode in ("both", "legacy"))
