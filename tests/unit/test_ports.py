"""Test ports: pytest-xdist's workers pick from slices of their own, and one process never hands a port out twice,
so a port picked but not bound yet is never another server's."""

from __future__ import annotations

import pytest

from tests.support import ports


def test_each_worker_picks_from_its_own_slice(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
    picked = {}
    for worker in ("gw0", "gw1"):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        picked[worker] = {ports.free_port() for _ in range(50)}
    assert all(20000 <= p < 25000 for p in picked["gw0"]) and all(25000 <= p < 30000 for p in picked["gw1"])


def test_a_port_handed_out_is_not_handed_out_again(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ports, "_TEST_PORTS", range(20000, 20300))
    monkeypatch.setattr(ports, "_handed_out", set())
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    picked = [ports.free_port() for _ in range(100)]
    assert len(set(picked)) == 100
