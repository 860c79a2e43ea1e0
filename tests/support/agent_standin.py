"""A route agent process for the data-plane tests: sluice's own SPOE agent (`RouteListener`) in front of a scripted
answer instead of a policy, so a test can make it answer badly, stall, or be killed by its PID.

`python -m tests.support.agent_standin PORT SCRIPT CALLS`: serves on 127.0.0.1:PORT; before each answer reads
SCRIPT (JSON: `mode` choose | refuse | stall, `ranked` replica ids, `reason`), and appends the call to CALLS (one
JSON line: the headers and body length it got).
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Mapping
from pathlib import Path

from base.agent_wire import Answer
from base.route_wire import RouteRefusal, RouteReply
from services.router.route_listener import RouteListener

SESSION_HEADER = "x-session-id"


def scripted_answer(script: Path, calls: Path):  # noqa: ANN201 - a RouteAnswer
    async def answer(headers: Mapping[str, str], body: bytes) -> tuple[int, Answer]:
        with calls.open("a") as log:
            log.write(json.dumps({"headers": dict(headers), "body_len": len(body)}) + "\n")
        wanted = json.loads(script.read_text())
        if wanted["mode"] == "stall":
            await asyncio.sleep(60)
        if wanted["mode"] == "refuse":
            return 503, RouteRefusal(reason=wanted["reason"])
        ranked = wanted["ranked"]
        return 200, RouteReply(replica_id=ranked[0], fallbacks=ranked[1:])

    return answer


async def serve(port: int, script: Path, calls: Path) -> None:
    listener = RouteListener(scripted_answer(script, calls), SESSION_HEADER)
    await listener.start("127.0.0.1", port)
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(serve(int(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])))
