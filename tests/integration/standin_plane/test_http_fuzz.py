"""An HTTP fuzz against a live frontend (the real HAProxy with its rules and Lua action, over stand-in replicas that
log every request they get), on loopback, bounded in cases and time.

Over 500 raw requests, seeded: malformed request lines, oversize and duplicate headers, conflicting
`Content-Length` / `Transfer-Encoding` (smuggling attempts), bad chunk sizes, pipelined requests, h2c upgrades,
invalid UTF-8 and JSON bodies, stalled bodies, forged internal headers, random bytes. Each one gets a 2xx (it was a
valid request), a 4xx, or a 5xx with `x-serve-reason`, within the request timeout; no smuggled request and no forged
internal header reaches a replica; good requests sent all along get 200 only."""

from __future__ import annotations

import random
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import pytest

from base.contracts import INTERNAL_HEADER_PREFIXES, SERVE_REASON_HEADER
from infra.haproxy.apps import AppRoute
from infra.haproxy.protection import FrontendProtection
from tests.integration.standin_plane.plane import Env, Plane, start_plane, stop_plane
from tests.integration.standin_plane.standins import APP, BODY_BUFFER_BYTES, CHAT_PATH, LOOPBACK

pytestmark = pytest.mark.integration

SEED = 2812
REQUEST_TIMEOUT_S = 1.0
CHECK_INTER_S = 2.0
# A case's answer must come within the request timeout and this margin (HAProxy answers a stalled request at it).
ANSWER_MARGIN_S = 4.0
SMUGGLED_PATH = "/smuggled"
FORGED = "forged-by-fuzz"
GOOD_BODY = b'{"events": 1}'
STALLED = "stalled body"
PIPELINED = "pipelined"


@dataclass(frozen=True)
class Case:
    kind: str
    data: bytes


def _request(method: str = "POST", path: str = CHAT_PATH, headers: list[str] | None = None, body: bytes = b"") -> bytes:
    lines = [f"{method} {path} HTTP/1.1", f"Host: {LOOPBACK}", *(headers or [])]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def _cases(rng: random.Random) -> list[Case]:
    cases: list[Case] = []
    add = lambda kind, data: cases.append(Case(kind, data))  # noqa: E731
    length = f"Content-Length: {len(GOOD_BODY)}"
    for _ in range(60):  # malformed request lines
        method = rng.choice(["POST", "GET", "P0ST", "", "GET GET", "\x00POST", "post"])
        target = rng.choice([CHAT_PATH, "", "*", "http://evil.example/x", "/v1/../../etc", "/%zz", "/a b", "/" * 300])
        version = rng.choice(["HTTP/1.1", "HTTP/1.0", "HTTP/9.9", "HTTP/1", "", "HTTPS/1.1", "HTTP/1.1 extra"])
        add("request line", f"{method} {target} {version}\r\nHost: x\r\n\r\n".encode("latin-1"))
    for size in (17_000, 40_000, 70_000):  # oversize headers (over the 16 KiB limit)
        for _ in range(10):
            add(
                "oversize header",
                _request(headers=[f"X-Big: {'a' * (size + rng.randrange(100))}", length], body=GOOD_BODY),
            )
    for _ in range(40):  # duplicate headers
        name = rng.choice(["Content-Length", "Host", "Content-Type", "X-Session-Id", "Authorization"])
        values = [
            str(rng.choice([len(GOOD_BODY), 0, 5, 999])) if name == "Content-Length" else f"v{i}" for i in range(3)
        ]
        add("duplicate header", _request(headers=[f"{name}: {v}" for v in values], body=GOOD_BODY))
    for _ in range(60):  # smuggling: CL and TE together, obfuscated TE, a request hidden in the body
        smuggled = _request("GET", SMUGGLED_PATH)
        chunked = b"0\r\n\r\n" + smuggled
        te = rng.choice(["chunked", " chunked", "chunked ", "xchunked", "chunked, identity", "CHUNKED", "chunked\t"])
        headers = [f"Transfer-Encoding: {te}", f"Content-Length: {rng.choice([4, len(chunked), 0])}"]
        rng.shuffle(headers)
        add("smuggling", _request(headers=headers, body=chunked))
        add(
            "smuggling",
            _request(headers=[f"Content-Length: {len(GOOD_BODY)}", "Content-Length: 0"], body=GOOD_BODY + smuggled),
        )
    for _ in range(50):  # bad chunk sizes
        size = rng.choice(["zz", "-1", "ffffffffffffffffffff", "1;ext=\x01", "", " 5", "5 ", "0x5"])
        body = f"{size}\r\nhello\r\n0\r\n\r\n".encode("latin-1")
        add("chunk size", _request(headers=["Transfer-Encoding: chunked"], body=body))
    for _ in range(40):  # pipelined requests: each must be answered in order, none lost; the last one closes
        count = rng.randint(2, 4)
        pipelined = [_request(headers=[length], body=GOOD_BODY) for _ in range(count - 1)]
        add(PIPELINED, b"".join([*pipelined, _request(headers=[length, "Connection: close"], body=GOOD_BODY)]))
    for _ in range(20):  # h2c upgrade attempts and the h2 preface in clear
        add(
            "h2c",
            _request(
                "GET",
                "/v1/models",
                ["Connection: Upgrade, HTTP2-Settings", "Upgrade: h2c", "HTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA"],
            ),
        )
        add("h2c", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes(rng.randrange(256) for _ in range(24)))
    for _ in range(50):  # invalid UTF-8 and JSON bodies
        body = rng.choice([b"\xff\xfe\xfd", b'{"model": "\xc3\x28"}', b"{" * 2000, b'{"messages": [', b"null", b"[]"])
        add("body", _request(headers=[f"Content-Length: {len(body)}", "Content-Type: application/json"], body=body))
    for _ in range(60):  # forged internal headers
        name = rng.choice(INTERNAL_HEADER_PREFIXES) + rng.choice(["replica", "pinned", "capacity-token", "path", "x"])
        add("forged header", _request(headers=[f"{name}: {FORGED}", length], body=GOOD_BODY))
    for _ in range(10):  # a body shorter than its Content-Length: the request timeout answers it (408)
        add(
            "stalled body",
            _request(headers=[f"Content-Length: {len(GOOD_BODY) + rng.randint(1, 500)}"], body=GOOD_BODY),
        )
    for _ in range(60):  # random bytes
        add("random bytes", bytes(rng.randrange(256) for _ in range(rng.randint(1, 400))))
    return cases


def _requests_in(case: Case) -> int:
    return case.data.count(b"HTTP/1.1\r\n")


def _status(reply: bytes) -> tuple[int, bytes] | None:
    """The first response's status and head, or None when the connection closed without one."""
    head, _, _ = reply.partition(b"\r\n\r\n")
    parts = head.split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/") or not parts[1].isdigit():
        return None
    return int(parts[1]), head.lower()


def _send(port: int, case: Case) -> tuple[Case, bytes, float]:
    began = time.monotonic()
    chunks = []
    with socket.create_connection((LOOPBACK, port), timeout=REQUEST_TIMEOUT_S + ANSWER_MARGIN_S) as conn:
        try:
            conn.sendall(case.data)
            # A stalled sender keeps its side open: the request timeout must answer it. Pipelined requests keep it
            # open too (a half-closed client would be taken as gone after the first); their last one asks to close.
            if case.kind not in (STALLED, PIPELINED):
                conn.shutdown(socket.SHUT_WR)
            while chunk := conn.recv(65536):
                chunks.append(chunk)
        except (ConnectionResetError, BrokenPipeError, TimeoutError):  # a timeout is judged as a hang below
            pass
    return case, b"".join(chunks), time.monotonic() - began


@pytest.fixture(scope="module")
def plane(env: Env, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Plane]:
    app = AppRoute(name=APP, forward_body=True, body_buffer_bytes=BODY_BUFFER_BYTES)
    started = start_plane(
        env.loop,
        tmp_path_factory.mktemp("fuzz"),
        app,
        [env.r1.endpoint, env.r2.endpoint],
        [env.router_a.endpoint],
        # The stand-ins answer their health checks from this process, whose 16 fuzzing threads hold its GIL: at the
        # planes' 0.5 s (the check's own timeout too) a starved fast tier twice saw the router marked DOWN
        # (router_unreachable). The deployed default's checks are slower still (`CHECK_INTER_S_DEFAULT`).
        check_inter_s=CHECK_INTER_S,
        protection=FrontendProtection(request_timeout_s=REQUEST_TIMEOUT_S),
    )
    yield started
    stop_plane(started)


def test_500_fuzzed_requests_get_an_answer_in_time_smuggle_nothing_and_leave_good_traffic_alone(
    env: Env, plane: Plane
) -> None:
    cases = _cases(random.Random(SEED))
    assert len(cases) >= 500
    before = len(env.r1.requests) + len(env.r2.requests)
    good: list[tuple[int, str | None]] = []
    stop = threading.Event()

    def good_traffic() -> None:
        with httpx.Client(base_url=plane.url, timeout=30) as client:
            while not stop.is_set() and len(good) < 2000:
                answer = client.post(CHAT_PATH, content=GOOD_BODY)
                good.append((answer.status_code, answer.headers.get(SERVE_REASON_HEADER)))

    sender = threading.Thread(target=good_traffic)
    sender.start()
    try:
        with ThreadPoolExecutor(16) as pool:
            results = list(pool.map(lambda case: _send(plane.haproxy.settings.port, case), cases))
    finally:
        stop.set()
        sender.join(timeout=60)
    failures = []
    for case, reply, took in results:
        answer = _status(reply)
        if took > REQUEST_TIMEOUT_S + ANSWER_MARGIN_S - 0.5:
            failures.append((case.kind, "hang", took, reply[-300:]))
        elif answer is not None and answer[0] >= 500 and SERVE_REASON_HEADER.encode() not in answer[1]:
            failures.append((case.kind, f"bare {answer[0]}", case.data[:80]))
        elif answer is not None and not (200 <= answer[0] < 300 or 400 <= answer[0] < 600):
            failures.append((case.kind, f"status {answer[0]}", case.data[:80]))
    assert not failures, failures[:10]
    for case, reply, _ in results:  # pipelined requests: each answered, in order, on the one connection
        if case.kind == PIPELINED:
            assert reply.count(b"HTTP/1.1 200 ") == _requests_in(case), reply[:300]
    stalled = [_status(reply) for case, reply, _ in results if case.kind == STALLED]
    assert [answer[0] if answer else None for answer in stalled] == [408] * len(stalled)
    received = (env.r1.requests + env.r2.requests)[before:]
    assert not [r for r in received if r.path.startswith(SMUGGLED_PATH)], "a smuggled request reached a replica"
    assert not [r for r in received for _, value in r.headers if FORGED in value], "a forged header reached a replica"
    answered = {kind: 0 for kind in {case.kind for case in cases}}
    for case, reply, _ in results:
        answered[case.kind] += _status(reply) is not None
    print(f"fuzz: {len(cases)} cases, answered by kind {answered}, good traffic {len(good)} requests")
    assert good and {status for status, _ in good} == {200}, sorted(set(good), key=str)
