"""Reading OpenAI-style SSE streams in tests."""

from __future__ import annotations

import json
from typing import Any

import httpx

DONE = "[DONE]"


def data_lines(response: httpx.Response) -> list[str]:
    """The `data:` payloads of an SSE response, in order."""
    return [line[len("data: ") :] for line in response.iter_lines() if line.startswith("data: ")]


def data_payloads(text: str) -> list[str]:
    """The `data:` payloads of a whole SSE body."""
    return [line[len("data: ") :] for line in text.splitlines() if line.startswith("data: ")]


def chunks(payloads: list[str]) -> list[dict[str, Any]]:
    """Parse every payload but the final `[DONE]`, which must be last and only last."""
    assert payloads and payloads[-1] == DONE, payloads[-3:]
    assert DONE not in payloads[:-1]
    return [json.loads(p) for p in payloads[:-1]]
