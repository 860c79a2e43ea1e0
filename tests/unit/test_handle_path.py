"""`chosen_stream`: the call is dispatched on the chosen replica and its stream read (or cancelled) inside the
choice's context, Ray's rule for `choose_replica` / `dispatch`."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import pytest

from base.contracts import PREFILL_REPLICA_HEADER, PREFILL_URL_HEADER
from services.legacy.handle_path import chosen_stream, prefill_choice


@dataclass
class Selection:
    replica_id: str


@dataclass
class RecordingHandle:
    """A handle's `choose_replica` / `dispatch` pair that records the order of what happens."""

    items: int
    log: list[str] = field(default_factory=list)

    @asynccontextmanager
    async def choose_replica(self, *args: object) -> AsyncIterator[Selection]:
        self.log.append(f"choose{args}")
        try:
            yield Selection("replica-b")
        finally:
            self.log.append("context exit")

    def dispatch(self, selection: Selection, *args: object) -> Response:
        self.log.append(f"dispatch {selection.replica_id}{args}")
        return Response(self)


@dataclass
class Response:
    handle: RecordingHandle
    sent: int = 0

    def __aiter__(self) -> Response:
        return self

    async def __anext__(self) -> int:
        if self.sent == self.handle.items:
            self.handle.log.append("stream end")
            raise StopAsyncIteration
        self.sent += 1
        return self.sent

    def cancel(self) -> None:
        self.handle.log.append(f"cancel after {self.sent}")


def test_the_stream_is_dispatched_on_the_choice_and_read_to_its_end_inside_it() -> None:
    handle = RecordingHandle(items=3)

    async def read() -> tuple[str, list[int]]:
        async with chosen_stream(handle, "POST", "/v1") as chosen:
            return chosen.replica_id, [item async for item in chosen.items]

    assert asyncio.run(read()) == ("replica-b", [1, 2, 3])
    assert handle.log == ["choose('POST', '/v1')", "dispatch replica-b('POST', '/v1')", "stream end", "context exit"]


def test_a_stream_left_unread_is_cancelled_before_the_choice_ends() -> None:
    handle = RecordingHandle(items=5)

    async def read_one() -> int:
        async with chosen_stream(handle) as chosen:
            return await anext(chosen.items)

    assert asyncio.run(read_one()) == 1
    assert handle.log[-2:] == ["cancel after 1", "context exit"]


def test_a_caller_that_fails_mid_stream_cancels_it_inside_the_choice() -> None:
    handle = RecordingHandle(items=5)

    async def fail() -> None:
        async with chosen_stream(handle) as chosen:
            async for item in chosen.items:
                if item == 2:
                    raise RuntimeError("client gone")

    with pytest.raises(RuntimeError, match="client gone"):
        asyncio.run(fail())
    assert handle.log[-2:] == ["cancel after 2", "context exit"]


def test_a_prefill_choice_names_the_chosen_replica_at_its_url_and_holds_it_until_the_caller_leaves() -> None:
    handle = RecordingHandle(items=0)
    urls = {"replica-b": "http://127.0.0.1:8123/pd-prefill"}

    async def url_of(replica_id: str) -> str | None:
        handle.log.append(f"url of {replica_id}")
        return urls.get(replica_id)

    async def run() -> dict[str, str]:
        async with prefill_choice(handle, url_of, "POST", "/v1/completions") as headers:
            handle.log.append("decode call")
            return headers

    headers = asyncio.run(run())
    assert headers == {PREFILL_REPLICA_HEADER: "replica-b", PREFILL_URL_HEADER: urls["replica-b"]}
    assert handle.log == ["choose('POST', '/v1/completions')", "url of replica-b", "decode call", "context exit"]
    # No URL known for the chosen replica: no prefill named (the decode replica answers `prefill_unrouted`).
    urls.clear()
    assert asyncio.run(run()) == {}
