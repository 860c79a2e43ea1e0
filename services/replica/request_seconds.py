"""An engine's recent mean time per request, from its arrival in the engine to its last token: what a router counts
a request it placed there for, until the engine's load report shows it (`routers.engine_load`).

A running mean (`base.running_mean`) from the first finished request on, with `REQUEST_SECONDS_WEIGHT` on the newest
(about the last ten): it follows a load change within a few requests, and one long request moves it by a tenth.
"""

from __future__ import annotations

from base.running_mean import RunningMean

REQUEST_SECONDS_WEIGHT = 0.1


class RequestSeconds:
    """The mean so far; None before a request finished."""

    def __init__(self) -> None:
        self._mean: RunningMean | None = None

    @property
    def value(self) -> float | None:
        return None if self._mean is None else self._mean.value

    def finished(self, seconds: float) -> None:
        if self._mean is None:
            self._mean = RunningMean(REQUEST_SECONDS_WEIGHT, seconds)
        else:
            self._mean.add(seconds)
