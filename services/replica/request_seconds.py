"""An engine's recent mean time per request, from its arrival in the engine to its last token: what a router counts
a request it placed there for, until the engine's load report shows it (`routers.engine_load`).

An exponentially weighted mean with `REQUEST_SECONDS_WEIGHT` on the newest finished request (about the last ten): it
follows a load change within a few requests, and one long request moves it by a tenth.
"""

from __future__ import annotations

REQUEST_SECONDS_WEIGHT = 0.1


class RequestSeconds:
    """The mean so far; None before a request finished."""

    def __init__(self) -> None:
        self.value: float | None = None

    def finished(self, seconds: float) -> None:
        if self.value is None:
            self.value = seconds
        else:
            self.value += REQUEST_SECONDS_WEIGHT * (seconds - self.value)
