"""A Serve adapter's held capacity tokens (review #16): a request cancelled between the decision and its dispatch
never completes; its entry goes once the ledger's TTL has passed, so the map holds the requests of one TTL at most."""

from __future__ import annotations

from routers.core import CapacityToken
from routers.held_tokens import HeldTokens

TTL_S = 600.0


def _token(n: int) -> CapacityToken:
    return CapacityToken(token_id=f"t{n}", replica_id="r")


def test_a_completed_request_gives_its_token_once() -> None:
    held = HeldTokens(TTL_S, clock=lambda: 0.0)
    held.hold("a", _token(1))
    assert held.take("a") == _token(1) and held.take("a") is None and len(held) == 0


def test_entries_of_requests_that_never_completed_go_after_the_ttl() -> None:
    now = [0.0]
    held = HeldTokens(TTL_S, clock=lambda: now[0])
    for n in range(1000):  # cancelled before dispatch: never taken
        held.hold(f"cancelled-{n}", _token(n))
    now[0] = TTL_S + 1
    held.hold("next", _token(-1))
    assert len(held) == 1
    # A token held past the TTL is the ledger's again: taking it gives nothing to release.
    now[0] = 2 * TTL_S + 2
    assert held.take("next") is None
