"""What the real vLLM engines behind an app report on their /metrics."""

from __future__ import annotations

import asyncio
import re

import httpx

from services.serve_internals import list_replica_endpoints

_REQUESTS = re.compile(
    r"^vllm:(?:request_success_total|num_requests_running|num_requests_waiting)\{[^}]*\} (\S+)$", re.M
)


def engine_requests(app: str, route_prefix: str = "") -> float:
    """Requests the vLLM engines of `app` have finished or hold, over every replica: unchanged across a
    call means no engine received it."""
    total = 0.0
    for endpoint in asyncio.run(list_replica_endpoints(app)):
        response = httpx.get(f"{endpoint.url}{route_prefix}/metrics")
        response.raise_for_status()
        total += sum(float(v) for v in _REQUESTS.findall(response.text))
    return total
