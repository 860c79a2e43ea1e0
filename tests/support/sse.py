"""Reading OpenAI-style SSE streams in tests."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx

from base import sse
from base.sse import DONE


def data_lines(response: httpx.Response) -> list[str]:
    """The `data:` payloads of an SSE response, in order."""
    return sse.data_payloads(sse.iter_lines(response.iter_bytes()))


def data_payloads(body: str | bytes) -> list[str]:
    """The `data:` payloads of a whole SSE body."""
    return sse.data_payloads(sse.lines(body))


def chunks(payloads: list[str]) -> list[dict[str, Any]]:
    """Parse every payload but the final `[DONE]`, which must be last and only last."""
    assert payloads and payloads[-1] == DONE, payloads[-3:]
    assert DONE not in payloads[:-1]
    return [json.loads(p) for p in payloads[:-1]]


def stream_lines(response: httpx.Response) -> Iterator[str]:
    """The lines of a streamed response as they arrive, ended where SSE ends them (`base/sse.py`)."""
    return sse.iter_lines(response.iter_bytes())


def astream_lines(response: httpx.Response) -> AsyncIterator[str]:
    return sse.aiter_lines(response.aiter_bytes())
