import asyncio

from base.contracts import REPLICA_HEADER, REQUEST_ID_HEADER
from services.replica.middleware.replica_headers import ReplicaHeadersMiddleware


def _run(middleware: ReplicaHeadersMiddleware, request_headers: list[tuple[bytes, bytes]]):
    seen: dict = {}
    sent: list = []

    async def app(scope, receive, send):
        seen["headers"] = dict(scope["headers"])
        await send({"type": "http.response.start", "status": 200, "headers": [(b"x-serve-replica", b"forged")]})
        await send({"type": "http.response.body", "body": b"ok"})

    middleware.app = app

    async def receive():
        return {"type": "http.request", "body": b""}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "headers": request_headers}
    asyncio.run(middleware(scope, receive, send))
    return seen["headers"], sent[0]["headers"]


def test_generates_a_request_id_and_stamps_the_replica() -> None:
    request, response = _run(ReplicaHeadersMiddleware(None, "r1", echo_request_id=True), [])
    generated = request[REQUEST_ID_HEADER.encode()]
    assert len(generated) == 32
    assert response.count((REQUEST_ID_HEADER.encode(), generated)) == 1
    assert [v for k, v in response if k == REPLICA_HEADER.encode()] == [b"r1"]


def test_echoes_the_client_request_id() -> None:
    request, response = _run(
        ReplicaHeadersMiddleware(None, "r2", echo_request_id=True), [(b"x-request-id", b"abc-123")]
    )
    assert request[b"x-request-id"] == b"abc-123"
    assert (b"x-request-id", b"abc-123") in response


def test_replaces_a_malformed_request_id() -> None:
    bad = b"a" * 500
    request, response = _run(ReplicaHeadersMiddleware(None, "r3", echo_request_id=True), [(b"x-request-id", bad)])
    assert request[b"x-request-id"] != bad
    assert (b"x-request-id", bad) not in response


def test_without_echo_leaves_the_response_request_id_to_serve() -> None:
    request, response = _run(ReplicaHeadersMiddleware(None, "r4", echo_request_id=False), [(b"x-request-id", b"abc")])
    assert request[b"x-request-id"] == b"abc"
    assert all(k != b"x-request-id" for k, _ in response)
    assert (b"x-serve-replica", b"r4") in response
