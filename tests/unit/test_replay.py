"""`sluice replay`'s reading, sending and comparing, against two paths answered by httpx's MockTransport (the real
comparison of the direct and the legacy path is in tests/integration/test_legacy_ingress.py)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest

from loadtests.replay import RecordedRequest, RecordingError, load_recording, replay, report


def sse(*texts: str, extra: dict | None = None) -> bytes:
    chunks = [{"id": "c", "choices": [{"index": 0, "delta": {"content": t}, **(extra or {})}]} for t in texts]
    return b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"


def handler(request: httpx.Request) -> httpx.Response:
    """Path `a` and path `b` answer alike, except that `b` says something else to a prompt of "differ"."""
    body = json.loads(request.content)
    assert request.headers["x-session-id"] == "s1"
    prompt = body["messages"][0]["content"]
    text = "other" if request.url.host == "b" and prompt == "differ" else f"echo {prompt}"
    if body.get("stream"):
        return httpx.Response(200, content=sse(text[:3], text[3:]), headers={"content-type": "text/event-stream"})
    return httpx.Response(200, json={"id": "x", "choices": [{"index": 0, "message": {"content": text}}]})


def recording(*prompts: str, stream: bool = True) -> list[RecordedRequest]:
    return [
        RecordedRequest(
            at_s=0.01 * i,
            path="/v1/chat/completions",
            headers={"x-session-id": "s1"},
            body={"messages": [{"role": "user", "content": p}], "stream": stream},
        )
        for i, p in enumerate(prompts)
    ]


def test_two_paths_that_agree_are_identical_and_a_differing_text_is_named() -> None:
    requests = recording("one", "differ", "three")
    answers = asyncio.run(replay(requests, ["http://a", "http://b"], transport=httpx.MockTransport(handler)))
    assert [a.text for a, _ in answers] == ["echo one", "echo differ", "echo three"]
    summary, clean = report(answers, requests)
    assert not clean and summary["identical"] == 2 and summary["statuses"] == [200]
    [difference] = summary["differences"]
    assert difference["request"] == 2 and difference["differences"] == ["text 'echo differ' != 'other'"]


def test_a_streamed_and_a_whole_answer_differ_in_schema_not_text() -> None:
    streamed = asyncio.run(replay(recording("x"), ["http://a"], transport=httpx.MockTransport(handler)))[0][0]
    whole = asyncio.run(replay(recording("x", stream=False), ["http://a"], transport=httpx.MockTransport(handler)))
    assert streamed.text == whole[0][0].text == "echo x"
    assert streamed.schema_keys != whole[0][0].schema_keys


def test_an_unreachable_path_is_an_unanswered_request() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    requests = recording("one")
    answers = asyncio.run(replay(requests, ["http://a"], transport=httpx.MockTransport(refuse)))
    summary, clean = report(answers, requests)
    assert not clean and summary["unanswered"] == 1 and answers[0][0].status == 0


def test_a_bad_recording_line_is_named(tmp_path: Path) -> None:
    path = tmp_path / "rec.jsonl"
    good = recording("one")[0].model_dump_json()
    path.write_text(good + "\n\n" + '{"path": "v1/no-slash"}\n')
    with pytest.raises(RecordingError, match=r"rec.jsonl:3: path"):
        load_recording(path)
    path.write_text(good + "\n")
    assert load_recording(path) == recording("one")
