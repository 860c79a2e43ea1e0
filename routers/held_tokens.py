"""The capacity tokens a Serve adapter holds for requests it routed, by request id, until Serve says they completed.

Serve tells the adapter of a completion only once a request reached a replica: a handle call cancelled after the
decision but before dispatch never completes, and its entry would stay. The ledger takes such a token back after its
TTL (`token_ttl_s`), so an entry older than that holds nothing any more: each `hold` drops those first (entries are in
the order they were held), so the map stays as large as the requests of the last TTL.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

from routers.core import CapacityToken


class HeldTokens:
    def __init__(self, token_ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._token_ttl_s = token_ttl_s
        self._clock = clock
        self._held: OrderedDict[str, tuple[CapacityToken, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._held)

    def hold(self, request_id: str, token: CapacityToken) -> None:
        now = self._clock()
        while self._held:
            _, (_, held_at) = next(iter(self._held.items()))
            if now - held_at < self._token_ttl_s:
                break
            self._held.popitem(last=False)
        self._held.pop(request_id, None)
        self._held[request_id] = (token, now)

    def take(self, request_id: str) -> CapacityToken | None:
        """The request's token, no longer held (None: none was, or the ledger has taken it back already)."""
        held = self._held.pop(request_id, None)
        if held is None:
            return None
        token, held_at = held
        return token if self._clock() - held_at < self._token_ttl_s else None
