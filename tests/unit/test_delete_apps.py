"""`delete_apps` (sluice down, a test stack's teardown): the frontend first and to the end, then the others at once."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from sluice.deploy import apply


class FakeServe:
    """Serve's `status` and `delete`: a blocking delete removes the app; a non-blocking one after the next status."""

    def __init__(self, apps: list[str]) -> None:
        self.apps = set(apps)
        self.calls: list[tuple[str, bool]] = []
        self.draining: set[str] = set()

    def status(self) -> SimpleNamespace:
        listed = dict.fromkeys(self.apps)
        self.apps -= self.draining
        self.draining.clear()
        return SimpleNamespace(applications=listed)

    def delete(self, name: str, _blocking: bool = True) -> None:
        self.calls.append((name, _blocking))
        if _blocking:
            self.apps.discard(name)
        else:
            self.draining.add(name)


@pytest.fixture(autouse=True)
def no_ledgers(monkeypatch: pytest.MonkeyPatch) -> None:
    """No ledger actors to end: Ray's named-actor list would start a Ray in this test process, whose address its
    later subprocesses would inherit (a `sluice deploy --address 127.0.0.1:1` then found a cluster)."""
    monkeypatch.setattr("routers.ledger_actor.end_ledgers", lambda apps: [])


def test_the_frontend_goes_first_and_the_rest_drain_together(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeServe(["s-llm", "s-router", "s-frontend", "other-frontend"])
    monkeypatch.setattr("ray.serve.status", fake.status)
    monkeypatch.setattr("ray.serve.delete", fake.delete)
    apply.delete_apps(["s-llm", "s-router", "s-frontend", "s-gone"])
    assert fake.calls == [("s-frontend", True), ("s-router", False), ("s-llm", False)]
    assert fake.apps == {"other-frontend"}


def test_apps_of_no_stack_drain_all_together(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeServe(["router-a", "router-b"])
    monkeypatch.setattr("ray.serve.status", fake.status)
    monkeypatch.setattr("ray.serve.delete", fake.delete)
    apply.delete_apps(["router-a", "router-b"], frontend_first=False)
    assert fake.calls == [("router-b", False), ("router-a", False)] and not fake.apps


def test_a_teardown_issues_every_delete_frontend_first_and_waits_for_none(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeServe(["s-llm", "s-router", "s-frontend"])
    monkeypatch.setattr("ray.serve.status", fake.status)
    monkeypatch.setattr("ray.serve.delete", fake.delete)
    apply.delete_apps(["s-llm", "s-router", "s-frontend"], wait=False)
    assert fake.calls == [("s-frontend", False), ("s-router", False), ("s-llm", False)]
    assert fake.draining == {"s-llm", "s-router", "s-frontend"}, "a status was read after the deletes"
