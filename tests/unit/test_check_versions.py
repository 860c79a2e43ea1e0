"""`sluice check`'s versions item: this CLI's Ray and vLLM against every replica's and against the expected ones."""

from __future__ import annotations

import httpx
import pytest

from base.route_wire import ComponentVersions
from sluice.deploy.check import versions as check_versions
from sluice.deploy.check.versions import versions

CLI = ComponentVersions.installed()
BASE = "http://127.0.0.1:9"


def _frontend(vllm: str) -> httpx.Client:
    """A client whose frontend answers vLLM's `GET /version` with `vllm`."""
    return httpx.Client(transport=httpx.MockTransport(lambda _: httpx.Response(200, json={"version": vllm})))


def _plan_with_replicas(monkeypatch: pytest.MonkeyPatch, **runs: dict[str, str]) -> dict[str, str]:
    """The replicas' apps (each named as it runs); their versions answer `runs`."""
    monkeypatch.setattr(check_versions, "replica_versions", lambda client, apps: runs)
    return {who: f"http://127.0.0.1:9/{who}" for who in runs}


def test_the_replicas_behind_a_target_run_this_clis_vllm() -> None:
    ok, detail = versions(_frontend(CLI.vllm), BASE, None, {})
    assert ok is True and f"vllm {CLI.vllm}" in detail and f"ray {CLI.ray}" in detail
    ok, detail = versions(_frontend("0.1.0"), BASE, None, {})
    assert ok is False and detail == f"a replica behind the frontend runs vllm 0.1.0, this CLI {CLI.vllm}"


def test_every_replica_is_named_with_what_it_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    same = CLI.model_dump()
    plan = _plan_with_replicas(monkeypatch, a=same, b={**same, "ray": "2.0.0"})
    ok, detail = versions(_frontend(CLI.vllm), BASE, plan, {})
    assert ok is False and detail == f"b runs ray 2.0.0, this CLI {CLI.ray}"
    plan = _plan_with_replicas(monkeypatch, a=same, b=same)
    ok, detail = versions(_frontend(CLI.vllm), BASE, plan, {})
    assert ok is True and "2 replicas (ray, vllm)" in detail


def test_an_expected_version_binds_this_cli_and_every_replica(monkeypatch: pytest.MonkeyPatch) -> None:
    same = CLI.model_dump()
    plan = _plan_with_replicas(monkeypatch, a=same)
    ok, detail = versions(_frontend(CLI.vllm), BASE, plan, {"ray": CLI.ray})
    assert ok is True and "as expected (ray)" in detail
    ok, detail = versions(_frontend(CLI.vllm), BASE, plan, {"vllm": "9.9.9"})
    assert ok is False
    assert detail == f"this CLI runs vllm {CLI.vllm}, expected 9.9.9; a runs vllm {CLI.vllm}, expected 9.9.9"


def test_a_plan_with_no_replica_running_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    plan = _plan_with_replicas(monkeypatch)
    assert versions(_frontend(CLI.vllm), BASE, plan, {}) == (False, "no LLM replica is running")
