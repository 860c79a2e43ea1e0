"""A staging router made to fail on purpose (`fault_injection`): `sluice check` and the tests see what a frontend does
when its router answers 500 `injected_fault`."""

from __future__ import annotations

import time

from pydantic import BaseModel, Field


class InjectedFault:
    """A staging router made to fail: every route call until `until` answers 500 `injected_fault`."""

    class Request(BaseModel):
        seconds: float = Field(ge=0, le=3600)

    def __init__(self) -> None:
        self.until = 0.0

    def arm(self, seconds: float) -> None:
        self.until = time.monotonic() + seconds

    def active(self) -> bool:
        return time.monotonic() < self.until
