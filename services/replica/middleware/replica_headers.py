"""ASGI middleware: stamp every response with the serving replica and the request id, and send its headers with its
first bytes of body, so the time to the headers the frontend logs on either path is the time to the first token.
Pure ASGI, like every middleware here (services/replica/README.md).
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from base.contracts import (
    DATA_PARALLEL_RANK_HEADER,
    ENGINE_STAND_IN_HEADER,
    REPLICA_HEADER,
    REQUEST_ID_HEADER,
    SERVED_RANK_HEADER,
)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

_REQUEST_ID = REQUEST_ID_HEADER.encode()
_REPLICA = REPLICA_HEADER.encode()
_RANK = DATA_PARALLEL_RANK_HEADER.encode()
_SERVED_RANK = SERVED_RANK_HEADER.encode()
_STAND_IN = ENGINE_STAND_IN_HEADER.encode()
MAX_REQUEST_ID_LEN = 128


def _valid_request_id(raw: bytes) -> bool:
    return 0 < len(raw) <= MAX_REQUEST_ID_LEN and all(0x21 <= b <= 0x7E for b in raw)


class ReplicaHeadersMiddleware:
    """Give the request an `x-request-id` (the client's, or a new one when absent or malformed) and
    stamp the response with `x-serve-replica` (and with `x-serve-data-parallel-rank`: the rank of a replica that is
    one DP rank, else the engine rank the request named, which vLLM honours), and with `x-serve-engine-stand-in` when
    the replica's engine is a benchmark stand-in (services.replica.zero_compute_engine).

    `echo_request_id` also writes `x-request-id` on the response. Serve's direct ingress already
    echoes it on the HTTP path (it would appear twice), so only the in-process handle path sets it.
    """

    def __init__(
        self,
        app: ASGIApp,
        replica_id: str,
        echo_request_id: bool,
        data_parallel_rank: int | None = None,
        engine_stand_in: str | None = None,
    ) -> None:
        self.app = app
        self.replica_id = replica_id.encode()
        self.echo_request_id = echo_request_id
        self.data_parallel_rank = str(data_parallel_rank).encode() if data_parallel_rank is not None else None
        self.engine_stand_in = engine_stand_in.encode() if engine_stand_in is not None else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = [(k, v) for k, v in scope["headers"] if k.lower() != _REQUEST_ID]
        sent = [v for k, v in scope["headers"] if k.lower() == _REQUEST_ID]
        request_id = sent[0] if sent and _valid_request_id(sent[0]) else uuid.uuid4().hex.encode()
        scope["headers"] = [*headers, (_REQUEST_ID, request_id)]
        rank = self.data_parallel_rank or next((v for k, v in headers if k.lower() == _RANK), None)

        held: list[Message] = []

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                stamped = (_REQUEST_ID, _REPLICA) if self.echo_request_id else (_REPLICA,)
                if self.engine_stand_in is not None:
                    stamped = (*stamped, _STAND_IN)  # the simulator's app names itself too: say it once
                kept = [(k, v) for k, v in message.get("headers", []) if k.lower() not in stamped]
                kept.append((_REPLICA, self.replica_id))
                if rank is not None:
                    kept.append((_SERVED_RANK, rank))
                if self.engine_stand_in is not None:
                    kept.append((_STAND_IN, self.engine_stand_in))
                if self.echo_request_id:
                    kept.append((_REQUEST_ID, request_id))
                message["headers"] = kept
                held.append(message)
                return
            if held and message["type"] == "http.response.body":
                if not message.get("body") and message.get("more_body", False):
                    return  # an empty flush before the first bytes: the headers wait for them
                await send(held.pop())
            await send(message)

        await self.app(scope, receive, send_with_headers)
