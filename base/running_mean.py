"""An exponentially weighted running mean: each new value moves it by `weight` of its gap to the mean, so about the
last 1/weight values count. One rule for the means routers and replicas keep (an engine's request time, the prompts a
router placed, the body bytes per prompt token).
"""

from __future__ import annotations


class RunningMean:
    """The mean so far, `start` before any value."""

    def __init__(self, weight: float, start: float) -> None:
        if not 0.0 < weight <= 1.0:
            raise ValueError(f"weight must be in (0, 1], got {weight}")
        self.weight = weight
        self.value = start

    def add(self, value: float) -> None:
        self.value += self.weight * (value - self.value)
