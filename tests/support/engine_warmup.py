"""Let every engine of an app answer once, directly on its replica's port, and read the request time it then
reports: a router counts each request it places on an engine for that long (`routers.engine_load`), and before an
engine's first answer it counts up to `PLACEMENT_TTL_S`, so a test that ranks a client's requests one after another
warms every engine first.
"""

from __future__ import annotations

import asyncio

import httpx

from base.contracts import ENGINE_LOAD_PATH
from base.route_wire import EngineLoads
from base.tiny_model import SERVED_MODEL_NAME
from base.waiting import wait_until
from services.internal_credential import internal_headers
from services.serve_internals import list_replica_endpoints

REPORT_WAIT_S = 10


def answer_once_on_every_replica(app: str) -> list[float]:
    """Each engine's request time (seconds) after one direct answer, as its load report says it within
    `REPORT_WAIT_S` (an engine's stat logger may record the request after its answer is sent)."""
    body = {"model": SERVED_MODEL_NAME, "messages": [{"role": "user", "content": "ka lo"}], "max_tokens": 2}
    seconds: list[float] = []
    with httpx.Client(timeout=120, headers=internal_headers()) as client:
        for replica in asyncio.run(list_replica_endpoints(app)):
            answer = client.post(f"{replica.url}/{app}/v1/chat/completions", json=body)
            assert answer.status_code == 200, answer.text

            def reported(url: str = f"{replica.url}/{app}{ENGINE_LOAD_PATH}") -> list[float] | None:
                ranks = EngineLoads.model_validate_json(client.get(url).content).ranks.values()
                times = [rank.request_seconds for rank in ranks if rank.request_seconds is not None]
                return times if len(times) == len(ranks) else None

            seconds += wait_until(REPORT_WAIT_S, reported, f"{replica.replica_id}'s request time", poll_s=0.1)
    assert all(0 < s < 5 for s in seconds), seconds
    return seconds
