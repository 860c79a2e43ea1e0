"""What the real vLLM engines behind an app report on their /metrics."""

from __future__ import annotations

import asyncio
import re

import httpx

from services.serve_internals import list_replica_endpoints

_REQUESTS = re.compile(
    r"^vllm:(?:request_success_total|num_requests_running|num_requests_waiting)\{[^}]*\} (\S+)$", re.M
)


def engine_requests(app: str) -> float:
    """Requests the vLLM engines of `app` have finished or hold, over every replica: unchanged across a
    call means no engine received it."""
    total = 0.0
    for endpoint in asyncio.run(list_replica_endpoints(app)):
        total += sum(float(v) for v in _REQUESTS.findall(httpx.get(f"{endpoint.url}/metrics").text))
    return total
